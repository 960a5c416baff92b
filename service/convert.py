"""Protobuf messages <-> engine types. Pure functions; validation of values is the engine's
(SamplingParams.validate), shape errors of the message itself are raised here."""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message

from engine.errors import ValidationError
from engine.outputs import CandidateEvent, FinishReason, RequestTiming, TokenLogprob, Usage
from engine.sampling_params import (
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
    check_count,
    check_prompt_length,
)
from engine.tokenizer import Tokenizer
from pagedserve.v1 import inference_pb2 as pb

# Messages in one chat prompt. Each renders to a few tokens at least, so more cannot fit
# any context this serves; bounded before a message is copied out of the request.
MAX_CHAT_MESSAGES = 4096
# Prompts in one REST completions request (each is an engine request; past the queue's
# room they get 429), bounded before any is encoded.
MAX_PROMPTS = 1024

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


def prompt_token_ids(
    request: pb.GenerateRequest | pb.TokenizeRequest,
    tokenizer: Tokenizer,
    add_special_tokens: bool = True,
    max_tokens: int | None = None,
    field: str = "prompt",
) -> list[int]:
    """Token ids of the prompt, whichever of text / chat / token_ids the request carries.
    With max_tokens (the context length), text that cannot fit is refused unencoded (the
    error names `field` for text, messages for chat), and so are token ids that fill it."""
    oneof = "prompt" if isinstance(request, pb.GenerateRequest) else "input"
    kind = request.WhichOneof(oneof)
    if kind is None:  # name this request's own oneof and its choices
        *others, last = (f.name for f in request.DESCRIPTOR.oneofs_by_name[oneof].fields)
        raise ValidationError(oneof, f"set one of {', '.join(others)} or {last}")
    if kind == "text":
        return tokenizer.encode(
            request.text, add_special_tokens=add_special_tokens, max_tokens=max_tokens, field=field
        )
    if kind == "chat":
        check_count("messages", len(request.chat.messages), MAX_CHAT_MESSAGES, "messages")
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        return chat_token_ids(messages, tokenizer, max_tokens)
    ids = request.token_ids.ids
    if max_tokens is not None:  # before the ids are copied into a list
        check_prompt_length(len(ids), max_tokens)
    return list(ids)


def chat_messages(messages: list) -> list[dict]:
    """REST's chat messages as the template's dicts, counted first (MAX_CHAT_MESSAGES)."""
    check_count("messages", len(messages), MAX_CHAT_MESSAGES, "messages")
    return [m.as_dict() for m in messages]


def chat_token_ids(
    messages: list[dict], tokenizer: Tokenizer, max_tokens: int | None = None
) -> list[int]:
    """The prompt for chat messages: the model's own template, with the assistant's turn
    opened. The template writes the special tokens itself, so encoding adds none."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False, max_tokens=max_tokens, field="messages")


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


def set_matched_stop(
    message: pb.Candidate | pb.GenerateStreamResponse, stop: str | int | None
) -> None:
    if isinstance(stop, str):
        message.stop_string = stop
    elif isinstance(stop, int):
        message.stop_token_id = stop


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
        message.finish_reason = _FINISH_REASONS[event.finish_reason]
        set_matched_stop(message, event.matched_stop)
        message.error = event.error or ""
        if event.usage is not None:
            message.usage.CopyFrom(usage(event.usage))
        if event.timing is not None:
            message.timing.CopyFrom(timing(event.timing))
    return message


def generate_response(
    request_id: str, n: int, events: list[CandidateEvent], tokenizer: Tokenizer
) -> pb.GenerateResponse:
    candidates = [pb.Candidate(index=i) for i in range(n)]
    response = pb.GenerateResponse(request_id=request_id)
    completion = cached = prompt = 0
    for event in events:
        candidate = candidates[event.index]
        candidate.text += event.text
        candidate.token_ids.extend(event.token_ids)
        candidate.logprobs.extend(token_logprobs(event.logprobs, tokenizer))
        if event.prompt_logprobs is not None:
            response.prompt_logprobs.extend(token_logprobs(event.prompt_logprobs, tokenizer))
        if event.finished:
            candidate.finish_reason = _FINISH_REASONS[event.finish_reason]
            set_matched_stop(candidate, event.matched_stop)
            candidate.error = event.error or ""
            if event.usage is not None:
                prompt = event.usage.prompt_tokens
                completion += event.usage.completion_tokens
                cached = max(cached, event.usage.cached_tokens)
            if event.timing is not None:
                response.timing.CopyFrom(timing(event.timing))
    response.candidates.extend(candidates)
    response.usage.CopyFrom(
        pb.Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)
    )
    return response
