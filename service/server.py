"""The grpc.aio server: the Inference service over one AsyncEngine, plus health and reflection.

A request's path: validate and tokenize here (errors become INVALID_ARGUMENT, never reach
the engine) -> AsyncEngine.submit (bounded queue: RESOURCE_EXHAUSTED when full) -> events
streamed back. Leaving early, by client disconnect, RPC cancellation or deadline, cancels
the engine request, which returns all its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.async_engine import (
    AsyncEngine,
    EngineOverloaded,
    EngineStopped,
    RequestStream,
    StreamOverflow,
)
from engine.errors import ValidationError
from engine.outputs import CandidateEvent
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service import convert

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
RETRY_AFTER_MS = "250"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    max_message_bytes: int = 16 * 1024 * 1024
    max_queued_requests: int = 1024  # the engine's bounded request queue
    mailbox_size: int = 256  # events a candidate may have unread before its stream fails
    drain_seconds: float = 30.0  # grace for in-flight requests after SIGTERM
    metrics_host: str = "0.0.0.0"
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off
    trace_exporter: str = "none"  # none | console | otlp
    otlp_endpoint: str | None = None  # e.g. http://collector:4317 (otlp only)


class InferenceService(inference_pb2_grpc.InferenceServicer):
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.engine.tokenizer

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        request_id, n, stream = await self._submit(request, context)
        events: list[CandidateEvent] = []
        try:
            async for event in stream:  # leaving early, by any door, cancels the request
                events.append(event)
        except StreamOverflow as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        return convert.generate_response(request_id, n, events, self.tokenizer)

    async def StreamGenerate(
        self, request: pb.GenerateRequest, context
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        _, _, stream = await self._submit(request, context)
        try:
            async for event in stream:  # leaving early, by any door, cancels the request
                yield convert.stream_message(event, self.tokenizer)
        except StreamOverflow as exc:  # this client stopped reading; it alone fails
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        live = request.request_id in self.engine.engine.requests
        self.engine.cancel(request.request_id)
        return pb.CancelResponse(cancelled=live)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            ids = convert.prompt_token_ids(request, self.tokenizer, request.add_special_tokens)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(
            token_ids=ids, tokens=[self.tokenizer.id_to_token(i) or "" for i in ids]
        )

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        core = self.engine.engine
        cache = core.config.cache
        return pb.ModelInfo(
            name=self.model_name,
            architecture=core.model_config.architecture,
            max_context_length=core.max_model_len,
            vocab_size=core.model_config.vocab_size,
            eos_token_ids=sorted(core.eos_token_ids),
            kv_block_size=cache.block_size,
            kv_num_blocks=core.block_manager.num_blocks,
            kv_capacity_tokens=core.pool_tokens,
            has_chat_template=self.tokenizer.has_chat_template,
        )

    async def _submit(self, request: pb.GenerateRequest, context) -> tuple[str, int, RequestStream]:
        """Validate, tokenize and queue; aborts the RPC with the right status on failure."""
        request_id = request.request_id or uuid.uuid4().hex
        try:
            if request.model and request.model != self.model_name:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"model: {request.model!r} is not served here (this server serves {self.model_name!r})",
                )
            params = convert.sampling_params(request)
            token_ids = convert.prompt_token_ids(request, self.tokenizer)
            stream = await self.engine.submit(request_id, token_ids, params, request.priority)
        except ValidationError as exc:
            code = (
                grpc.StatusCode.ALREADY_EXISTS
                if exc.field == "request_id"
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            await context.abort(code, str(exc))
        except EngineOverloaded as exc:
            context.set_trailing_metadata((("retry-after-ms", RETRY_AFTER_MS),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return request_id, params.n, stream


async def build_server(
    engine: AsyncEngine, model_name: str, config: ServerConfig
) -> tuple[grpc.aio.Server, health.aio.HealthServicer, int]:
    """A started server; returns it, its health servicer and the bound port."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
    ]
    server = grpc.aio.server(options=options)
    inference_pb2_grpc.add_InferenceServicer_to_server(InferenceService(engine, model_name), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    port = server.add_insecure_port(f"{config.host}:{config.grpc_port}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, port


async def serve(engine: AsyncEngine, model_name: str, config: ServerConfig) -> None:
    """Run until SIGTERM/SIGINT, then drain: readiness off, in-flight requests finish."""
    server, health_servicer, port = await build_server(engine, model_name, config)
    log.info("serving %s on %s:%d", model_name, config.host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(config.drain_seconds)
    engine.shutdown(timeout=5)
