"""The grpc.aio server: the Inference service over one AsyncEngine, plus health and reflection.

A request's path: validate and tokenize here (errors become INVALID_ARGUMENT, never reach
the engine) -> AsyncEngine.submit (bounded queue: RESOURCE_EXHAUSTED when full) -> events
streamed back. Leaving early, by client disconnect, RPC cancellation or deadline, cancels
the engine request, which returns all its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.errors import DuplicateRequest, EngineOverloaded, ModelLoadError, ValidationError
from engine.outputs import CandidateEvent, FinishReason, RequestOutputBuilder
from engine.serving.async_engine import AsyncEngine, EngineStopped, EngineThread
from engine.serving.engine_process import EngineProcess
from engine.serving.request_stream import RequestStream, StreamOverflow
from engine.text.prompts import PromptEncoder
from engine.tool_calls import TOOL_PARSERS, ToolCallReader
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service import convert
from service.front_door import (
    MAX_MESSAGE_BYTES,
    FrontDoor,
    ServiceUnavailable,
    UnknownModel,
    authorized,
    check_request_id,
    request_log,
    unauthenticated_message,
)
from service.metrics import ServerMetrics, process_age, rpc_status
from service.tls import TlsFiles, caller_scope, check_tls_files, read_pem
from service.tracing import TRACE_EXPORTERS, RequestTracer, configure_tracing

if TYPE_CHECKING:
    from service.http_api import HttpServer

log = logging.getLogger(__name__)
# The one line that says the server is up: where it listens, what it serves, how fast it
# got there. Shown at the default log level (WARNING) without turning every INFO log on.
ready_log = logging.getLogger("pagedserve")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
RETRY_AFTER_MS = "250"
WATCHDOG_SECONDS = 1.0  # how often the watchdog looks at the engine
KEEPALIVE_MS = 20_000  # ping an idle connection this often; no answer this long: it is gone
# grpc.aio takes arriving calls off the event loop one at a time; those not taken yet wait
# in grpc core, which by default sheds them once 1,000 wait (every one at 3,000), each with
# a bare CANCELLED that no handler sees: a burst of thousands lost most of its calls so.
# The front door answers overload itself (the queue bound: RESOURCE_EXHAUSTED with
# retry-after-ms, counted), so every call must reach it: core never sheds.
UNBOUNDED_PENDING_CALLS = 2**31 - 1


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_queued_requests: int = 1024  # the engine's bounded request queue
    mailbox_size: int = 256  # events a candidate may have unread before its stream fails
    # The engine loop in a child process (None: on for CUDA, where the loop's host work
    # and the server's per-token writes each need a core), else on a thread.
    engine_process: bool | None = None
    drain_seconds: float = 30.0  # grace for in-flight requests after SIGTERM
    # Work outstanding and no step finished for this long: the loop is stuck, and health
    # is NOT_SERVING until it steps again. Far above any one step (a long prefill).
    engine_stall_seconds: float = 60.0
    metrics_host: str | None = None  # None: host's
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off
    trace_exporter: str = "none"  # none | console | otlp
    otlp_endpoint: str | None = None  # e.g. http://collector:4317 (otlp only)
    http_host: str | None = None  # None: host's
    http_port: int | None = None  # the OpenAI-compatible REST shim; None: off
    # Seconds a REST client has to send a request's headers, and again its body.
    http_read_timeout: float = 30.0
    # Callers must send "Authorization: Bearer <key>" (REST header, gRPC metadata); None: off.
    api_key: str | None = field(default=None, repr=False)  # never in logs
    # TLS on the gRPC port and the REST shim (PEM files); with a client CA, mTLS: callers
    # must present a certificate that chains to it. Files are checked here, at config time.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    # A plaintext gRPC port with only the health service, for probes that cannot do TLS
    # (Kubernetes' grpc probe); None: health only on grpc_port.
    health_port: int | None = None
    log_requests: bool = False  # prompts and outputs in the log (logger service.requests)
    # The format the model writes tool calls in: auto (from its chat template) or one of
    # engine/tool_calls.py's TOOL_PARSERS.
    tool_parser: str = "auto"

    def __post_init__(self) -> None:
        for name in ("grpc_port", "metrics_port", "http_port", "health_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValidationError(name, f"must be a port in [0, 65535], got {port}")
        if not 1 <= self.max_message_bytes <= 2**31 - 1:
            raise ValidationError(
                "max_message_bytes", f"must be in [1, 2**31 - 1], got {self.max_message_bytes}"
            )
        for name in ("max_queued_requests", "mailbox_size"):
            if getattr(self, name) < 1:
                raise ValidationError(name, f"must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.drain_seconds < math.inf:
            raise ValidationError(
                "drain_seconds", f"must be a finite number >= 0, got {self.drain_seconds}"
            )
        if not 0 < self.http_read_timeout < math.inf:
            raise ValidationError(
                "http_read_timeout", f"must be a finite number > 0, got {self.http_read_timeout}"
            )
        if not 0 < self.engine_stall_seconds < math.inf:
            raise ValidationError(
                "engine_stall_seconds",
                f"must be a finite number > 0, got {self.engine_stall_seconds}",
            )
        if self.tool_parser not in ("auto", *TOOL_PARSERS):
            raise ValidationError(
                "tool_parser",
                f"must be auto or one of {', '.join(TOOL_PARSERS)}, got {self.tool_parser!r}",
            )
        if self.trace_exporter not in TRACE_EXPORTERS:
            raise ValidationError(
                "trace_exporter",
                f"must be one of {', '.join(TRACE_EXPORTERS)}, got {self.trace_exporter!r}",
            )
        for name in ("host", "metrics_host", "http_host"):
            if getattr(self, name) == "":
                raise ValidationError(name, "must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ValidationError("api_key", "must not be empty or blank")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            missing = "tls_key_file" if self.tls_key_file is None else "tls_cert_file"
            raise ValidationError(missing, "must be set too: TLS needs a certificate and its key")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValidationError(
                "tls_client_ca_file", "needs tls_cert_file and tls_key_file (mTLS is TLS too)"
            )
        if self.tls_cert_file is not None:
            check_tls_files(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)

    @property
    def metrics_bind_host(self) -> str:
        """Where /metrics listens: metrics_host, else where gRPC does."""
        return self.host if self.metrics_host is None else self.metrics_host

    @property
    def http_bind_host(self) -> str:
        """Where the REST shim listens: http_host, else where gRPC does."""
        return self.host if self.http_host is None else self.http_host

    @property
    def tls(self) -> TlsFiles | None:
        """The TLS files of both the gRPC port and the REST shim; None: plaintext."""
        if self.tls_cert_file is None:
            return None
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)


async def refuse(
    metrics: ServerMetrics, rpc: str, context, code: grpc.StatusCode, message: str
) -> None:
    """Abort a call in an interceptor, before its handler runs: counted in the RPC metric
    as the handlers count their own outcomes."""
    metrics.rpc_finished(rpc, code)
    await context.abort(code, message)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls without exactly one `authorization: Bearer <key>` metadata
    entry (front_door.authorized, the REST door's rule too); health checks and reflection
    stay open, so Kubernetes probes and grpcurl need no key. Refusals are counted in the
    RPC metric (refuse())."""

    OPEN_SERVICES = (f"/{health.SERVICE_NAME}/", f"/{reflection.SERVICE_NAME}/")

    def __init__(self, api_key: str, metrics: ServerMetrics) -> None:
        self.api_key = api_key
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.OPEN_SERVICES):
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        values = [value for key, value in metadata if key == "authorization"]
        if authorized(values, self.api_key):
            return handler

        async def deny(request, context):
            rpc = handler_call_details.method.rpartition("/")[2]
            message = unauthenticated_message(values)
            await refuse(self.metrics, rpc, context, grpc.StatusCode.UNAUTHENTICATED, message)

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(
            deny,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class ParseInterceptor(grpc.aio.ServerInterceptor):
    """Inference requests whose bytes do not parse (a string that is not UTF-8, a corrupt
    wire format) get INVALID_ARGUMENT naming the field; grpc.aio would answer UNKNOWN.
    Counted in the RPC metric (refuse())."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        service, _, name = handler_call_details.method.rpartition("/")
        if handler is None or service != f"/{SERVICE_NAME}":
            return handler
        method = pb.DESCRIPTOR.services_by_name["Inference"].methods_by_name[name]
        message_type = getattr(pb, method.input_type.name)

        async def parsed(data: bytes, context):
            try:
                return convert.parse(message_type, data)
            except ValidationError as exc:
                await refuse(
                    self.metrics, name, context, grpc.StatusCode.INVALID_ARGUMENT, str(exc)
                )

        async def unary(data: bytes, context):
            return await handler.unary_unary(await parsed(data, context), context)

        async def stream(data: bytes, context):
            async for message in handler.unary_stream(await parsed(data, context), context):
                yield message

        if handler.response_streaming:
            make, behavior = grpc.unary_stream_rpc_method_handler, stream
        else:
            make, behavior = grpc.unary_unary_rpc_method_handler, unary
        return make(behavior, response_serializer=handler.response_serializer)


class InferenceService(FrontDoor, inference_pb2_grpc.InferenceServicer):
    """The RPCs, behind the front door's rules: while no warm engine takes work (loading,
    draining) they answer UNAVAILABLE. The REST shim shares this object's door."""

    def __init__(self, tracer: RequestTracer) -> None:
        super().__init__()
        self.tracer = tracer
        self.max_message_bytes = ServerConfig.max_message_bytes  # a unary response's limit

    @contextlib.contextmanager
    def _observed(self, rpc: str, context) -> Iterator[list[CandidateEvent]]:
        """Count the RPC by outcome and trace it; the caller appends the final events it saw."""
        span = self.tracer.start_request(f"{SERVICE_NAME}/{rpc}", context.invocation_metadata())
        finals: list[CandidateEvent] = []
        error: BaseException | None = None
        try:
            yield finals
        except BaseException as exc:  # CancelledError too: the client left or its deadline passed
            error = exc
            raise
        finally:
            code = rpc_status(context, error)
            self.metrics.rpc_finished(rpc, code)
            if finals:
                self.metrics.request_finished(finals)
            span.finish(code, finals)

    async def _engine(self, context) -> AsyncEngine:
        try:
            return self.ready_engine()
        except ServiceUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        with self._observed("Generate", context) as finals, self.in_flight_call():
            engine = await self._engine(context)
            output, stream, tool_calls = await self._submit(engine, request, context, "grpc_unary")
            try:
                async for event in stream:  # leaving early, by any door, cancels the request
                    output.add(event)
                    if event.finished:
                        finals.append(event)
                        await _abort_on_error(event, context)
            except StreamOverflow as exc:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            finally:
                self.log_outputs(stream.request_id, output.texts_so_far())
            response = convert.generate_response(output.build(), engine.tokenizer, tool_calls)
            advice = "ask for fewer candidates, tokens or logprobs, or use StreamGenerate"
            await self._check_size(response, context, advice)
            return response

    async def StreamGenerate(
        self, request: pb.GenerateRequest, context
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        with self._observed("StreamGenerate", context) as finals, self.in_flight_call():
            engine = await self._engine(context)
            output, stream, tool_calls = await self._submit(engine, request, context, "grpc_stream")
            tokenizer = engine.tokenizer
            try:
                async for event in stream:  # leaving early, by any door, cancels the request
                    if event.finished:
                        finals.append(event)
                        await _abort_on_error(event, context)
                    if self.log_requests:
                        output.add(event)
                    message = convert.stream_message(event, tokenizer, tool_calls)
                    message.request_id = output.request_id  # the caller's id, not the engine's
                    yield message
            except StreamOverflow as exc:  # this client stopped reading; it alone fails
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            finally:
                self.log_outputs(stream.request_id, output.texts_so_far())

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        with self._observed("Cancel", context):
            try:
                check_request_id(request.request_id)
            except ValidationError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            if self.engine is None:  # a draining server still cancels: that only frees work
                await context.abort(grpc.StatusCode.UNAVAILABLE, "model is still loading")
            # Only the caller's own requests: under mTLS another caller's equal id is another
            # engine request (engine_request_id), which this never names.
            request_id = engine_request_id(caller_scope(context), request.request_id)
            live = self.engine.is_running(request_id)
            self.engine.cancel(request_id)
            return pb.CancelResponse(cancelled=live)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        with self._observed("Tokenize", context):
            engine = await self._engine(context)
            tokenizer = engine.tokenizer
            try:  # Generate's guard: text that cannot fit the context is refused unencoded
                ids = convert.tokenize_token_ids(request, self.prompts(engine))
            except ValidationError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            tokens = [tokenizer.id_to_token(i) or "" for i in ids]
            response = pb.TokenizeResponse(token_ids=ids, tokens=tokens)
            await self._check_size(response, context, "send shorter text")
            return response

    async def _check_size(self, response, context, advice: str) -> None:
        """RESOURCE_EXHAUSTED naming the response when it is over max_message_bytes: else
        gRPC fails the send itself, after all the work, and logs a traceback."""
        if (size := response.ByteSize()) > self.max_message_bytes:
            message = (
                f"response: {size} bytes, over max_message_bytes ({self.max_message_bytes}); "
                + advice
            )
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        with self._observed("GetModelInfo", context):
            return self._model_info(await self._engine(context))

    def _model_info(self, engine: AsyncEngine) -> pb.ModelInfo:
        info = engine.info
        return pb.ModelInfo(
            name=self.model_name,
            architecture=info.architecture,
            max_context_length=info.max_model_len,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            kv_block_size=info.kv_block_size,
            kv_num_blocks=info.kv_num_blocks,
            kv_capacity_tokens=info.kv_capacity_tokens,
            has_chat_template=engine.tokenizer.has_chat_template,
        )

    async def _submit(
        self, engine: AsyncEngine, request: pb.GenerateRequest, context, door: str
    ) -> tuple[RequestOutputBuilder, RequestStream, ToolCallReader]:
        """Validate, tokenize and queue; aborts the RPC with the right status on failure.
        Returns the answer to gather, under the caller's request id, the stream, which
        carries the engine's (engine_request_id), and the reader of its tool calls.
        The moment the RPC ends, however it ends (the client cancels, its deadline passes,
        its channel or process goes), the engine request is cancelled unless it finished:
        a unary call writes nothing until its end, so no failed write would tell."""
        request_id = request.request_id or uuid.uuid4().hex  # 122 random bits: unguessable
        engine_id = engine_request_id(caller_scope(context), request_id)
        try:
            check_request_id(request_id)
            self.check_model(request.model)
            tools = convert.tool_use(request, self.tool_parser(engine))
            params = convert.sampling_params(request, tools)
            token_ids = convert.prompt_token_ids(request, self.prompts(engine), tools)
            stream = await engine.submit(engine_id, token_ids, params, request.priority, door)
        except DuplicateRequest:  # the caller's own request with this id is running
            message = f"request_id: {request_id!r} is already running; cancel it or pick another"
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, message)
        except ValidationError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineOverloaded as exc:
            context.set_trailing_metadata((("retry-after-ms", RETRY_AFTER_MS),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except UnknownModel as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        context.add_done_callback(lambda _: stream.cancel())
        self.log_prompts(engine_id, [token_ids])
        output = RequestOutputBuilder.start(request_id, token_ids, params.n)
        return output, stream, ToolCallReader(tools)


def engine_request_id(scope: str, request_id: str) -> str:
    """The engine's id for a caller's request id. Under mTLS each caller (client
    certificate) has its own ids: two callers may use the same one at once, and neither can
    cancel the other's. Without client certificates all callers are one principal: their ids
    are the engine's, so pick unguessable ones (or leave them to the server, uuid4)."""
    return f"{request_id}@{scope}" if scope else request_id


async def _abort_on_error(final: CandidateEvent, context) -> None:
    """A request the engine failed: INVALID_ARGUMENT where a field of it was at fault (a
    constraint whose grammar could not be followed), else INTERNAL, an engine fault; the
    engine serves on either way."""
    if final.finish_reason is FinishReason.ERROR:
        if final.error_field is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, final.error)
        await context.abort(grpc.StatusCode.INTERNAL, final.error or "engine error")


@dataclass
class Server:
    """A started gRPC server: liveness SERVING at once, readiness once a warm engine is set."""

    grpc_server: grpc.aio.Server
    health: health.aio.HealthServicer
    service: InferenceService
    port: int
    metrics_port: int | None  # the bound /metrics port, None when off
    http: HttpServer | None = None  # the REST shim, None when off
    watchdog: asyncio.Task | None = None  # watch_engine's task, None until started
    health_server: grpc.aio.Server | None = None  # plaintext, health only; None when off
    health_port: int | None = None

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    def where(self, config: ServerConfig) -> str:
        """Every address it listens on, by door: gRPC 127.0.0.1:50051 (plaintext), ..."""
        tls = config.tls
        security = "plaintext" if tls is None else "mTLS" if tls.mutual else "TLS"
        doors = [f"gRPC {config.host}:{self.port} ({security})"]
        if self.http is not None:
            doors.append(f"REST {config.http_bind_host}:{self.http.port}")
        if self.metrics_port is not None:
            doors.append(f"metrics {config.metrics_bind_host}:{self.metrics_port}")
        if self.health_port is not None:
            doors.append(f"health {config.host}:{self.health_port} (plaintext)")
        return ", ".join(doors)

    async def set_ready(self, engine: AsyncEngine, model_name: str) -> None:
        self.service.attach(engine, model_name)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)

    async def drain(self, grace_seconds: float) -> bool:
        """Readiness off and new generations refused at once (UNAVAILABLE), then wait for
        in-flight ones; True if they all finished within the grace period. Health and
        Cancel keep answering meanwhile."""
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        self.service.draining = True
        return await self.service.wait_idle(grace_seconds)

    def watch_engine(self, stall_seconds: float, every: float = WATCHDOG_SECONDS) -> asyncio.Task:
        """Start the watchdog over the attached engine: a task that ends, with the reason,
        once the engine loop is dead (serve() then exits for a restart), and is cancelled
        with the server (stop())."""
        self.watchdog = asyncio.ensure_future(
            self._watch(self.service.engine, stall_seconds, every)
        )
        return self.watchdog

    async def _watch(self, engine: AsyncEngine, stall_seconds: float, every: float) -> str:
        """Health tells the truth about the engine loop, looked at every `every` seconds:
        readiness and liveness NOT_SERVING while it is stuck (work waiting and no step
        finished for stall_seconds), SERVING again once it steps; so Kubernetes takes a
        stuck pod out of its Service at once and restarts it once the stall outlasts the
        liveness probe's failures, and a loop that recovers serves on. Returns why once
        the loop is dead: nothing can bring it back."""
        stuck: str | None = None
        while engine.is_alive:
            stalled = engine.stalled_seconds
            if stuck is None and stalled > stall_seconds:
                stuck = (
                    f"engine loop is stuck: work waiting and no step finished for {stalled:.1f} s"
                )
                log.error("%s; readiness and liveness NOT_SERVING", stuck)
                self.service.fault = stuck  # REST /health says so too
                await self._set_health(readiness=False, liveness=False)
            elif stuck is not None and stalled <= stall_seconds:
                log.warning("engine loop steps again; readiness and liveness SERVING")
                stuck = self.service.fault = None
                await self._set_health(readiness=not self.service.draining, liveness=True)
            await asyncio.sleep(every)
        dead = f"engine loop is dead: {engine.fatal_error or 'it exited'}"
        self.service.fault = dead
        await self._set_health(readiness=False, liveness=False)
        return dead

    async def _set_health(self, readiness: bool, liveness: bool) -> None:
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        await self.health.set(SERVICE_NAME, serving if readiness else not_serving)
        await self.health.set("", serving if liveness else not_serving)

    async def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.http is not None:
            await self.http.stop()
        await self.grpc_server.stop(None)
        if self.health_server is not None:
            await self.health_server.stop(None)
        await asyncio.to_thread(self.service.tracer.shutdown)  # flushes queued spans
        await asyncio.to_thread(self.service.metrics.stop_http_server)


async def start_server(config: ServerConfig) -> Server:
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # A client that vanishes without closing its connection (its host gone, a network
        # cut) stops answering pings: its calls end then, and with them their requests.
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
        ("grpc.server.max_pending_requests", UNBOUNDED_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", UNBOUNDED_PENDING_CALLS),
    ]
    service = InferenceService(configure_tracing(config.trace_exporter, config.otlp_endpoint))
    interceptors = []
    if config.api_key is not None:
        interceptors.append(ApiKeyInterceptor(config.api_key, service.metrics))
    interceptors.append(ParseInterceptor(service.metrics))  # innermost: a refused key never parses
    grpc_server = grpc.aio.server(options=options, interceptors=interceptors)
    service.log_requests = config.log_requests
    service.tool_parser_setting = config.tool_parser
    service.max_message_bytes = config.max_message_bytes
    # Whatever log_level says: asking for them means showing them.
    request_log.setLevel(logging.INFO if config.log_requests else logging.NOTSET)
    # Up before the model loads, so a scrape during a slow start still answers.
    metrics_port = None
    if config.metrics_port is not None:
        metrics_port = service.metrics.start_http_server(
            config.metrics_bind_host, config.metrics_port
        )
    inference_pb2_grpc.add_InferenceServicer_to_server(service, grpc_server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, grpc_server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), grpc_server
    )
    address = f"{config.host}:{config.grpc_port}"
    if config.tls is not None:
        port = grpc_server.add_secure_port(address, server_credentials(config.tls))
    else:
        port = grpc_server.add_insecure_port(address)
    await grpc_server.start()
    health_server = health_port = None
    if config.health_port is not None:  # the same servicer: one status, two doors
        health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
        health_port = health_server.add_insecure_port(f"{config.host}:{config.health_port}")
        await health_server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await health_servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    http = None
    if config.http_port is not None:
        from service.http_api import start_http  # fastapi is imported only when REST is on

        http = await start_http(
            service,
            config.http_bind_host,
            config.http_port,
            config.api_key,
            tls=config.tls,
            max_body_bytes=config.max_message_bytes,  # one size limit for both doors
            read_timeout=config.http_read_timeout,
        )
    return Server(
        grpc_server,
        health_servicer,
        service,
        port,
        metrics_port,
        http,
        health_server=health_server,
        health_port=health_port,
    )


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """TLS from PEM files; with a client CA, client certificates are required and must
    chain to it (the handshake fails without one)."""
    return grpc.ssl_server_credentials(
        [(read_pem(tls.key_file), read_pem(tls.cert_file))],
        root_certificates=read_pem(tls.client_ca_file) if tls.mutual else None,
        require_client_auth=tls.mutual,
    )


def load_engine(engine_config: EngineConfig, config: ServerConfig) -> AsyncEngine:
    in_process = config.engine_process
    if in_process is None:
        in_process = engine_config.torch_device.type == "cuda"
    core = EngineProcess(engine_config) if in_process else EngineThread(LLMEngine(engine_config))
    engine = AsyncEngine(core, config.max_queued_requests, config.mailbox_size)
    engine.start()
    return engine


async def run_on_own_thread(fn, *args):
    """fn(*args) on a fresh thread that ends with it. torch gives each thread that runs ops
    its own OpenMP pool; one left behind on an idle executor thread makes libgomp see more
    threads than cores and stop spin-waiting, which slows every CPU engine step by ~25%
    (measured: benchmarks/RESULTS.md, "Serving over gRPC vs the offline engine")."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:
            loop.call_soon_threadsafe(done.set_exception, exc)
        else:
            loop.call_soon_threadsafe(done.set_result, result)

    threading.Thread(target=target, name="model-load", daemon=True).start()
    return await done


def warm_up(engine: AsyncEngine) -> None:
    """The front door's own first-call costs: a request's sampling, stopping and output
    options converted as a call's are, and a chat prompt encoded as one is (the chat
    template compiled, the tokenizer's first encode). Nothing is submitted: the engine
    warmed itself up (engine/core/warmup.py) before it reported ready, and metrics count only
    real traffic."""
    tokenizer = engine.tokenizer
    request = pb.GenerateRequest(
        sampling=pb.SamplingOptions(n=2, temperature=0.8, top_p=0.9, seed=0),
        stopping=pb.StoppingOptions(max_tokens=2, stop=["\n"]),
        output=pb.OutputOptions(logprobs=1, prompt_logprobs=1),
    )
    prompts = PromptEncoder.for_engine(tokenizer, engine.info)
    try:
        convert.sampling_params(request)
        # Not held to the context (PromptEncoder.check): a server's may be tinier than this.
        if tokenizer.has_chat_template:
            ids = prompts.tokenize(messages=[{"role": "user", "content": "Hello"}])
        else:
            ids = prompts.tokenize("Hello")
        tokenizer.decode(ids)
    except ValidationError as exc:
        raise ModelLoadError(f"warm-up request failed: {exc}") from exc


async def serve(engine_config: EngineConfig, config: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT, then drain: readiness off, new work refused, in-flight
    requests finish within config.drain_seconds; returns 0. A dead engine loop ends it too:
    its requests in flight have failed, and it returns 1, so the process exits for a
    restart rather than stay up with nothing to serve. However it ends (a model that does
    not load raises), the server and the engine are stopped first."""
    # The process's age now plus the monotonic time from here: its start, for time to ready.
    started = time.monotonic() - (process_age() or 0.0)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await start_server(config)
    engine: AsyncEngine | None = None
    try:
        log.info("listening on %s; loading the model", server.where(config))
        # Off the loop, so health checks are answered (NOT_SERVING) while the model loads,
        # its KV pool is sized, its graphs are captured and its warm-up runs (engine/core/warmup.py).
        engine = await run_on_own_thread(load_engine, engine_config, config)
        warm_up(engine)
        model_name = Path(engine.info.model_path).name
        await server.set_ready(engine, model_name)
        ready_seconds = time.monotonic() - started
        server.service.metrics.time_to_ready.set(ready_seconds)
        watchdog = server.watch_engine(config.engine_stall_seconds)
        log.info("start-up: %s", engine.info.startup.describe())
        if logging.getLogger().getEffectiveLevel() <= logging.WARNING:  # not when only errors
            ready_log.setLevel(logging.INFO)
        where = server.where(config)
        ready_log.info("serving %s on %s; ready in %.2f s", model_name, where, ready_seconds)
        return await _until_stopped(server, stop, watchdog, config.drain_seconds)
    finally:
        await server.stop()
        if engine is not None:
            engine.shutdown(timeout=5)


async def _until_stopped(
    server: Server, stop: asyncio.Event, watchdog: asyncio.Task, drain_seconds: float
) -> int:
    """Wait for a signal (stop) or the engine's death (the watchdog's end), then drain;
    the process's exit status."""
    signalled = asyncio.ensure_future(stop.wait())
    await asyncio.wait((signalled, watchdog), return_when=asyncio.FIRST_COMPLETED)
    signalled.cancel()
    if watchdog.done():
        # The engine's death failed every request in flight (AsyncEngine._died); the drain
        # lets their handlers send those errors and refuses new work meanwhile.
        log.error("%s; exiting so that the process is restarted", watchdog.result())
        await server.drain(drain_seconds)
        return 1
    log.info("draining: up to %.0f s for in-flight requests", drain_seconds)
    if not await server.drain(drain_seconds):
        log.warning("drain grace period over; cancelling the requests still running")
    return 0
