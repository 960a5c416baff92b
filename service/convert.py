"""Protobuf messages <-> engine types, and nothing more. Pure functions: prompts are encoded
and checked by engine/text/prompts.py, a request's events gathered into its answer by
engine/outputs.py, values validated by SamplingParams.validate; shape errors of the
message itself are raised here."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from engine.errors import ValidationError
from engine.outputs import (
    CandidateEvent,
    CompletionOutput,
    FinishReason,
    RequestOutput,
    RequestTiming,
    TokenLogprob,
    Usage,
)
from engine.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams, check_count
from engine.structured.constraints import MAX_CHOICES, Constraint
from engine.text.prompts import PromptEncoder
from engine.text.tokenizer import Tokenizer
from engine.tool_calls import (
    FUNCTION_NAME,
    MAX_TOOLS,
    ParsedText,
    ToolCall,
    ToolCallReader,
    ToolUse,
    assemble,
)
from pagedserve.v1 import inference_pb2 as pb

_FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
    FinishReason.CONTEXT_LIMIT: pb.FINISH_REASON_CONTEXT_LIMIT,
}
# Where a request's prompt is, by the member of its oneof that carries it, as the request
# spells it. The engine's checks name a prompt as REST does: prompt, prompt_token_ids or
# messages.
_PROMPT_FIELDS = {"text": "text", "chat": "chat.messages", "token_ids": "token_ids.ids"}
_ENGINE_PROMPT_NAMES = ("prompt", "prompt_token_ids", "messages")
_TOOL_CHOICES = {
    pb.TOOL_CHOICE_AUTO: "auto",
    pb.TOOL_CHOICE_NONE: "none",
    pb.TOOL_CHOICE_REQUIRED: "required",
    pb.TOOL_CHOICE_FUNCTION: "function",
}


def parse(message_type: type[Message], data: bytes) -> Message:
    """A request message from its wire bytes; ValidationError naming the field when they do
    not parse (a string that is not UTF-8, a corrupt wire format) instead of grpc.aio's
    UNKNOWN for a deserializer's exception."""
    try:
        return message_type.FromString(data)
    except DecodeError as exc:
        name = message_type.DESCRIPTOR.full_name
        field = _bad_utf8_field(message_type.DESCRIPTOR, data)
        if field is not None:
            raise ValidationError(field, "is not valid UTF-8") from None
        raise ValidationError("request", f"is not a valid {name} message: {exc}") from None


def _bad_utf8_field(descriptor: Descriptor, data: bytes) -> str | None:
    """The dotted name of the first string field in `data` that is not UTF-8, read off the
    wire format (a protobuf parser only says that one is not); None if there is none or the
    bytes are not a message at all."""
    pos = 0
    try:
        while pos < len(data):
            tag, pos = _varint(data, pos)
            kind, field = tag & 7, descriptor.fields_by_number.get(tag >> 3)
            if kind == 0:
                _, pos = _varint(data, pos)
            elif kind in (1, 5):
                pos += 8 if kind == 1 else 4
            elif kind == 2:
                size, pos = _varint(data, pos)
                value, pos = data[pos : pos + size], pos + size
                if field is None:
                    continue
                if field.type == FieldDescriptor.TYPE_STRING:
                    value.decode("utf-8")
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    inner = _bad_utf8_field(field.message_type, value)
                    if inner is not None:
                        return f"{field.name}.{inner}"
            else:
                return None
    except UnicodeDecodeError:
        return field.name
    except IndexError:
        return None
    return None


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def sampling_params(request: pb.GenerateRequest, tools: ToolUse | None = None) -> SamplingParams:
    """The request's options as SamplingParams; unset fields keep the engine's defaults.
    tools: tool_use()'s; a forced call is a constraint on the answer."""
    s, stop, out = request.sampling, request.stopping, request.output
    # Counted before they are copied: a message can hold millions of entries.
    check_count("stop", len(stop.stop), MAX_STOP_STRINGS, "stop strings")
    check_count("stop_token_ids", len(stop.stop_token_ids), MAX_STOP_TOKEN_IDS, "ids")
    params = SamplingParams(
        stop=list(stop.stop),
        stop_token_ids=list(stop.stop_token_ids),
        ignore_eos=stop.ignore_eos,
        include_stop_str_in_output=stop.include_stop_str,
    )
    for message, names in (
        (
            s,
            (
                "n",
                "temperature",
                "top_k",
                "top_p",
                "min_p",
                "repetition_penalty",
                "presence_penalty",
                "frequency_penalty",
                "seed",
            ),
        ),
        (stop, ("max_tokens", "min_tokens")),
        (out, ("logprobs", "prompt_logprobs", "skip_special_tokens")),
    ):
        for name in names:
            if message.HasField(name):
                setattr(params, name, getattr(message, name))
    params.constraint = constraint(request)
    if tools is not None:
        tools.constrain(params)
    return params


def constraint(request: pb.GenerateRequest) -> Constraint | None:
    """The request's constraint oneof as a Constraint naming its field; None if unset."""
    kind = request.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        if not request.json_object:
            raise ValidationError("json_object", "set it to true, or leave it unset")
        return Constraint("json_object", field=kind)
    if kind == "choice":
        check_count("choice.choices", len(request.choice.choices), MAX_CHOICES, "choices")
        return Constraint(kind, tuple(request.choice.choices), field="choice.choices")
    return Constraint(kind, getattr(request, kind), field=kind)


def tool_use(request: pb.GenerateRequest, parser: str) -> ToolUse | None:
    """The request's tools and tool_choice; None when it offers none. parser: the format
    the served model writes calls in."""
    if not request.tools:
        if request.tool_choice in (pb.TOOL_CHOICE_REQUIRED, pb.TOOL_CHOICE_FUNCTION):
            raise ValidationError("tool_choice", "needs tools")
        return None
    if request.WhichOneof("prompt") != "chat":
        raise ValidationError("tools", "are offered in chat prompts only")
    check_count("tools", len(request.tools), MAX_TOOLS, "tools")
    tools = []
    for i, tool in enumerate(request.tools):
        if not re.fullmatch(FUNCTION_NAME, tool.name):
            raise ValidationError(f"tools[{i}].name", f"must match {FUNCTION_NAME}")
        function = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        if tool.parameters:
            try:
                function["parameters"] = json.loads(tool.parameters)
            except ValueError as exc:
                raise ValidationError(
                    f"tools[{i}].parameters", f"is not valid JSON: {exc}"
                ) from None
            if not isinstance(function["parameters"], dict):
                raise ValidationError(f"tools[{i}].parameters", "must be a JSON Schema object")
        tools.append({"type": "function", "function": function})
    choice = _TOOL_CHOICES.get(request.tool_choice)
    if choice is None:
        raise ValidationError("tool_choice", f"unknown value {request.tool_choice}")
    if request.tool_function and choice != "function":
        raise ValidationError("tool_function", "is set only with TOOL_CHOICE_FUNCTION")
    if choice == "function" and request.tool_function not in (t.name for t in request.tools):
        raise ValidationError("tool_function", "must be the name of one of tools")
    parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
    function = request.tool_function or None
    return ToolUse(tuple(tools), choice, function, parallel, parser)


def prompt_token_ids(
    request: pb.GenerateRequest, prompts: PromptEncoder, tools: ToolUse | None = None
) -> list[int]:
    """The prompt's token ids, whichever of text / chat / token_ids the request carries,
    checked (PromptEncoder.prompt); a chat offered `tools`."""
    kind = _chosen(request, "prompt")
    with _named_as_sent(kind):
        if kind == "text":
            return prompts.prompt(request.text)
        if kind == "chat":
            return prompts.prompt(messages=request.chat.messages, as_dict=_message, tools=tools)
        return prompts.prompt(token_ids=request.token_ids.ids)


def tokenize_token_ids(request: pb.TokenizeRequest, prompts: PromptEncoder) -> list[int]:
    """The token ids of a Tokenize request's text or chat (PromptEncoder.tokenize)."""
    kind = _chosen(request, "input")
    with _named_as_sent(kind):
        if kind == "text":
            return prompts.tokenize(request.text, add_special_tokens=request.add_special_tokens)
        return prompts.tokenize(messages=request.chat.messages, as_dict=_message)


@contextlib.contextmanager
def _named_as_sent(kind: str) -> Iterator[None]:
    """A ValidationError the engine raises on the prompt names the field the request set."""
    try:
        yield
    except ValidationError as exc:
        if exc.field not in _ENGINE_PROMPT_NAMES:
            raise
        raise ValidationError(_PROMPT_FIELDS[kind], exc.message) from None


def _chosen(request: pb.GenerateRequest | pb.TokenizeRequest, oneof: str) -> str:
    """The field set in the request's oneof; ValidationError naming its choices if none is."""
    kind = request.WhichOneof(oneof)
    if kind is None:
        *others, last = (f.name for f in request.DESCRIPTOR.oneofs_by_name[oneof].fields)
        raise ValidationError(oneof, f"set one of {', '.join(others)} or {last}")
    return kind


def _message(message: pb.ChatMessage) -> dict[str, object]:
    """A chat message as the template gets it, in OpenAI's shape."""
    result: dict[str, object] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        result["tool_calls"] = [
            ToolCall(c.id, c.name, c.arguments).openai() for c in message.tool_calls
        ]
    if message.tool_call_id:
        result["tool_call_id"] = message.tool_call_id
    if message.name:
        result["name"] = message.name
    return result


def token_logprobs(
    items: list[TokenLogprob | None] | None, tokenizer: Tokenizer
) -> list[pb.TokenLogprob]:
    result = []
    for item in items or []:
        if item is None:
            continue
        result.append(
            pb.TokenLogprob(
                token_id=item.token_id,
                logprob=item.logprob,
                token=tokenizer.id_to_token(item.token_id) or "",
                top=[
                    pb.TopLogprob(token_id=t, logprob=lp, token=tokenizer.id_to_token(t) or "")
                    for t, lp in item.top
                ],
            )
        )
    return result


def usage(value: Usage | None) -> pb.Usage | None:
    if value is None:
        return None
    return pb.Usage(
        prompt_tokens=value.prompt_tokens,
        completion_tokens=value.completion_tokens,
        cached_tokens=value.cached_tokens,
    )


def timing(value: RequestTiming | None) -> pb.Timing | None:
    if value is None:
        return None
    queue = (value.first_scheduled - value.arrival) if value.first_scheduled else 0.0
    ttft = (value.first_token - value.arrival) if value.first_token else 0.0
    total = (value.finished - value.arrival) if value.finished else 0.0
    return pb.Timing(queue_seconds=queue, ttft_seconds=ttft, total_seconds=total)


def _set_ending(
    message: pb.Candidate | pb.GenerateStreamResponse,
    reason: FinishReason,
    stop: str | int | None,
    error: str | None,
) -> None:
    """How a candidate ended: why, the stop string or id that matched, the engine's error."""
    message.finish_reason = _FINISH_REASONS[reason]
    if isinstance(stop, str):
        message.stop_string = stop
    elif isinstance(stop, int):
        message.stop_token_id = stop
    message.error = error or ""


def stream_message(
    event: CandidateEvent, tokenizer: Tokenizer, tool_calls: ToolCallReader
) -> pb.GenerateStreamResponse:
    parsed = tool_calls.parse(event.index, event.text, event.finished)
    message = pb.GenerateStreamResponse(
        request_id=event.request_id,
        index=event.index,
        text=parsed.content,
        token_ids=event.token_ids,
        logprobs=token_logprobs(event.logprobs, tokenizer),
        prompt_logprobs=token_logprobs(event.prompt_logprobs, tokenizer),
        tool_calls=[
            pb.ToolCallDelta(index=d.index, id=d.id or "", name=d.name or "", arguments=d.arguments)
            for d in parsed.tool_calls
        ],
    )
    if event.finished:
        _set_ending(message, event.finish_reason, event.matched_stop, event.error)
        if tool_calls.ended_calling(event.index, event.finish_reason):
            message.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        if event.usage is not None:
            message.usage.CopyFrom(usage(event.usage))
        if event.timing is not None:
            message.timing.CopyFrom(timing(event.timing))
    return message


def generate_response(
    output: RequestOutput, tokenizer: Tokenizer, tool_calls: ToolCallReader
) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=output.request_id,
        candidates=[_candidate(out, tokenizer, tool_calls) for out in output.outputs],
        prompt_logprobs=token_logprobs(output.prompt_logprobs, tokenizer),
        usage=usage(output.usage),
    )
    if output.timing is not None:
        response.timing.CopyFrom(timing(output.timing))
    return response


def _candidate(
    out: CompletionOutput, tokenizer: Tokenizer, tool_calls: ToolCallReader
) -> pb.Candidate:
    parsed: ParsedText = tool_calls.parse(out.index, out.text, True)
    candidate = pb.Candidate(
        index=out.index,
        text=parsed.content,
        token_ids=out.token_ids,
        logprobs=token_logprobs(out.logprobs, tokenizer),
        tool_calls=[
            pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
            for c in assemble(parsed.tool_calls)
        ],
    )
    if out.finish_reason is not None:
        _set_ending(candidate, out.finish_reason, out.matched_stop, out.error)
        if tool_calls.ended_calling(out.index, out.finish_reason):
            candidate.finish_reason = pb.FINISH_REASON_TOOL_CALLS
    return candidate
