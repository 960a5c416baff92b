"""The gRPC door's wire format: protobuf requests parsed into GenerationRequests
(service/request.py), answers written as protobuf messages. Shape errors of a message are
raised here, naming its fields; everything else is the converter's (service/convert.py)."""

from __future__ import annotations

import json
import re

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
from engine.sampling_params import check_count
from engine.structured.constraints import MAX_CHOICES, Constraint
from engine.text.tokenizer import Tokenizer
from engine.text.tool_use import FUNCTION_NAME, MAX_TOOLS
from pagedserve.v1 import inference_pb2 as pb
from service.answer import Answer
from service.convert import SAMPLING_FIELDS, prompt_named
from service.request import GenerationRequest, Prompt
from service.tool_calls import ParsedText, ToolCall, assemble

# Why a candidate ended (ToolCallReader.finish_reason's words), as the message says it.
_FINISH_REASONS = {
    FinishReason.LENGTH.value: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS.value: pb.FINISH_REASON_EOS,
    FinishReason.STOP.value: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CANCELLED.value: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR.value: pb.FINISH_REASON_ERROR,
    FinishReason.CONTEXT_LIMIT.value: pb.FINISH_REASON_CONTEXT_LIMIT,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}
# Where a request's prompt is, by the member of its oneof that carries it.
_PROMPT_FIELDS = {"text": "text", "chat": "chat.messages", "token_ids": "token_ids.ids"}
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


# ---- requests ----------------------------------------------------------------------------


def generation_request(request: pb.GenerateRequest) -> GenerationRequest:
    """A GenerateRequest as the door-neutral request; errors name its fields."""
    kind = _chosen(request, "prompt")
    tools, choice, function, parallel = _tools(request)
    return GenerationRequest(
        prompts=[_prompt(request, kind)],
        sampling=_sampling(request),
        constraint=_constraint(request),
        tools=tools,
        tool_choice=choice,
        tool_function=function,
        parallel_tool_calls=parallel,
        priority=request.priority,
        model=request.model,
        field_names=prompt_named(_PROMPT_FIELDS[kind]),
    )


def tokenize_prompt(request: pb.TokenizeRequest) -> tuple[Prompt, dict[str, str]]:
    """A Tokenize request's text or chat, and the field names its errors use."""
    kind = _chosen(request, "input")
    return _prompt(request, kind), prompt_named(_PROMPT_FIELDS[kind])


def _prompt(request: pb.GenerateRequest | pb.TokenizeRequest, kind: str) -> Prompt:
    if kind == "text":
        return Prompt(text=request.text)
    if kind == "chat":
        return Prompt(messages=request.chat.messages, as_dict=_message)
    return Prompt(token_ids=request.token_ids.ids)


def _sampling(request: pb.GenerateRequest) -> dict[str, object]:
    """The SamplingParams fields the request sets, by the engine's names (lists uncopied)."""
    sent = {
        f"{group}.{descriptor.name}": value
        for group in ("sampling", "stopping", "output")
        for descriptor, value in getattr(request, group).ListFields()
    }
    return {name: sent[wire.grpc] for name, wire in SAMPLING_FIELDS.items() if wire.grpc in sent}


def _constraint(request: pb.GenerateRequest) -> Constraint | None:
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


def _tools(request: pb.GenerateRequest) -> tuple[tuple[dict, ...], str, str | None, bool]:
    """The tools offered, in OpenAI's shape, tool_choice, the function it names, and
    whether several calls may come in one answer."""
    choice = _TOOL_CHOICES.get(request.tool_choice)
    if choice is None:
        raise ValidationError("tool_choice", f"unknown value {request.tool_choice}")
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
    if tools and request.tool_function and choice != "function":
        raise ValidationError("tool_function", "is set only with TOOL_CHOICE_FUNCTION")
    if (
        tools
        and choice == "function"
        and request.tool_function not in (t.name for t in request.tools)
    ):
        raise ValidationError("tool_function", "must be the name of one of tools")
    parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
    return tuple(tools), choice, request.tool_function or None, parallel


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


# ---- answers -----------------------------------------------------------------------------


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


def usage(value: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=value.prompt_tokens,
        completion_tokens=value.completion_tokens,
        cached_tokens=value.cached_tokens,
    )


def timing(value: RequestTiming) -> pb.Timing:
    queue = (value.first_scheduled - value.arrival) if value.first_scheduled else 0.0
    ttft = (value.first_token - value.arrival) if value.first_token else 0.0
    total = (value.finished - value.arrival) if value.finished else 0.0
    return pb.Timing(queue_seconds=queue, ttft_seconds=ttft, total_seconds=total)


def _set_ending(
    message: pb.Candidate | pb.GenerateStreamResponse,
    reason: str,
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
    event: CandidateEvent, answer: Answer, tokenizer: Tokenizer
) -> pb.GenerateStreamResponse:
    """One event of the call's single request as its stream message."""
    parsed = answer.tool_calls.parse(event.index, event.text, event.finished)
    message = pb.GenerateStreamResponse(
        request_id=answer.outputs[0].request_id,  # the caller's id, not the engine's
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
        reason = answer.finish_reason(event.index, event.finish_reason)
        _set_ending(message, reason, event.matched_stop, event.error)
        if event.usage is not None:
            message.usage.CopyFrom(usage(event.usage))
        if event.timing is not None:
            message.timing.CopyFrom(timing(event.timing))
    return message


def generate_response(answer: Answer, tokenizer: Tokenizer) -> pb.GenerateResponse:
    """The whole answer to the call's single request."""
    output: RequestOutput = answer.outputs[0].build()
    response = pb.GenerateResponse(
        request_id=output.request_id,
        candidates=[_candidate(out, answer, tokenizer) for out in output.outputs],
        prompt_logprobs=token_logprobs(output.prompt_logprobs, tokenizer),
        usage=usage(answer.usage()),
    )
    if output.timing is not None:
        response.timing.CopyFrom(timing(output.timing))
    return response


def _candidate(out: CompletionOutput, answer: Answer, tokenizer: Tokenizer) -> pb.Candidate:
    parsed: ParsedText = answer.tool_calls.parse(out.index, out.text, True)
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
        reason = answer.finish_reason(out.index, out.finish_reason)
        _set_ending(candidate, reason, out.matched_stop, out.error)
    return candidate
