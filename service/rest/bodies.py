"""The REST door's requests: the OpenAI API's bodies, as msgspec Structs decoded from a
body's bytes, each parsed into a GenerationRequest (service/request.py).

Decoding checks each value's type as it parses: the first wrong one ends it with one error
naming its field, before the rest of the body is read. Fields this server does not know
are skipped unbuilt, and free-form JSON (a response schema, a tool's parameters,
logit_bias) stays the raw text it came as: a schema goes to the grammar compiler as that
text, and an array holds at most as many entries as its field takes (at_most): so no
body of any shape costs more than a pass over its bytes. The values' ranges are
SamplingParams.validate's, the same check gRPC requests pass through (service/convert.py
converts both). Fields we cannot
honour (logit_bias, suffix, ...) are refused rather than silently dropped.

Bodies are JSON as RFC 8259 has it: NaN and Infinity, and text with a lone UTF-16
surrogate ("\\ud800", which is no character), make a body invalid.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta, Raw

from engine.errors import ValidationError
from engine.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from engine.structured.constraints import MAX_CHOICES, MAX_SPEC_CHARS, Constraint
from engine.text.prompts import MAX_CHAT_MESSAGES
from engine.text.tool_use import FUNCTION_NAME, MAX_TOOLS
from service.convert import MAX_PROMPTS, SAMPLING_FIELDS, prompt_named
from service.request import GenerationRequest, Prompt

MAX_PARTS = 4096  # text parts of one message's content

Body = TypeVar("Body", bound="_Body")


class _Body(msgspec.Struct, kw_only=True):  # each subclass repeats kw_only: not inherited
    """A request body, or a part of one; unknown fields are skipped, as OpenAI-compatible
    servers commonly do. msgspec is strict: no "1" for 1, no true for 1."""


def decode(body: bytes, kind: type[Body]) -> Body:
    """The body as `kind`; ValidationError naming the field at fault (or "body")."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise _field_error(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ValidationError("body", f"not valid JSON: {_why_invalid(body, str(exc))}") from None


_EMPTY_OBJECT = re.compile(rb"\{\s*\}")
_AT = re.compile(r"^(?P<message>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]|\[\.\.\.\]")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")


def _field_error(message: str, field: str = "") -> ValidationError:
    """msgspec's "Expected `int`, got `str` - at `$.prompt[0][0]`" as
    "prompt.0.0: expected int, got str"; for a field decoded on its own, `field` names it."""
    match = _AT.match(message)
    text, path = match["message"], match["path"] or ""
    parts = [name or index for name, index in _PATH_PART.findall(path) if name or index]
    parts = [field, *parts] if field else parts
    if missing := _MISSING.match(text):
        parts.append(missing["name"])
        text = "is required"
    text = text.replace("`", "")
    return ValidationError(".".join(parts) or "body", text[:1].lower() + text[1:])


def _why_invalid(body: bytes, message: str) -> str:
    """msgspec's reason, said plainly where it is JSON's rules that the body broke."""
    position = re.search(r"\(byte (\d+)\)", message)
    at = int(position[1]) if position else None
    if at is not None and body[at : at + 3] in (b"NaN", b"Inf", b"-In"):
        return f"NaN and Infinity are not JSON numbers (byte {at})"
    lone = re.search(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}", body)
    if lone is not None and ("surrogate" in message or "truncated" in message):
        return f"text with a lone UTF-16 surrogate, which is no character (byte {lone.start()})"
    return message[:1].lower() + message[1:]


def _raw_json(raw: Raw, field: str) -> str:
    """A free-form JSON value as its text, bounded like a gRPC request's schema text."""
    if len(raw) > MAX_SPEC_CHARS:
        raise ValidationError(field, f"has {len(raw)} bytes of JSON, at most {MAX_SPEC_CHARS}")
    return _decoded(raw, str, field, as_text=True)


def _decoded(raw: Raw | bytes, kind: Any, field: str, as_text: bool = False) -> Any:
    """A value kept raw when its body was decoded (so not yet checked inside), decoded now
    as `kind`, or only as UTF-8 text (as_text); errors name `field`."""
    try:
        if as_text:
            return bytes(raw).decode()
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise _field_error(str(exc), field) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ValidationError(field, f"not valid JSON text: {exc}") from None


def _present(raw: Raw) -> bool:
    """A raw field was sent, and not as null."""
    return len(raw) > 0 and memoryview(raw) != b"null"


class _Array(msgspec.Struct, array_like=True):
    """A JSON array of at most some number of entries (at_most() makes one): a Sequence of
    them. msgspec checks a list's length only once it is built (five million [] in 15 MB:
    1.5 s and 28x the body's size), so this is an array-like Struct of that many optional
    fields, which takes the entries in order, one more field that says there were more,
    and the rest skipped unbuilt."""

    def __post_init__(self) -> None:
        if len(self.more) > 0:  # msgspec names the field in the error it makes of this
            raise ValueError(f"at most {len(self.__struct_fields__) - 1} entries")

    def _entries(self) -> tuple[Any, ...]:
        entries = msgspec.structs.astuple(self)[:-1]
        end = entries.index(msgspec.UNSET) if msgspec.UNSET in entries else len(entries)
        return entries[:end]

    def __len__(self) -> int:
        return len(self._entries())

    def __iter__(self) -> Iterator[Any]:
        return iter(self._entries())

    def __getitem__(self, index: int) -> Any:
        return self._entries()[index]


@functools.cache
def at_most(entry: Any, count: int) -> type[_Array]:
    """The type of a JSON array of `entry`s that refuses more than `count` of them."""
    fields = [(f"e{i}", entry | msgspec.UnsetType, msgspec.UNSET) for i in range(count)]
    name = f"AtMost{count}"
    return msgspec.defstruct(
        name, [*fields, ("more", Raw, Raw())], bases=(_Array,), array_like=True
    )


class StreamOptions(_Body, kw_only=True):
    include_usage: bool = False


class JsonSchemaFormat(_Body, kw_only=True):
    name: str
    schema: Raw  # a JSON Schema, kept as its text
    description: str | None = None
    strict: bool | None = None  # generated output always keeps to the schema


class ResponseFormat(_Body, kw_only=True):
    """OpenAI's response_format."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body, kw_only=True):
    """vLLM's structured_outputs extra: exactly one of its fields."""

    json_: Raw = msgspec.field(name="json", default=Raw())  # a JSON Schema, or one as text
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: at_most(str, MAX_CHOICES) | None = None

    def constraint(self) -> Constraint:
        given = [
            name
            for name in ("json_object", "regex", "grammar", "choice")
            if getattr(self, name) is not None
        ]
        if _present(self.json_):
            given.append("json")
        if len(given) != 1:
            raise ValidationError(
                "structured_outputs",
                "give exactly one of json, json_object, regex, grammar, choice",
            )
        name = given[0]
        field = f"structured_outputs.{name}"
        if name == "json":
            spec = _raw_json(self.json_, field)
            if spec.lstrip().startswith('"'):  # a schema sent as a JSON string
                spec = _decoded(self.json_, str, field)
            return Constraint("json_schema", spec, field=field)
        if name == "json_object":
            if not self.json_object:
                raise ValidationError(field, "set it to true, or leave it unset")
            return Constraint("json_object", field=field)
        if name == "choice":
            return Constraint("choice", tuple(self.choice), field=field)
        return Constraint(name, getattr(self, name), field=field)


class _Sampling(_Body, kw_only=True):
    """What completions and chat share: sampling, stopping, streaming, and the common
    extras of OpenAI-compatible servers (top_k, min_p, ...)."""

    model: str | None = None
    n: int = 1
    stop: str | at_most(str, MAX_STOP_STRINGS) | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: Raw = Raw()  # refused unless empty: kept unbuilt
    user: str | None = None
    # extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: at_most(int, MAX_STOP_TOKEN_IDS) | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None
    priority: int = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _request(self, prompts: list[Prompt], field_names: dict[str, str]) -> GenerationRequest:
        """The door-neutral request: the fields SAMPLING_FIELDS names, as this body set
        them, the constraint, priority and model; tools are chat's."""
        if _present(self.logit_bias) and not _EMPTY_OBJECT.fullmatch(memoryview(self.logit_bias)):
            raise ValidationError("logit_bias", "is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValidationError("stream_options", "is only allowed with stream: true")
        sampling = {}
        for name, wire in SAMPLING_FIELDS.items():
            value = getattr(self, wire.rest, None)
            if isinstance(value, _Array):
                value = list(value)
            elif isinstance(value, str) and name == "stop":
                value = [value]
            if value is not None:
                sampling[name] = value
        return GenerationRequest(
            prompts,
            sampling,
            constraint=self._constraint(),
            priority=self.priority,
            model=self.model or "",
            field_names=field_names,
        )

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
            field = "response_format.json_schema.schema"
            return Constraint(
                "json_schema", _raw_json(chosen.json_schema.schema, field), field=field
            )
        if self.structured_outputs is None:
            return None
        return self.structured_outputs.constraint()


class CompletionRequest(_Sampling, kw_only=True):
    # Text, texts, token ids or token-id lists: told apart by the first entry and decoded
    # as that kind (prompts()), so a wrong entry ends the decode at once.
    prompt: Raw
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text or token ids."""
        kind = _prompt_kind(self.prompt)
        prompt = _decoded(self.prompt, kind, "prompt")
        if kind is str:
            return [prompt]
        if not prompt:
            raise ValidationError("prompt", "must not be empty")
        return [prompt] if kind is _TOKEN_IDS else list(prompt)

    def generation_request(self) -> GenerationRequest:
        if self.suffix:
            raise ValidationError("suffix", "is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValidationError("best_of", "only best_of == n is supported")
        request = self._request([], prompt_named("prompt"))
        if self.echo and self.logprobs is not None:
            request.sampling["prompt_logprobs"] = self.logprobs
        request.prompts = [
            Prompt(token_ids=p) if isinstance(p, list) else Prompt(text=p) for p in self.prompts()
        ]
        return request


_TOKEN_IDS = list[int]  # a prompt's ids: bounded by the body's size, checked by the engine


_ARRAY_START = re.compile(rb"\[\s*(.?)")


def _prompt_kind(raw: Raw) -> Any:
    """The type a completions prompt is decoded as, by its first character and its first
    entry's: text, texts, token-id lists or token ids. Read in place: a prompt may be
    megabytes."""
    array = _ARRAY_START.match(memoryview(raw))
    if array is None:
        return str
    if array[1] == b'"':
        return at_most(str, MAX_PROMPTS)
    if array[1] == b"[":
        return at_most(_TOKEN_IDS, MAX_PROMPTS)
    return _TOKEN_IDS


class TextPart(_Body, kw_only=True):
    type: Literal["text"]
    text: str


class CalledFunction(_Body, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_Body, kw_only=True):
    """A call an assistant message made, as the chat template gets it."""

    function: CalledFunction
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(_Body, kw_only=True):
    role: str
    content: str | at_most(TextPart, MAX_PARTS) | None = None
    # What chat templates read besides role and content; other fields are skipped.
    name: str | None = None
    tool_calls: at_most(MessageToolCall, MAX_TOOLS) | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    def as_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, _Array):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content}
        for name in ("name", "tool_call_id", "reasoning_content"):
            if (value := getattr(self, name)) is not None:
                message[name] = value
        if self.tool_calls is not None:
            message["tool_calls"] = [msgspec.to_builtins(call) for call in self.tool_calls]
        return message


class FunctionDefinition(_Body, kw_only=True):
    name: Annotated[str, Meta(pattern=f"^{FUNCTION_NAME}$")]
    description: str | None = None
    parameters: Raw = Raw()  # a JSON Schema of the arguments object
    strict: bool | None = None  # forced calls always keep to the schema


class ToolDefinition(_Body, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition

    def as_dict(self, index: int) -> dict[str, Any]:
        """The tool as the chat template gets it, its parameters parsed (bounded first)."""
        function = self.function
        described: dict[str, Any] = {"name": function.name}
        if function.description is not None:
            described["description"] = function.description
        if _present(function.parameters):
            field = f"tools.{index}.function.parameters"
            _raw_json(function.parameters, field)  # bounded first
            parameters = _decoded(function.parameters, dict[str, Any], field)
            described["parameters"] = parameters
        if function.strict is not None:
            described["strict"] = function.strict
        return {"type": "function", "function": described}


class FunctionName(_Body, kw_only=True):
    name: str


class NamedToolChoice(_Body, kw_only=True):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: at_most(ChatMessage, MAX_CHAT_MESSAGES)
    max_tokens: int | None = None  # unset: up to the context limit
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: at_most(ToolDefinition, MAX_TOOLS) | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def generation_request(self) -> GenerationRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValidationError("top_logprobs", "needs logprobs: true")
        max_tokens = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        names = prompt_named("messages") | {"logprobs": "top_logprobs", "max_tokens": max_tokens}
        prompt = Prompt(messages=self.messages, as_dict=ChatMessage.as_dict)
        request = self._request([prompt], names)
        # Chat says logprobs as a switch and top_logprobs as their number; unset max_tokens
        # is up to the context limit.
        request.sampling.pop("logprobs", None)
        if self.logprobs:
            request.sampling["logprobs"] = self.top_logprobs or 0
        request.sampling["max_tokens"] = getattr(self, max_tokens)
        if self.tools:
            request.tools = tuple(tool.as_dict(i) for i, tool in enumerate(self.tools))
        choice = self.tool_choice or "auto"
        if isinstance(choice, NamedToolChoice):
            request.tool_choice, request.tool_function = "function", choice.function.name
        else:
            request.tool_choice = choice
        request.parallel_tool_calls = self.parallel_tool_calls is not False
        return request


class TokenizeRequest(_Body, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: at_most(ChatMessage, MAX_CHAT_MESSAGES) | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body, kw_only=True):
    model: str | None = None
    tokens: list[int]
