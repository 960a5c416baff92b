"""The one converter: a GenerationRequest (service/request.py) to the engine's inputs.

Every door parses its wire format into a GenerationRequest; this makes of it what the
engine takes: each prompt's checked token ids (engine/text/prompts.py), the SamplingParams, and
the tools offered with what the request asks of them. An error names the field as the
caller sent it (GenerationRequest.field_names).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from engine.errors import ValidationError
from engine.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams, check_count
from engine.text.prompts import PromptEncoder
from engine.text.tool_use import ToolUse
from service.request import GenerationRequest, Prompt

# Prompts in one request (each becomes an engine request; past the queue's room they are
# refused as overload), bounded before any is encoded.
MAX_PROMPTS = 1024


class WireNames(NamedTuple):
    """Where each door carries a SamplingParams field."""

    grpc: str  # the GenerateRequest's field path
    rest: str  # the field of an OpenAI completions body (chat says logprobs as top_logprobs)


# Every SamplingParams field a caller sets. (The constraint comes apart, from the request's
# constraint or a forced tool call.)
SAMPLING_FIELDS: dict[str, WireNames] = {
    "n": WireNames("sampling.n", "n"),
    "temperature": WireNames("sampling.temperature", "temperature"),
    "top_k": WireNames("sampling.top_k", "top_k"),
    "top_p": WireNames("sampling.top_p", "top_p"),
    "min_p": WireNames("sampling.min_p", "min_p"),
    "repetition_penalty": WireNames("sampling.repetition_penalty", "repetition_penalty"),
    "presence_penalty": WireNames("sampling.presence_penalty", "presence_penalty"),
    "frequency_penalty": WireNames("sampling.frequency_penalty", "frequency_penalty"),
    "seed": WireNames("sampling.seed", "seed"),
    "max_tokens": WireNames("stopping.max_tokens", "max_tokens"),
    "min_tokens": WireNames("stopping.min_tokens", "min_tokens"),
    "stop": WireNames("stopping.stop", "stop"),
    "stop_token_ids": WireNames("stopping.stop_token_ids", "stop_token_ids"),
    "ignore_eos": WireNames("stopping.ignore_eos", "ignore_eos"),
    "include_stop_str_in_output": WireNames(
        "stopping.include_stop_str", "include_stop_str_in_output"
    ),
    "logprobs": WireNames("output.logprobs", "logprobs"),
    "prompt_logprobs": WireNames("output.prompt_logprobs", "prompt_logprobs"),
    "skip_special_tokens": WireNames("output.skip_special_tokens", "skip_special_tokens"),
}
# Lists a request may carry millions of entries in: counted before they are copied.
_LIST_LIMITS = {
    "stop": (MAX_STOP_STRINGS, "stop strings"),
    "stop_token_ids": (MAX_STOP_TOKEN_IDS, "ids"),
}


@dataclass
class EngineInputs:
    """What the engine takes for one call: a request per prompt, all with these params."""

    prompts: list[list[int]]
    params: SamplingParams
    tools: ToolUse | None  # None: no tools offered


def engine_inputs(
    request: GenerationRequest, encoder: PromptEncoder, tool_parser: str
) -> EngineInputs:
    """The engine's inputs for `request`, checked; ValidationError naming the caller's
    field. tool_parser: the format the served model writes tool calls in."""
    with named_as_sent(request.field_names):
        tools = tool_use(request, tool_parser)
        params = sampling_params(request, tools)
        check_count("prompt", len(request.prompts), MAX_PROMPTS, "prompts")  # before encoding
        prompts = [_encode(prompt, encoder, tools) for prompt in request.prompts]
    return EngineInputs(prompts, params, tools)


def sampling_params(request: GenerationRequest, tools: ToolUse | None = None) -> SamplingParams:
    """The request's SamplingParams (unset fields keep the engine's defaults), with its
    constraint, or a forced call's; values are checked when the engine admits it."""
    params = SamplingParams()
    for name, value in request.sampling.items():
        if name in _LIST_LIMITS:
            check_count(name, len(value), *_LIST_LIMITS[name])
            value = list(value)
        setattr(params, name, value)
    params.constraint = request.constraint
    if tools is not None:
        tools.constrain(params)
    return params


def tool_use(request: GenerationRequest, parser: str) -> ToolUse | None:
    """The tools the request offers and what it asks of them; None when it offers none."""
    if not request.tools:
        if request.tool_choice in ("required", "function"):
            raise ValidationError("tool_choice", "needs tools")
        return None
    if any(prompt.messages is None for prompt in request.prompts):
        raise ValidationError("tools", "are offered in chat prompts only")
    return ToolUse(
        request.tools,
        request.tool_choice,
        request.tool_function,
        request.parallel_tool_calls,
        parser,
    )


def _encode(prompt: Prompt, encoder: PromptEncoder, tools: ToolUse | None) -> list[int]:
    if prompt.messages is not None:
        return encoder.prompt(messages=prompt.messages, as_dict=prompt.as_dict, tools=tools)
    if prompt.token_ids is not None:
        return encoder.prompt(token_ids=prompt.token_ids)
    return encoder.prompt(prompt.text)


def tokenize(prompt: Prompt, encoder: PromptEncoder, add_special_tokens: bool = True) -> list[int]:
    """The token ids of a text or chat prompt, as a Tokenize call counts them: held to no
    context but the guard against text that cannot fit it (PromptEncoder.tokenize)."""
    return encoder.tokenize(
        prompt.text,
        messages=prompt.messages,
        add_special_tokens=add_special_tokens,
        as_dict=prompt.as_dict,
    )


@contextlib.contextmanager
def named_as_sent(field_names: dict[str, str]) -> Iterator[None]:
    """A ValidationError raised inside names the field as the caller sent it."""
    try:
        yield
    except ValidationError as exc:
        sent = field_names.get(exc.field)
        if sent is None:
            raise
        raise type(exc)(sent, exc.message) from None


def prompt_named(where: str) -> dict[str, str]:
    """Field names (GenerationRequest.field_names) that name a prompt's errors by `where`
    the caller put it: the engine's checks say prompt, prompt_token_ids or messages."""
    return dict.fromkeys(("prompt", "prompt_token_ids", "messages"), where)
