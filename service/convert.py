"""Protobuf messages <-> engine types, and nothing more. Pure functions: prompts are encoded
and checked by engine/prompts.py, a request's events gathered into its answer by
engine/outputs.py, values validated by SamplingParams.validate; shape errors of the
message itself are raised here."""

from __future__ import annotations

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
from engine.prompts import PromptEncoder
from engine.sampling_params import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams, check_count
from engine.tokenizer import Tokenizer
from pagedserve.v1 import inference_pb2 as pb

_FINISH_REASONS = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
    FinishReason.STOP: pb.FINISH_REASON_STOP_SEQUENCE,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
    FinishReason.CONTEXT_LIMIT: pb.FINISH_REASON_CONTEXT_LIMIT,
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


def sampling_params(request: pb.GenerateRequest) -> SamplingParams:
    """The request's options as SamplingParams; unset fields keep the engine's defaults."""
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
    return params


def prompt_token_ids(request: pb.GenerateRequest, prompts: PromptEncoder) -> list[int]:
    """The prompt's token ids, whichever of text / chat / token_ids the request carries,
    checked (PromptEncoder.prompt)."""
    kind = _chosen(request, "prompt")
    if kind == "text":
        return prompts.prompt(request.text)
    if kind == "chat":
        return prompts.prompt(messages=request.chat.messages, as_dict=_message)
    return prompts.prompt(token_ids=request.token_ids.ids)


def tokenize_token_ids(request: pb.TokenizeRequest, prompts: PromptEncoder) -> list[int]:
    """The token ids of a Tokenize request's text or chat (PromptEncoder.tokenize)."""
    if _chosen(request, "input") == "text":
        return prompts.tokenize(
            request.text, add_special_tokens=request.add_special_tokens, field="text"
        )
    return prompts.tokenize(messages=request.chat.messages, as_dict=_message)


def _chosen(request: pb.GenerateRequest | pb.TokenizeRequest, oneof: str) -> str:
    """The field set in the request's oneof; ValidationError naming its choices if none is."""
    kind = request.WhichOneof(oneof)
    if kind is None:
        *others, last = (f.name for f in request.DESCRIPTOR.oneofs_by_name[oneof].fields)
        raise ValidationError(oneof, f"set one of {', '.join(others)} or {last}")
    return kind


def _message(message: pb.ChatMessage) -> dict[str, str]:
    return {"role": message.role, "content": message.content}


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


def stream_message(event: CandidateEvent, tokenizer: Tokenizer) -> pb.GenerateStreamResponse:
    message = pb.GenerateStreamResponse(
        request_id=event.request_id,
        index=event.index,
        text=event.text,
        token_ids=event.token_ids,
        logprobs=token_logprobs(event.logprobs, tokenizer),
        prompt_logprobs=token_logprobs(event.prompt_logprobs, tokenizer),
    )
    if event.finished:
        _set_ending(message, event.finish_reason, event.matched_stop, event.error)
        if event.usage is not None:
            message.usage.CopyFrom(usage(event.usage))
        if event.timing is not None:
            message.timing.CopyFrom(timing(event.timing))
    return message


def generate_response(output: RequestOutput, tokenizer: Tokenizer) -> pb.GenerateResponse:
    response = pb.GenerateResponse(
        request_id=output.request_id,
        candidates=[_candidate(out, tokenizer) for out in output.outputs],
        prompt_logprobs=token_logprobs(output.prompt_logprobs, tokenizer),
        usage=usage(output.usage),
    )
    if output.timing is not None:
        response.timing.CopyFrom(timing(output.timing))
    return response


def _candidate(out: CompletionOutput, tokenizer: Tokenizer) -> pb.Candidate:
    candidate = pb.Candidate(
        index=out.index,
        text=out.text,
        token_ids=out.token_ids,
        logprobs=token_logprobs(out.logprobs, tokenizer),
    )
    if out.finish_reason is not None:
        _set_ending(candidate, out.finish_reason, out.matched_stop, out.error)
    return candidate
