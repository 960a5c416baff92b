"""OpenAI's answer shapes: what a completion, a chat completion and their stream chunks
carry (choices, messages, call deltas, logprobs, usage, finish reasons)."""

from __future__ import annotations

from typing import Any

from engine.outputs import FinishReason, TokenLogprob, Usage
from engine.text.tokenizer import Tokenizer
from service.tool_calls import ParsedText, ToolCallDelta, assemble

# Why a choice ended (ToolCallReader.finish_reason's words), as OpenAI says it.
FINISH_REASONS = {
    FinishReason.LENGTH.value: "length",
    FinishReason.CONTEXT_LIMIT.value: "length",
    FinishReason.EOS.value: "stop",
    FinishReason.STOP.value: "stop",
    FinishReason.CANCELLED.value: "abort",
    FinishReason.ERROR.value: "error",
    "tool_calls": "tool_calls",
}


def envelope(
    call_id: str, kind: str, created: int, model: str, choices: list[dict]
) -> dict[str, Any]:
    """The fields a completion, a chat completion and each of their chunks share."""
    return {"id": call_id, "object": kind, "created": created, "model": model, "choices": choices}


def usage(value: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": value.prompt_tokens,
        "completion_tokens": value.completion_tokens,
        "total_tokens": value.prompt_tokens + value.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": value.cached_tokens},
    }


def chat_message(parsed: ParsedText) -> dict[str, Any]:
    """A chat answer's message: its content and, where the model called tools, its calls
    (the content then None when it is only whitespace)."""
    if not parsed.tool_calls:
        return {"role": "assistant", "content": parsed.content}
    calls = [call.openai() for call in assemble(parsed.tool_calls)]
    content = parsed.content if parsed.content.strip() else None
    return {"role": "assistant", "content": content, "tool_calls": calls}


def tool_call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    """A streamed call piece as OpenAI sends it: index, id, type and name on a call's first,
    then arguments pieces."""
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    function = {"name": delta.name, "arguments": delta.arguments}
    return {"index": delta.index, "id": delta.id, "type": "function", "function": function}


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def chat_logprobs(items: list[TokenLogprob], tokenizer: Tokenizer) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            entry(item.token_id, item.logprob)
            | {"top_logprobs": [entry(t, lp) for t, lp in item.top]}
            for item in items
        ]
    }


def completion_logprobs(
    items: list[TokenLogprob | None], tokenizer: Tokenizer, offset: int
) -> dict[str, Any]:
    """The legacy completions shape; a prompt's first token (no logprob) comes as None."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for item in items:
        if item is None:
            continue
        text = token_text(tokenizer, item.token_id)
        tokens.append(text)
        token_logprobs.append(item.logprob)
        # The legacy API lists the sampled token too, when it is not among the top ones.
        alternatives = dict(item.top)
        alternatives.setdefault(item.token_id, item.logprob)
        top.append({token_text(tokenizer, t): lp for t, lp in alternatives.items()} or None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
