"""The REST door's calls over the front door (service/front_door.py): a body read within
its deadline and parsed into a GenerationRequest (service/rest/bodies.py), converted and
submitted by the front door, all its prompts at once; each prompt's events gathered into
the call's Answer (service/answer.py), written as OpenAI's JSON, or as its SSE chunks when
streaming. A client that goes away, from the moment its body is read, cancels its
requests, which frees their KV blocks; a server that stops answers what still runs with
503 (a stream: as its last event, then [DONE]).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from engine.errors import ValidationError
from engine.outputs import CandidateEvent, FinishReason, RequestOutputBuilder
from engine.serving.async_engine import AsyncEngine
from engine.serving.request_stream import RequestStream, StreamOverflow
from engine.text.tokenizer import Tokenizer
from service.answer import Answer
from service.convert import EngineInputs
from service.errors import (
    CLIENT_LEFT,
    OK,
    UNAVAILABLE,
    ReadTimeout,
    RequestFailed,
    Status,
    TooLarge,
)
from service.front_door import FrontDoor
from service.request import GenerationRequest
from service.rest import shapes
from service.rest.bodies import Body, ChatCompletionRequest, CompletionRequest, decode
from service.rest.errors import ApiError, api_error
from service.rest.sse import (
    DONE,
    EventStream,
    Interrupted,
    interrupted_response,
    merged,
    sse_data,
    unless_interrupted,
)
from service.tool_calls import ToolCallReader

# The REST calls counted in pagedserve_requests_total, under these names as `rpc`.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Generation:
    """One API call: its engine requests (one per prompt) and the answer they make."""

    id: str
    kind: str  # "completion" | "chat"
    model: str
    request: GenerationRequest
    inputs: EngineInputs
    answer: Answer
    echo_texts: list[str]  # per prompt; "" unless echo
    streamed: bool  # answered as server-sent events
    include_usage: bool
    streams: list[RequestStream] = field(default_factory=list)  # per prompt, once submitted
    created: int = field(default_factory=lambda: int(time.time()))
    started: set[int] = field(default_factory=set)  # choices a stream sent a first chunk of

    @property
    def path(self) -> str:
        return path_of(self.kind)

    @property
    def logprobs(self) -> bool:
        """The request asked for them."""
        return self.inputs.params.logprobs is not None

    @property
    def request_ids(self) -> list[str]:
        """The engine's ids of the call's requests, one per prompt."""
        if len(self.inputs.prompts) == 1:
            return [self.id]
        return [f"{self.id}-{i}" for i in range(len(self.inputs.prompts))]

    def envelope(self, kind: str, choices: list[dict]) -> dict[str, Any]:
        return shapes.envelope(self.id, kind, self.created, self.model, choices)

    def finish_reason(self, choice: int, reason: FinishReason) -> str:
        return shapes.FINISH_REASONS[self.answer.finish_reason(choice, reason)]


class Calls:
    """The REST door's generations and token calls over one front door."""

    def __init__(self, door: FrontDoor, read_timeout: float) -> None:
        self.door = door
        self.read_timeout = read_timeout
        # Set when the server stops: what still runs answers 503 (a stream: its last event).
        self.closing = asyncio.Event()
        self.open_calls = 0  # generations answering now; the server's stop waits for them
        self._idle = asyncio.Event()
        self._idle.set()

    def engine(self) -> AsyncEngine:
        try:
            return self.door.ready_engine()
        except Exception as exc:
            raise api_error(exc) from None

    def check_model(self, name: str | None) -> None:
        try:
            self.door.check_model(name or "")
        except Exception as exc:
            raise api_error(exc) from None

    def model_card(self, engine: AsyncEngine) -> dict[str, Any]:
        return {
            "id": self.door.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pagedserve",
            "max_model_len": engine.info.max_model_len,
        }

    async def body(self, request: Request, kind: type[Body]) -> Body:
        """The request's body as `kind`, read within read_timeout (slow senders get 408)."""
        try:
            raw = await asyncio.wait_for(request.body(), self.read_timeout)
        except asyncio.TimeoutError:
            message = f"body: not received within {self.read_timeout:g} s (http_read_timeout)"
            raise api_error(ReadTimeout(message)) from None
        except HTTPException as exc:  # BodyLimit's 413, met while reading
            raise api_error(TooLarge(f"body: {exc.detail}")) from None
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            message = "must be a JSON object, sent with Content-Type: application/json"
            raise api_error(ValidationError("body", message))
        try:
            return decode(raw, kind)
        except ValidationError as exc:
            raise api_error(exc) from None

    async def close(self, timeout: float) -> None:
        """End every generation still answering: each gets its 503 (a stream as its last
        event, then [DONE]); returns once they have, or after timeout."""
        self.closing.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)

    # ---- generation ----------------------------------------------------------------------

    async def generate(self, request: Request, kind: str) -> Response:
        """A completion (kind "completion") or chat completion ("chat") call."""
        engine = self.engine()
        try:
            body_type = ChatCompletionRequest if kind == "chat" else CompletionRequest
            body = await self.body(request, body_type)
            call = body.generation_request()
            inputs = self.door.convert(engine, call)
        except Exception as exc:
            error = api_error(exc)
            self._record(path_of(kind), error.status, [])
            raise error from None
        echo = getattr(body, "echo", False)
        # After the ids were checked: decoding one that is not a token id can raise.
        echo_texts = [engine.tokenizer.decode(p) if echo else "" for p in inputs.prompts]
        gen_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        answer = Answer([], inputs.params.n, ToolCallReader(inputs.tools))
        gen = Generation(
            gen_id,
            kind,
            self.door.model_name,
            call,
            inputs,
            answer,
            echo_texts,
            body.stream,
            body.include_usage,
        )
        return await self._run(gen, engine, request)

    async def _run(self, gen: Generation, engine: AsyncEngine, request: Request) -> Response:
        """Submit the call's prompts and answer it, whole or as a stream. From here on a
        caller who leaves cancels all its requests at once, submitted or still being
        submitted, and a server that stops answers 503."""
        self.open_calls += 1
        self._idle.clear()
        try:
            submitted = self._submit(engine, gen)
            ended = await unless_interrupted(submitted, request.receive, self.closing)
            if ended is not None:  # 499: nobody reads it
                left = ended is Interrupted.LEFT
                self._record(gen.path, CLIENT_LEFT if left else UNAVAILABLE, [])
                return interrupted_response(ended)
            if gen.streamed:
                chunks = self._sse(gen, engine.tokenizer)
                return EventStream(chunks, self.closing, media_type="text/event-stream")
            answer = self._full_answer(gen, engine.tokenizer)
            outcome = await unless_interrupted(answer, request.receive, self.closing)
            return interrupted_response(outcome) if isinstance(outcome, Interrupted) else outcome
        finally:
            self.open_calls -= 1
            if self.open_calls == 0:
                self._idle.set()

    async def _submit(self, engine: AsyncEngine, gen: Generation) -> None:
        """Queue every prompt of the call at once (FrontDoor.submit)."""
        door = "rest_stream" if gen.streamed else "rest_unary"
        try:
            gen.streams = await self.door.submit(
                engine, gen.request, gen.inputs, gen.id, gen.request_ids, door
            )
        except Exception as exc:
            error = api_error(exc)
            self._record(gen.path, error.status, [])
            raise error from None
        gen.answer.outputs = [
            RequestOutputBuilder.start(request_id, prompt, gen.answer.n)
            for request_id, prompt in zip(gen.request_ids, gen.inputs.prompts, strict=True)
        ]

    async def _full_answer(self, gen: Generation, tokenizer: Tokenizer) -> Response:
        with self.door.in_flight_call(), self._observed(gen):
            async for prompt, event in merged(gen.streams):
                gen.answer.add(prompt, event)
                if event.finish_reason is FinishReason.ERROR:
                    raise api_error(RequestFailed.of(event))
            return JSONResponse(self._full_response(gen, tokenizer))

    @contextlib.contextmanager
    def _observed(self, gen: Generation) -> Iterator[list[ApiError]]:
        """Count the call by outcome when it ends; a stream that ends with an error event
        appends that error to the list this yields."""
        errors: list[ApiError] = []
        status = OK
        try:
            yield errors
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                status = UNAVAILABLE if self.closing.is_set() else CLIENT_LEFT
            elif isinstance(exc, Exception):
                status = api_error(exc).status
            raise
        finally:
            if errors:
                status = errors[0].status
            self._record(gen.path, status, gen.answer.finals)
            if self.door.log_requests:
                self.door.log_outputs(gen.id, gen.answer.texts())

    def _record(self, path: str, status: Status, finals: list[CandidateEvent]) -> None:
        self.door.metrics.rpc_finished(path, status.grpc)
        if finals:
            self.door.metrics.request_finished(finals)

    def _full_response(self, gen: Generation, tokenizer: Tokenizer) -> dict[str, Any]:
        choices = []
        for prompt, builder in enumerate(gen.answer.outputs):
            output = builder.build()
            for out in output.outputs:
                index = prompt * gen.answer.n + out.index
                choice: dict[str, Any] = {"index": index}
                logprobs = None
                if gen.kind == "chat":
                    parsed = gen.answer.tool_calls.parse(index, out.text, True)
                    choice["message"] = shapes.chat_message(parsed)
                    if gen.logprobs:
                        logprobs = shapes.chat_logprobs(out.logprobs or [], tokenizer)
                else:
                    echo = gen.echo_texts[prompt]
                    choice["text"] = echo + out.text
                    if gen.logprobs:
                        items = list(output.prompt_logprobs or []) if echo else []
                        items += out.logprobs or []
                        logprobs = shapes.completion_logprobs(items, tokenizer, 0)
                choice["logprobs"] = logprobs
                choice["finish_reason"] = gen.finish_reason(index, out.finish_reason)
                choices.append(choice)
        kind = "chat.completion" if gen.kind == "chat" else "text_completion"
        return gen.envelope(kind, choices) | {"usage": shapes.usage(gen.answer.usage())}

    async def _sse(self, gen: Generation, tokenizer: Tokenizer) -> AsyncIterator[str]:
        """OpenAI's SSE stream: `data: {chunk}` events, a usage chunk with no choices if
        asked for, then `data: [DONE]`. Closing it early (the client left) cancels the
        engine requests."""
        with self.door.in_flight_call(), self._observed(gen) as errors:
            chunk_usage = {"usage": None} if gen.include_usage else {}
            offsets: dict[int, int] = {}  # completions: text offset of each choice
            try:
                async for prompt, event in merged(gen.streams):
                    index = gen.answer.choice(prompt, event)
                    first = index not in gen.started
                    gen.started.add(index)
                    gen.answer.add(prompt, event)
                    if event.finish_reason is FinishReason.ERROR:
                        errors.append(api_error(RequestFailed.of(event)))
                        yield sse_data(errors[0].body())
                        return
                    if gen.kind == "chat":
                        delta = self._chat_delta(gen, index, event, tokenizer, first)
                    else:
                        delta = self._text_delta(gen, index, event, tokenizer, first, offsets)
                    if delta is not None:
                        yield sse_data(gen.envelope(_chunk_kind(gen), [delta]) | chunk_usage)
            except StreamOverflow as exc:
                errors.append(api_error(exc))
                yield sse_data(errors[0].body())
                return
            if gen.include_usage:
                usage = {"usage": shapes.usage(gen.answer.usage())}
                yield sse_data(gen.envelope(_chunk_kind(gen), []) | usage)
            yield DONE

    def _chat_delta(
        self,
        gen: Generation,
        index: int,
        event: CandidateEvent,
        tokenizer: Tokenizer,
        first: bool,
    ) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        parsed = gen.answer.tool_calls.parse(index, event.text, event.finished)
        if parsed.content or first:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [shapes.tool_call_delta(d) for d in parsed.tool_calls]
        if not delta and not event.finished:
            return None
        logprobs = None
        if gen.logprobs and event.logprobs:
            logprobs = shapes.chat_logprobs(event.logprobs, tokenizer)
        finish = gen.finish_reason(index, event.finish_reason) if event.finished else None
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    def _text_delta(
        self,
        gen: Generation,
        index: int,
        event: CandidateEvent,
        tokenizer: Tokenizer,
        first: bool,
        offsets: dict[int, int],
    ) -> dict[str, Any] | None:
        prompt = index // gen.answer.n
        text = (gen.echo_texts[prompt] if first else "") + event.text
        if not text and not event.finished:
            return None
        logprobs = None
        if gen.logprobs:
            items: list = []
            if first and gen.echo_texts[prompt]:
                items += gen.answer.outputs[prompt].prompt_logprobs or []
            items += event.logprobs or []
            start = offsets.get(index, 0)
            logprobs = shapes.completion_logprobs(items, tokenizer, start)
        offsets[index] = offsets.get(index, 0) + len(text)
        finish = gen.finish_reason(index, event.finish_reason) if event.finished else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def path_of(kind: str) -> str:
    """The route of a call of `kind` ("completion" or "chat"), its name in the metrics."""
    return GENERATION_PATHS[1] if kind == "chat" else GENERATION_PATHS[0]


def _chunk_kind(gen: Generation) -> str:
    return "chat.completion.chunk" if gen.kind == "chat" else "text_completion"
