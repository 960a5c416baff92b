"""The OpenAI-compatible REST shim: a FastAPI app over the gRPC service's engine.

Same process, same AsyncEngine, same bounded queue: the app goes through the gRPC service's
front door (service/front_door.py), so "loading" and "draining" answer 503 here exactly when
gRPC answers UNAVAILABLE, and a REST generation counts as in flight for the drain. A call's
API key is checked before its body is read; the body is read within http_read_timeout,
decoded (service/openai_schema.py: msgspec for shapes, SamplingParams.validate for values),
encoded (engine/text/prompts.py: the model's chat template for messages) and submitted, all its
prompts at once; each prompt's events are gathered into its answer (engine/outputs.py),
formatted here as OpenAI's JSON, or as its SSE chunks when streaming. A client that goes
away, from the moment its body is read, cancels its requests, which frees their KV blocks.

Errors use OpenAI's envelope, {"error": {"message", "type", "param", "code"}}: 400
validation, 401 API key, 404 unknown model, 408 a body not sent in time, 413 body over
max_message_bytes, 429 queue full (Retry-After), 503 loading, draining or shutting down,
500 engine fault. A stream the server closes before its end gets the error as its last
event, then [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

import grpc
import h11
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.errors import EngineOverloaded, ValidationError
from engine.outputs import CandidateEvent, FinishReason, RequestOutputBuilder, TokenLogprob
from engine.sampling_params import SamplingParams, check_count
from engine.serving.async_engine import AsyncEngine, EngineStopped
from engine.serving.request_stream import RequestStream, StreamOverflow
from engine.text.tokenizer import Tokenizer
from engine.tool_calls import ParsedText, ToolCallDelta, ToolCallReader, assemble
from service.front_door import (
    MAX_MESSAGE_BYTES,
    FrontDoor,
    ServiceUnavailable,
    UnknownModel,
    authorized,
    unauthenticated_message,
)
from service.openai_schema import (
    MAX_PROMPTS,
    Body,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    decode,
)
from service.tls import TlsFiles

T = TypeVar("T")
RETRY_AFTER_SECONDS = "1"  # HTTP's Retry-After counts whole seconds
# A client has this long to send a request's headers, and again its body: one that trickles
# them (slowloris) is cut off, not left holding a connection (ServerConfig.http_read_timeout).
READ_TIMEOUT_SECONDS = 30.0
_DONE = "data: [DONE]\n\n"
_FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT_LIMIT: "length",
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.CANCELLED: "abort",
    FinishReason.ERROR: "error",
}
# How a REST outcome is counted in pagedserve_requests_total, next to the RPCs.
# The REST calls counted in pagedserve_requests_total, under these names as `rpc`.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_STATUS_CODES = {
    200: grpc.StatusCode.OK,
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.UNAVAILABLE,
}


class ApiError(Exception):
    """An error answered in OpenAI's envelope."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def api_error(exc: Exception, param_names: dict[str, str] | None = None) -> ApiError:
    """The REST face of what submitting (or preparing) a request can raise."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValidationError):
        param = (param_names or {}).get(exc.field, exc.field)
        return ApiError(400, f"{param}: {exc.message}", param=param)
    if isinstance(exc, UnknownModel):
        return ApiError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, EngineOverloaded):
        headers = {"Retry-After": RETRY_AFTER_SECONDS}
        return ApiError(429, str(exc), "rate_limit_error", code="queue_full", headers=headers)
    if isinstance(exc, ServiceUnavailable | EngineStopped):
        return ApiError(503, str(exc), "service_unavailable", code="unavailable")
    return ApiError(500, f"{type(exc).__name__}: {exc}", "internal_error", code="engine_error")


def create_app(
    service: FrontDoor,
    api_key: str | None = None,
    max_body_bytes: int = MAX_MESSAGE_BYTES,
    read_timeout: float = READ_TIMEOUT_SECONDS,
) -> FastAPI:
    """The REST app over `service`'s engine; with api_key, /v1 and /tokenize need the key,
    checked before a body is read. Bodies over max_body_bytes get 413 before they are read
    whole; one not received within read_timeout seconds, 408."""
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_BodyLimit, max_bytes=max_body_bytes)
    api = app.state.api = _Api(service, read_timeout)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own refusals (an unknown path, 413) in OpenAI's envelope too."""
        if exc.status_code in (400, 413):
            cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
            message, param = f"body: {exc.detail}{cause}", "body"
        else:
            message, param = f"{request.method} {request.url.path}: {exc.detail}", None
        return ApiError(exc.status_code, message, param=param, headers=exc.headers).response()

    async def require_key(request: Request) -> None:
        """Before anything reads the body: a caller without the key costs no parse."""
        if not authorized(request.headers.getlist("authorization"), api_key):
            if request.url.path in GENERATION_PATHS:  # counted like the handlers' outcomes
                service.metrics.rpc_finished(request.url.path, grpc.StatusCode.UNAUTHENTICATED)
            raise ApiError(
                401,
                unauthenticated_message(request.headers.getlist("authorization")),
                "authentication_error",
                code="invalid_api_key",
            )

    guarded = [Depends(require_key)]

    @app.get("/health")
    async def health() -> Response:
        """200 only while a live engine takes work: loading, draining, a dead loop or one the
        watchdog found stuck is 503."""
        try:
            engine = service.ready_engine()
        except ServiceUnavailable as exc:
            return api_error(exc).response()
        if not engine.is_alive or service.fault is not None:
            message = service.fault or engine.fatal_error or "the engine loop is stopped"
            return ApiError(503, message, "service_unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        engine = api.engine()
        return {"object": "list", "data": [api.model_card(engine)]}

    @app.get("/v1/models/{name}", dependencies=guarded)
    async def model(name: str) -> dict[str, Any]:
        engine = api.engine()
        api.check_model(name)
        return api.model_card(engine)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        return await api.completions(request)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        return await api.chat_completions(request)

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request) -> dict[str, Any]:
        engine = api.engine()
        body = await api.body(request, TokenizeRequest)
        api.check_model(body.model)
        try:
            # Generate's guards: text that cannot fit the context is refused unencoded.
            ids = service.prompts(engine).tokenize(
                body.prompt,
                messages=body.messages,
                add_special_tokens=body.add_special_tokens,
                as_dict=ChatMessage.as_dict,
            )
        except ValidationError as exc:
            raise api_error(exc) from None
        return {"count": len(ids), "max_model_len": engine.info.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request) -> dict[str, Any]:
        engine = api.engine()
        body = await api.body(request, DetokenizeRequest)
        api.check_model(body.model)
        vocab = engine.info.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens: {bad} is not a token id in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return app


@dataclass
class _Generation:
    """One API call: its engine requests (one per prompt), each gathered into its answer.
    Choice prompt * n + i is candidate i of that prompt's request."""

    id: str
    kind: str  # "completion" | "chat"
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    echo_texts: list[str]  # per prompt; "" unless echo
    # Per prompt, once submitted (after the engine checked what their sizes come from).
    streams: list[RequestStream] = field(default_factory=list)
    outputs: list[RequestOutputBuilder] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))
    finals: list[CandidateEvent] = field(default_factory=list)
    started: set[int] = field(default_factory=set)  # choices a stream sent a first chunk of
    tool_calls: ToolCallReader = field(default_factory=lambda: ToolCallReader(None))

    @classmethod
    def start(
        cls,
        kind: str,
        model: str,
        prompts: list[list[int]],
        params: SamplingParams,
        echo_texts: list[str],
    ) -> _Generation:
        gen_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        return cls(gen_id, kind, model, prompts, params, echo_texts)

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def logprobs(self) -> bool:
        """The request asked for them."""
        return self.params.logprobs is not None

    @property
    def request_ids(self) -> list[str]:
        """The engine's ids of the call's requests, one per prompt."""
        if len(self.prompts) == 1:
            return [self.id]
        return [f"{self.id}-{i}" for i in range(len(self.prompts))]

    def finish_reason(self, index: int, reason: FinishReason) -> str:
        return (
            "tool_calls"
            if self.tool_calls.ended_calling(index, reason)
            else _FINISH_REASONS[reason]
        )

    def add(self, prompt: int, event: CandidateEvent) -> None:
        self.outputs[prompt].add(event)
        if event.finished:
            self.finals.append(event)

    def texts(self) -> list[str]:
        return [text for output in self.outputs for text in output.texts_so_far()]

    def usage(self) -> dict[str, Any]:
        usages = [output.usage for output in self.outputs]
        prompt = sum(u.prompt_tokens for u in usages)
        completion = sum(u.completion_tokens for u in usages)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in usages)},
        }


class _Api:
    def __init__(self, service: FrontDoor, read_timeout: float) -> None:
        self.service = service
        self.read_timeout = read_timeout
        # Set when the server stops: what still runs answers 503 (a stream: its last event).
        self.closing = asyncio.Event()
        self.open_calls = 0  # generations answering now; the server's stop waits for them
        self._idle = asyncio.Event()
        self._idle.set()

    def engine(self) -> AsyncEngine:
        try:
            return self.service.ready_engine()
        except ServiceUnavailable as exc:
            raise api_error(exc) from None

    def check_model(self, name: str | None) -> None:
        try:
            self.service.check_model(name or "")
        except UnknownModel as exc:
            raise api_error(exc) from None

    def model_card(self, engine: AsyncEngine) -> dict[str, Any]:
        return {
            "id": self.service.model_name,
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
            raise ApiError(408, message, param="body", code="body_timeout") from None
        except HTTPException as exc:  # _BodyLimit's 413, met while reading
            raise ApiError(exc.status_code, f"body: {exc.detail}", param="body") from None
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json" and not media_type.endswith("+json"):
            message = "body: must be a JSON object, sent with Content-Type: application/json"
            raise ApiError(400, message, param="body")
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

    async def completions(self, request: Request) -> Response:
        engine = self.engine()
        names = {"prompt_token_ids": "prompt"}
        try:
            body = await self.body(request, CompletionRequest)
            self.service.check_model(body.model or "")
            params = body.sampling_params()
            texts = body.prompts()
            check_count("prompt", len(texts), MAX_PROMPTS, "prompts")  # before encoding
            encoder = self.service.prompts(engine)
            prompts = [
                encoder.prompt(token_ids=p) if isinstance(p, list) else encoder.prompt(p)
                for p in texts
            ]
        except Exception as exc:
            raise self._refused("completion", exc, names) from None
        # After the ids were checked: decoding one that is not a token id can raise.
        echo = [engine.tokenizer.decode(p) if body.echo else "" for p in prompts]
        gen = _Generation.start("completion", self.service.model_name, prompts, params, echo)
        return await self._run(gen, engine, body, names, request)

    async def chat_completions(self, request: Request) -> Response:
        engine = self.engine()
        names = {"logprobs": "top_logprobs", "prompt": "messages"}
        try:
            body = await self.body(request, ChatCompletionRequest)
            names = body.param_names()
            self.service.check_model(body.model or "")
            tools = body.tool_use(self.service.tool_parser(engine))
            params = body.sampling_params(tools)
            prompt = self.service.prompts(engine).prompt(
                messages=body.messages, as_dict=ChatMessage.as_dict, tools=tools
            )
        except Exception as exc:
            raise self._refused("chat", exc, names) from None
        gen = _Generation.start("chat", self.service.model_name, [prompt], params, [""])
        gen.tool_calls = ToolCallReader(tools)
        return await self._run(gen, engine, body, names, request)

    def _refused(self, kind: str, exc: Exception, param_names: dict[str, str]) -> ApiError:
        """The answer to a call refused before it ran, counted like the calls that ran."""
        error = api_error(exc, param_names)
        self._record(kind, error.status, [])
        return error

    async def _run(
        self,
        gen: _Generation,
        engine: AsyncEngine,
        body: CompletionRequest | ChatCompletionRequest,
        param_names: dict[str, str],
        request: Request,
    ) -> Response:
        """Submit the call's prompts and answer it, whole or as a stream. From here on a
        caller who leaves cancels all its requests at once, submitted or still being
        submitted, and a server that stops answers 503."""
        self.open_calls += 1
        self._idle.clear()
        try:
            door = "rest_stream" if body.stream else "rest_unary"
            submitted = self._submit(engine, gen, body.priority, door, param_names)
            ended = await _unless_interrupted(submitted, request.receive, self.closing)
            if ended is not None:  # 499: nobody reads it
                self._record(gen.kind, 499 if ended is _Interrupted.LEFT else 503, [])
                return _interrupted_response(ended)
            if body.stream:
                chunks = self._sse(gen, engine.tokenizer, body.include_usage)
                return _EventStream(chunks, self.closing, media_type="text/event-stream")
            answer = self._full_answer(gen, engine.tokenizer)
            outcome = await _unless_interrupted(answer, request.receive, self.closing)
            return _interrupted_response(outcome) if isinstance(outcome, _Interrupted) else outcome
        finally:
            self.open_calls -= 1
            if self.open_calls == 0:
                self._idle.set()

    async def _submit(
        self,
        engine: AsyncEngine,
        gen: _Generation,
        priority: int,
        door: str,
        param_names: dict[str, str],
    ) -> None:
        """One engine request per prompt, all queued at once; if one is refused, or the
        call ends while they queue, every one of them is cancelled."""
        submits = [
            asyncio.ensure_future(engine.submit(request_id, prompt, gen.params, priority, door))
            for request_id, prompt in zip(gen.request_ids, gen.prompts, strict=True)
        ]
        try:
            gen.streams = await asyncio.gather(*submits)
        except BaseException as exc:
            for submit in submits:
                submit.cancel()  # one still waiting for admission takes its request back
            for outcome in await asyncio.gather(*submits, return_exceptions=True):
                if isinstance(outcome, RequestStream):
                    outcome.cancel()
            if isinstance(exc, Exception):
                raise self._refused(gen.kind, exc, param_names) from None
            raise
        gen.outputs = [
            RequestOutputBuilder.start(request_id, prompt, gen.n)
            for request_id, prompt in zip(gen.request_ids, gen.prompts, strict=True)
        ]
        self.service.log_prompts(gen.id, gen.prompts)

    async def _full_answer(self, gen: _Generation, tokenizer: Tokenizer) -> Response:
        with self.service.in_flight_call(), self._observed(gen) as status:
            async for prompt, event in _merged(gen.streams):
                gen.add(prompt, event)
                if event.finish_reason is FinishReason.ERROR:
                    error = _failed(event)
                    status[0] = error.status
                    raise error
            return JSONResponse(self._full_response(gen, tokenizer))

    @contextlib.contextmanager
    def _observed(self, gen: _Generation) -> Iterator[list[int]]:
        status = [200]
        try:
            yield status
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):
                status[0] = 503 if self.closing.is_set() else 499
            else:
                status[0] = 429 if isinstance(exc, StreamOverflow) else api_error(exc).status
            raise
        finally:
            self._record(gen.kind, status[0], gen.finals)
            if self.service.log_requests:
                self.service.log_outputs(gen.id, gen.texts())

    def _record(self, kind: str, status: int, finals: list[CandidateEvent]) -> None:
        rpc = GENERATION_PATHS[1] if kind == "chat" else GENERATION_PATHS[0]
        self.service.metrics.rpc_finished(rpc, _STATUS_CODES.get(status, grpc.StatusCode.INTERNAL))
        if finals:
            self.service.metrics.request_finished(finals)

    def _full_response(self, gen: _Generation, tokenizer: Tokenizer) -> dict[str, Any]:
        choices = []
        for prompt, builder in enumerate(gen.outputs):
            output = builder.build()
            for out in output.outputs:
                index = prompt * gen.n + out.index
                choice: dict[str, Any] = {"index": index}
                logprobs = None
                if gen.kind == "chat":
                    choice["message"] = _chat_message(gen.tool_calls.parse(index, out.text, True))
                    if gen.logprobs:
                        logprobs = _chat_logprobs(out.logprobs or [], tokenizer)
                else:
                    echo = gen.echo_texts[prompt]
                    choice["text"] = echo + out.text
                    if gen.logprobs:
                        items = list(output.prompt_logprobs or []) if echo else []
                        items += out.logprobs or []
                        logprobs = _completion_logprobs(items, tokenizer, 0)
                choice["logprobs"] = logprobs
                choice["finish_reason"] = gen.finish_reason(index, out.finish_reason)
                choices.append(choice)
        kind = "chat.completion" if gen.kind == "chat" else "text_completion"
        return _envelope(gen, kind, choices) | {"usage": gen.usage()}

    async def _sse(
        self, gen: _Generation, tokenizer: Tokenizer, include_usage: bool
    ) -> AsyncIterator[str]:
        """OpenAI's SSE stream: `data: {chunk}` events, a usage chunk with no choices if
        asked for, then `data: [DONE]`. Closing it early (the client left) cancels the
        engine requests."""
        with self.service.in_flight_call(), self._observed(gen) as status:
            chunk_usage = {"usage": None} if include_usage else {}
            offsets: dict[int, int] = {}  # completions: text offset of each choice
            try:
                async for prompt, event in _merged(gen.streams):
                    index = prompt * gen.n + event.index
                    first = index not in gen.started
                    gen.started.add(index)
                    gen.add(prompt, event)
                    if event.finish_reason is FinishReason.ERROR:
                        error = _failed(event)
                        status[0] = error.status
                        yield _sse_data(error.body())
                        return
                    if gen.kind == "chat":
                        delta = self._chat_delta(gen, index, event, tokenizer, first)
                    else:
                        delta = self._text_delta(gen, index, event, tokenizer, first, offsets)
                    if delta is not None:
                        yield _sse_data(self._chunk(gen, [delta]) | chunk_usage)
            except StreamOverflow as exc:
                status[0] = 429
                yield _sse_data(ApiError(429, str(exc), "rate_limit_error").body())
                return
            if include_usage:
                yield _sse_data(self._chunk(gen, []) | {"usage": gen.usage()})
            yield _DONE

    def _chunk(self, gen: _Generation, choices: list[dict]) -> dict[str, Any]:
        kind = "chat.completion.chunk" if gen.kind == "chat" else "text_completion"
        return _envelope(gen, kind, choices)

    def _chat_delta(
        self,
        gen: _Generation,
        index: int,
        event: CandidateEvent,
        tokenizer: Tokenizer,
        first: bool,
    ) -> dict[str, Any] | None:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        parsed = gen.tool_calls.parse(index, event.text, event.finished)
        if parsed.content or first:
            delta["content"] = parsed.content
        if parsed.tool_calls:
            delta["tool_calls"] = [_tool_call_delta(d) for d in parsed.tool_calls]
        if not delta and not event.finished:
            return None
        logprobs = None
        if gen.logprobs and event.logprobs:
            logprobs = _chat_logprobs(event.logprobs, tokenizer)
        finish = gen.finish_reason(index, event.finish_reason) if event.finished else None
        return {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
        }

    def _text_delta(
        self,
        gen: _Generation,
        index: int,
        event: CandidateEvent,
        tokenizer: Tokenizer,
        first: bool,
        offsets: dict[int, int],
    ) -> dict[str, Any] | None:
        prompt = index // gen.n
        text = (gen.echo_texts[prompt] if first else "") + event.text
        if not text and not event.finished:
            return None
        logprobs = None
        if gen.logprobs:
            items: list[TokenLogprob | None] = []
            if first and gen.echo_texts[prompt]:
                items += gen.outputs[prompt].prompt_logprobs or []
            items += event.logprobs or []
            start = offsets.get(index, 0)
            logprobs = _completion_logprobs(items, tokenizer, start)
        offsets[index] = offsets.get(index, 0) + len(text)
        finish = _FINISH_REASONS[event.finish_reason] if event.finished else None
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


class _BodyLimit:
    """ASGI middleware: 413 for a request body over max_bytes, at once when its
    Content-Length says so, else as soon as the bytes read pass the limit; so an over-large
    body is never held in memory whole."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        message = f"larger than the server's limit of {self.max_bytes} bytes (max_message_bytes)"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            error = ApiError(413, f"body: {message}", param="body", code="body_too_large")
            return await error.response()(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            event = await receive()
            seen += len(event.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, message)
            return event

        await self.app(scope, limited_receive, send)


class _EventStream(StreamingResponse):
    """A StreamingResponse that stops the moment its client disconnects, whether or not it
    was writing (a request still waiting for its first token writes nothing), and always
    closes its body iterator, so the engine requests are cancelled at once, not at GC time.
    When the server closes it first, its last event is the 503 that says so, then [DONE]."""

    def __init__(self, content: AsyncIterator[str], closing: asyncio.Event, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.closing = closing

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def send_noting_start(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            streamed = self.stream_response(send_noting_start)
            ended = await _unless_interrupted(streamed, receive, self.closing)
        finally:
            await self.body_iterator.aclose()
        if ended is _Interrupted.CLOSING and started:
            last = _sse_data(_closing_error().body()) + _DONE
            await send({"type": "http.response.body", "body": last.encode(), "more_body": False})
        elif ended is _Interrupted.CLOSING:
            await _closing_error().response()(scope, receive, send)


def _failed(event: CandidateEvent) -> ApiError:
    """The answer to a request the engine failed: 400 where a field of it was at fault (a
    constraint whose grammar could not be followed), else 500, an engine fault."""
    if event.error_field is not None:
        return ApiError(400, event.error, param=event.error_field)
    return ApiError(500, event.error or "engine error", "internal_error")


def _envelope(gen: _Generation, kind: str, choices: list[dict]) -> dict[str, Any]:
    """The fields a completion, a chat completion and each of their chunks share."""
    return {
        "id": gen.id,
        "object": kind,
        "created": gen.created,
        "model": gen.model,
        "choices": choices,
    }


def _sse_data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _Interrupted(Enum):
    """Why a call's work stopped before its end."""

    LEFT = "left"  # the client disconnected
    CLOSING = "closing"  # the server is stopping


async def _unless_interrupted(
    work: Coroutine[Any, Any, T], receive, closing: asyncio.Event
) -> T | _Interrupted:
    """work's result; or, if the client disconnects or the server closes first, why, once
    work is cancelled. The request's body was read already: what comes next from receive
    is the disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    left = asyncio.ensure_future(disconnected())
    closed = asyncio.ensure_future(closing.wait())
    try:
        await asyncio.wait((task, left, closed), return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        closed.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled():
        return task.result()
    return _Interrupted.CLOSING if closing.is_set() else _Interrupted.LEFT


def _closing_error() -> ApiError:
    return ApiError(503, "server is shutting down; retry elsewhere", "service_unavailable")


def _interrupted_response(why: _Interrupted) -> Response:
    """The answer to a call cut short: none for a client who left (499, logged only), 503
    when the server is stopping."""
    return Response(status_code=499) if why is _Interrupted.LEFT else _closing_error().response()


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, CandidateEvent]]:
    """(prompt index, event) from every stream as they come; leaving early cancels them all.
    The hand-over queue is bounded: a consumer that stops reading stops the pumps too, so
    each stream's own mailbox fills and cancels its request (a slow reader fails alone)."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, CandidateEvent | Exception | None]] = asyncio.Queue(
        maxsize=len(streams)
    )

    async def pump(i: int, stream: RequestStream) -> None:
        end: Exception | None = None
        try:
            async for event in stream:
                await queue.put((i, event))
        except Exception as exc:
            end = exc
        await queue.put((i, end))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()  # each stream's own cleanup cancels its engine request


def _chat_message(parsed: ParsedText) -> dict[str, Any]:
    """A chat answer's message: its content and, where the model called tools, its calls
    (the content then None when it is only whitespace)."""
    if not parsed.tool_calls:
        return {"role": "assistant", "content": parsed.content}
    calls = [call.openai() for call in assemble(parsed.tool_calls)]
    content = parsed.content if parsed.content.strip() else None
    return {"role": "assistant", "content": content, "tool_calls": calls}


def _tool_call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    """A streamed call piece as OpenAI sends it: index, id, type and name on a call's first,
    then arguments pieces."""
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    function = {"name": delta.name, "arguments": delta.arguments}
    return {"index": delta.index, "id": delta.id, "type": "function", "function": function}


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(items: list[TokenLogprob], tokenizer: Tokenizer) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            entry(item.token_id, item.logprob)
            | {"top_logprobs": [entry(t, lp) for t, lp in item.top]}
            for item in items
        ]
    }


def _completion_logprobs(
    items: list[TokenLogprob | None], tokenizer: Tokenizer, offset: int
) -> dict[str, Any]:
    """The legacy completions shape; a prompt's first token (no logprob) comes as None."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for item in items:
        if item is None:
            continue
        text = _token_text(tokenizer, item.token_id)
        tokens.append(text)
        token_logprobs.append(item.logprob)
        # The legacy API lists the sampled token too, when it is not among the top ones.
        alternatives = dict(item.top)
        alternatives.setdefault(item.token_id, item.logprob)
        top.append({_token_text(tokenizer, t): lp for t, lp in alternatives.items()} or None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


# ---- serving -----------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: serve() owns SIGTERM (drain, then stop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _ssl_options(tls: TlsFiles | None) -> dict[str, Any]:
    """uvicorn's TLS settings for the same files the gRPC port uses."""
    if tls is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.mutual:
        options |= {"ssl_ca_certs": tls.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


class _TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request's head: a client that has
    not sent all of a request's headers within head_timeout seconds of its first byte (or
    of the connection's opening) is disconnected, so a slowloris client cannot hold a
    connection. (The body's deadline is the app's: _Api.body.)"""

    def __init__(self, *args: Any, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a head begun and not yet whole
            self._await_head()
        elif self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.head_timeout, self._head_late)

    def _head_late(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


@dataclass
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task
    port: int
    api: _Api

    async def stop(self) -> None:
        """End what the REST door still answers (each its 503), then stop listening."""
        await self.api.close(timeout=1.0)
        self.server.should_exit = True
        await self.task


async def start_http(
    service: FrontDoor,
    host: str,
    port: int,
    api_key: str | None = None,
    log_level: str = "warning",
    tls: TlsFiles | None = None,
    max_body_bytes: int = MAX_MESSAGE_BYTES,
    read_timeout: float = READ_TIMEOUT_SECONDS,
) -> HttpServer:
    """Serve the REST app on the running loop; returns once it listens (port 0: any free
    port, the bound one is HttpServer.port). With tls, HTTPS; with its client CA, clients
    must present a certificate that chains to it. A client has read_timeout seconds to send
    a request's headers, and as long again for its body."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    app = create_app(service, api_key, max_body_bytes, read_timeout)
    config = uvicorn.Config(
        app,
        http=functools.partial(_TimedH11Protocol, head_timeout=read_timeout),
        log_level=log_level,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=1,  # the drain has already waited for work in flight
        **_ssl_options(tls),
    )
    server = _Uvicorn(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("the REST server stopped while starting")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, sock.getsockname()[1], app.state.api)
