"""The OpenAI API's request bodies, as pydantic models, and their mapping to SamplingParams.

pydantic checks the shapes (a string where a number belongs: 400 naming the field); the
values' ranges are SamplingParams.validate's, the same check gRPC requests pass through.
Unknown fields are ignored, as OpenAI-compatible servers commonly do; fields we cannot honour
(logit_bias, suffix, ...) are refused rather than silently dropped.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.constraints import Constraint
from engine.errors import ValidationError
from engine.prompts import MAX_CHAT_MESSAGES
from engine.sampling_params import SamplingParams
from engine.tool_calls import FUNCTION_NAME, ToolUse

# Prompts in one completions request (each is an engine request; past the queue's room they
# get 429), bounded before any is encoded.
MAX_PROMPTS = 1024
# The longest list of anything but token ids a body may hold: chat messages.
MAX_LIST_ENTRIES = MAX_CHAT_MESSAGES


def _no_surrogates(value: Any) -> Any:
    """JSON may spell a lone UTF-16 surrogate ("\\ud800"), which is no character: no
    tokenizer or UTF-8 encoder takes it, so it is refused here, naming its field.

    Lists longer than MAX_LIST_ENTRIES are refused here too unless every entry is an
    integer (token ids): pydantic would validate each entry, and record an error for each
    under every type a field may have (1 GB of errors for 12 MiB of [[1], [1], ...])."""
    if isinstance(value, str) and not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            message = f"is not valid Unicode text: a lone UTF-16 surrogate at index {exc.start}"
            raise ValueError(message) from None
    elif isinstance(value, list | tuple):
        if len(value) > MAX_LIST_ENTRIES:
            if set(map(type, value)) <= {int}:  # one pass in C; ints hold no text
                return value
            raise ValueError(
                f"at most {MAX_LIST_ENTRIES} entries unless all are token ids (integers), "
                f"got {len(value)}"
            )
        for item in value:
            _no_surrogates(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _no_surrogates(key)
            _no_surrogates(item)
    return value


class _Body(BaseModel):
    # strict: JSON types as OpenAI documents them; no "yes" for true, no true for token 1.
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True)

    _check_text = field_validator("*", mode="before")(_no_surrogates)  # nested ones too


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaFormat(_Body):
    name: str
    schema_: dict[str, Any] | bool = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # generated output always keeps to the schema


class ResponseFormat(_Body):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's structured_outputs extra: exactly one of its fields."""

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")  # a JSON Schema
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None


class _Sampling(_Body):
    """What completions and chat share: sampling, stopping, streaming, and the common
    extras of OpenAI-compatible servers (top_k, min_p, ...)."""

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    priority: int = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    COPIED: ClassVar[tuple[str, ...]] = (
        "n",
        "temperature",
        "top_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "skip_special_tokens",
    )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.logit_bias:
            raise ValidationError("logit_bias", "is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValidationError("stream_options", "is only allowed with stream: true")
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs)
        for name in self.COPIED:
            value = getattr(self, name)
            if value is not None:
                setattr(params, name, value)
        if self.stop is not None:
            params.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        params.constraint = self._constraint()
        return params

    def _constraint(self) -> Constraint | None:
        """response_format or structured_outputs as a Constraint naming its field."""
        chosen = (
            self.response_format
            if self.response_format and self.response_format.type != "text"
            else None
        )
        if chosen and self.structured_outputs:
            raise ValidationError(
                "structured_outputs", "give either response_format or structured_outputs"
            )
        if chosen and chosen.type == "json_object":
            return Constraint("json_object", field="response_format")
        if chosen:
            if chosen.json_schema is None:
                raise ValidationError("response_format.json_schema", "is required for json_schema")
            schema = json.dumps(chosen.json_schema.schema_)
            return Constraint("json_schema", schema, field="response_format.json_schema.schema")
        if self.structured_outputs is None:
            return None
        given = self.structured_outputs.model_dump(exclude_none=True)
        if len(given) != 1:
            raise ValidationError(
                "structured_outputs",
                "give exactly one of json, json_object, regex, grammar, choice",
            )
        ((name, value),) = given.items()
        field = f"structured_outputs.{name.rstrip('_')}"
        if name == "json_":
            spec = value if isinstance(value, str) else json.dumps(value)
            return Constraint("json_schema", spec, field=field)
        if name == "json_object":
            if not value:
                raise ValidationError(field, "set it to true, or leave it unset")
            return Constraint("json_object", field=field)
        if name == "choice":
            return Constraint("choice", tuple(value), field=field)
        return Constraint(name, value, field=field)


class CompletionRequest(_Sampling):
    # Token ids first: a long list of them matches there, with no error recorded per id
    # under the other types on the way.
    prompt: list[int] | str | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            return [prompt]
        if not prompt:
            raise ValidationError("prompt", "must not be empty")
        return list(prompt)

    def sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise ValidationError("suffix", "is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValidationError("best_of", "only best_of == n is supported")
        params = self._params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs
        return params


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: the template may use them

    role: str
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content}


class FunctionDefinition(_Body):
    name: str = Field(pattern=f"^{FUNCTION_NAME}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None  # forced calls always keep to the schema


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # unset: up to the context limit
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_use(self, parser: str) -> ToolUse | None:
        """The request's tools and tool_choice; None when it offers none. parser: the
        format the served model writes calls in."""
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise ValidationError("tool_choice", "needs tools")
            return None
        tools = tuple(tool.model_dump(exclude_none=True) for tool in self.tools)
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            return ToolUse(tools, "function", choice.function.name, self.parallel, parser)
        return ToolUse(tools, choice, None, self.parallel, parser)

    @property
    def parallel(self) -> bool:
        return self.parallel_tool_calls is not False

    def param_names(self) -> dict[str, str]:
        """The engine's names for fields (SamplingParams', admission's) -> the ones this
        request used, for error messages."""
        max_tokens = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        return {"logprobs": "top_logprobs", "max_tokens": max_tokens, "prompt": "messages"}

    def sampling_params(self, tools: ToolUse | None = None) -> SamplingParams:
        """tools: tool_use()'s; a forced call is a constraint on the answer."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValidationError("top_logprobs", "needs logprobs: true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        params = self._params(max_tokens, logprobs)
        if tools is not None:
            tools.constrain(params)
        return params


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
