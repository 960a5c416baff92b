"""A prompt as token ids, whatever form it came in: text, chat messages (rendered with the
model's chat template) or token ids; and the checks every prompt passes, by every door.

The checks (check()): not empty; no longer than leaves room to generate in the context;
every id an integer in [0, vocab); and prompt + max_tokens within the context. Before any of
that, sizes are bounded before the work they would cost: text that cannot fit the context
is refused unencoded (Tokenizer.encode's guard), chat messages are counted before they are
copied, and ids are counted before they are walked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.errors import ValidationError
from engine.sampling_params import check_count, check_prompt_length, check_token_ids
from engine.stats import EngineInfo
from engine.text.tokenizer import Tokenizer
from engine.text.tool_use import ToolUse, template_messages

# Messages in one chat prompt. Each renders to a few tokens at least, so more cannot fit
# any context this serves; bounded before a message is copied out of the request.
MAX_CHAT_MESSAGES = 4096

Message = TypeVar("Message")


@dataclass(frozen=True)
class PromptEncoder:
    """Prompts to checked token ids for one engine. The doors encode with for_engine()'s;
    the engine checks every prompt it admits again with its own (LLMEngine.prompts), which
    knows what bounds the context (the model, the KV pool) and says so in its refusals.
    max_tokens is left to that check, so that its refusal says so too."""

    tokenizer: Tokenizer
    vocab_size: int
    context: int  # the most tokens one sequence holds, prompt and output together
    # What bounds the context, for the refusals' messages: " (model 2048, KV pool 4096)".
    bounds: str = ""

    @classmethod
    def for_engine(cls, tokenizer: Tokenizer, info: EngineInfo) -> PromptEncoder:
        """The encoder a front door uses, from what the engine reports of itself."""
        return cls(tokenizer, info.vocab_size, info.max_model_len)

    def prompt(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        token_ids: Sequence[int] | None = None,
        add_special_tokens: bool = True,
        as_dict: Callable[[Message], dict[str, Any]] = lambda m: m,
        tools: ToolUse | None = None,
    ) -> list[int]:
        """A prompt's token ids, from exactly one of text, chat messages (offered `tools`)
        or token ids, checked (check()) but for max_tokens."""
        if sum(x is not None for x in (text, messages, token_ids)) != 1:
            raise ValidationError(
                "prompt", "give exactly one of prompt, prompt_token_ids, messages"
            )
        if token_ids is not None:
            self.check(token_ids)  # before the ids are copied into a list
            return list(token_ids)
        ids = self.tokenize(
            text,
            messages=messages,
            add_special_tokens=add_special_tokens,
            as_dict=as_dict,
            tools=tools,
        )
        self.check(ids)
        return ids

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[Message] | None = None,
        add_special_tokens: bool = True,
        field: str = "prompt",
        as_dict: Callable[[Message], dict[str, Any]] = lambda m: m,
        tools: ToolUse | None = None,
    ) -> list[int]:
        """Token ids of exactly one of text or chat messages, unchecked but for their size:
        text that cannot fit the context is refused (naming `field`), and so are more than
        MAX_CHAT_MESSAGES messages. as_dict makes a message the template's dict (the
        template checks what it gets); the tools and the calls in the messages reach the
        template as engine/text/tool_use.py's template_messages says."""
        if (text is None) == (messages is None):
            raise ValidationError("prompt", "give exactly one of prompt, messages")
        if text is not None:
            return self.tokenizer.encode(
                text, add_special_tokens, max_tokens=self.context, field=field
            )
        check_count("messages", len(messages), MAX_CHAT_MESSAGES, "messages")
        dicts, template_tools = template_messages(
            [as_dict(m) for m in messages], tools, self.tokenizer
        )
        rendered = self.tokenizer.apply_chat_template(
            dicts, add_generation_prompt=True, tools=template_tools
        )
        # The template writes the special tokens itself, so encoding adds none.
        return self.tokenizer.encode(
            rendered, add_special_tokens=False, max_tokens=self.context, field="messages"
        )

    def check(self, token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        """Refuse a prompt the engine cannot run (ValidationError); returns how many tokens
        it may generate: max_tokens, or (None) up to the context limit."""
        count = len(token_ids)
        if count == 0:
            raise ValidationError("prompt", "must not be empty")
        check_prompt_length(count, self.context, self.bounds)
        check_token_ids("prompt_token_ids", token_ids, self.vocab_size)
        if max_tokens is None:
            return self.context - count
        if count + max_tokens > self.context:
            raise ValidationError(
                "max_tokens",
                f"prompt ({count} tokens) + max_tokens ({max_tokens}) exceeds the context "
                f"limit of {self.context} tokens{self.bounds}",
            )
        return max_tokens
