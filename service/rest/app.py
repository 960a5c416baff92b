"""The REST door's app: OpenAI's routes (/v1/completions, /v1/chat/completions,
/v1/models), /tokenize and /detokenize, /health and /metrics, over the calls of
service/rest/calls.py. With an API key, /v1 and the token routes need it, checked before a
body is read; a body over max_message_bytes is refused (413) before it is read whole."""

from __future__ import annotations

from typing import Any

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from engine.errors import ValidationError
from engine.sampling_params import check_token_ids
from service import convert
from service.errors import (
    INVALID,
    TOO_LARGE,
    UNAVAILABLE,
    ServiceUnavailable,
    Status,
    TooLarge,
    Unauthenticated,
)
from service.front_door import MAX_MESSAGE_BYTES, FrontDoor, authorized, unauthenticated_message
from service.request import Prompt
from service.rest.bodies import ChatMessage, DetokenizeRequest, TokenizeRequest
from service.rest.calls import GENERATION_PATHS, Calls
from service.rest.errors import ApiError, api_error

# A client has this long to send a request's headers, and again its body: one that trickles
# them (slowloris) is cut off, not left holding a connection (ServerConfig.http_read_timeout).
READ_TIMEOUT_SECONDS = 30.0


def create_app(
    door: FrontDoor,
    api_key: str | None = None,
    max_body_bytes: int = MAX_MESSAGE_BYTES,
    read_timeout: float = READ_TIMEOUT_SECONDS,
) -> FastAPI:
    """The REST app over `service`'s engine; with api_key, /v1 and /tokenize need the key,
    checked before a body is read. Bodies over max_body_bytes get 413 before they are read
    whole; one not received within read_timeout seconds, 408."""
    app = FastAPI(title="pagedserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    calls = app.state.calls = Calls(door, read_timeout)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own refusals (an unknown path, 413) in OpenAI's envelope too."""
        if exc.status_code in (400, 413):
            cause = f" ({exc.__cause__})" if exc.__cause__ is not None else ""
            status = TOO_LARGE if exc.status_code == 413 else INVALID
            message, param = f"body: {exc.detail}{cause}", "body"
        else:  # a path or method this server does not have
            status = Status(grpc.StatusCode.UNIMPLEMENTED, exc.status_code, "invalid_request_error")
            message, param = f"{request.method} {request.url.path}: {exc.detail}", None
        return ApiError(status, message, param, exc.headers).response()

    async def require_key(request: Request) -> None:
        """Before anything reads the body: a caller without the key costs no parse."""
        values = request.headers.getlist("authorization")
        if not authorized(values, api_key):
            error = api_error(Unauthenticated(unauthenticated_message(values)))
            if request.url.path in GENERATION_PATHS:  # counted like the handlers' outcomes
                door.metrics.rpc_finished(request.url.path, error.status.grpc)
            raise error

    guarded = [Depends(require_key)]

    @app.get("/health")
    async def health() -> Response:
        """200 only while a live engine takes work: loading, draining, a dead loop or one the
        watchdog found stuck is 503."""
        try:
            engine = door.ready_engine()
        except ServiceUnavailable as exc:
            return api_error(exc).response()
        if not engine.is_alive or door.fault is not None:
            message = door.fault or engine.fatal_error or "the engine loop is stopped"
            return ApiError(UNAVAILABLE, message).response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(door.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> dict[str, Any]:
        engine = calls.engine()
        return {"object": "list", "data": [calls.model_card(engine)]}

    @app.get("/v1/models/{name}", dependencies=guarded)
    async def model(name: str) -> dict[str, Any]:
        engine = calls.engine()
        calls.check_model(name)
        return calls.model_card(engine)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        return await calls.generate(request, "completion")

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: Request) -> Response:
        return await calls.generate(request, "chat")

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: Request) -> dict[str, Any]:
        engine = calls.engine()
        body = await calls.body(request, TokenizeRequest)
        calls.check_model(body.model)
        prompt = Prompt(body.prompt, body.messages, ChatMessage.as_dict)
        try:
            # Generate's guards: text that cannot fit the context is refused unencoded.
            ids = convert.tokenize(prompt, door.prompts(engine), body.add_special_tokens)
        except ValidationError as exc:
            raise api_error(exc) from None
        return {"count": len(ids), "max_model_len": engine.info.max_model_len, "tokens": ids}

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: Request) -> dict[str, Any]:
        engine = calls.engine()
        body = await calls.body(request, DetokenizeRequest)
        calls.check_model(body.model)
        try:
            check_token_ids("tokens", body.tokens, engine.info.vocab_size)
        except ValidationError as exc:
            raise api_error(exc) from None
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return app


class BodyLimit:
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
            error = api_error(TooLarge(f"body: {message}"))
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
