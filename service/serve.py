"""The server's lifecycle: start the doors (gRPC, and REST and /metrics when configured)
on one front door, load the engine off the event loop, report ready, watch the engine,
and on SIGTERM drain and stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.errors import ModelLoadError, ValidationError
from engine.model_hub import served_name
from engine.serving.async_engine import AsyncEngine, EngineThread
from engine.serving.engine_process import EngineProcess
from engine.text.prompts import PromptEncoder
from pagedserve.v1 import inference_pb2 as pb
from service.config import ServerConfig
from service.convert import sampling_params
from service.front_door import FrontDoor, request_log
from service.grpc import messages
from service.grpc.server import GrpcServer, start_grpc
from service.metrics import process_age
from service.tracing import configure_tracing

if TYPE_CHECKING:
    from service.rest.server import HttpServer

log = logging.getLogger(__name__)
# The one line that says the server is up: where it listens, what it serves, how fast it
# got there. Shown at the default log level (WARNING) without turning every INFO log on.
ready_log = logging.getLogger("pagedserve")
WATCHDOG_SECONDS = 1.0  # how often the watchdog looks at the engine


@dataclass
class Server:
    """The started doors over one front door: liveness SERVING at once, readiness once a
    warm engine is attached (set_ready)."""

    door: FrontDoor
    grpc: GrpcServer
    metrics_port: int | None  # the bound /metrics port, None when off
    http: HttpServer | None = None  # the REST door, None when off
    watchdog: asyncio.Task | None = None  # watch_engine's task, None until started

    @property
    def port(self) -> int:
        return self.grpc.port

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    @property
    def health_port(self) -> int | None:
        return self.grpc.health_port

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
        self.door.attach(engine, model_name)
        await self.grpc.set_health(readiness=True)

    async def drain(self, grace_seconds: float) -> bool:
        """Readiness off and new generations refused at once (UNAVAILABLE), then wait for
        in-flight ones; True if they all finished within the grace period. Health and
        Cancel keep answering meanwhile."""
        await self.grpc.set_health(readiness=False)
        self.door.draining = True
        return await self.door.wait_idle(grace_seconds)

    def watch_engine(self, stall_seconds: float, every: float = WATCHDOG_SECONDS) -> asyncio.Task:
        """Start the watchdog over the attached engine: a task that ends, with the reason,
        once the engine loop is dead (serve() then exits for a restart), and is cancelled
        with the server (stop())."""
        self.watchdog = asyncio.ensure_future(self._watch(self.door.engine, stall_seconds, every))
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
                self.door.fault = stuck  # REST /health says so too
                await self.grpc.set_health(readiness=False, liveness=False)
            elif stuck is not None and stalled <= stall_seconds:
                log.warning("engine loop steps again; readiness and liveness SERVING")
                stuck = self.door.fault = None
                await self.grpc.set_health(readiness=not self.door.draining, liveness=True)
            await asyncio.sleep(every)
        dead = f"engine loop is dead: {engine.fatal_error or 'it exited'}"
        self.door.fault = dead
        await self.grpc.set_health(readiness=False, liveness=False)
        return dead

    async def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.http is not None:
            await self.http.stop()
        await self.grpc.stop()
        await asyncio.to_thread(self.grpc.service.tracer.shutdown)  # flushes queued spans
        await asyncio.to_thread(self.door.metrics.stop_http_server)
        await asyncio.to_thread(self.door.kv_events.close)


async def start_server(config: ServerConfig) -> Server:
    """Start every configured door (REST's fastapi is imported only when it is on)."""
    door = FrontDoor(
        config.log_requests,
        config.tool_parser,
        config.max_message_bytes,
        config.kv_events_endpoint,
    )
    # Whatever log_level says: asking for them means showing them.
    request_log.setLevel(logging.INFO if config.log_requests else logging.NOTSET)
    # Up before the model loads, so a scrape during a slow start still answers.
    metrics_port = None
    if config.metrics_port is not None:
        metrics_port = door.metrics.start_http_server(config.metrics_bind_host, config.metrics_port)
    tracer = configure_tracing(config.trace_exporter, config.otlp_endpoint)
    server = Server(door, await start_grpc(config, door, tracer), metrics_port)
    if config.http_port is not None:
        from service.rest.server import start_http

        server.http = await start_http(door, config)
    return server


def load_engine(engine_config: EngineConfig, config: ServerConfig) -> AsyncEngine:
    own_process = config.engine_process
    if own_process is None:
        own_process = engine_config.torch_device.type == "cuda"
    core = EngineProcess(engine_config) if own_process else EngineThread(LLMEngine(engine_config))
    engine = AsyncEngine(core, config.max_queued_requests, config.mailbox_size)
    engine.start()
    return engine


async def run_on_own_thread(fn, *args):
    """fn(*args) on a fresh thread that ends with it. torch gives each thread that runs ops
    its own OpenMP pool; one left behind on an idle executor thread makes libgomp see more
    threads than cores and stop spin-waiting, which slows every CPU engine step by ~25%
    (measured: benchmarks/RESULTS.md as of 9361dce, "Serving over gRPC vs the offline engine on
    the CPU")."""
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


def warm_up_doors(engine: AsyncEngine) -> None:
    """The doors' own first-call costs: a request's sampling, stopping and output
    options converted as a call's are, and a chat prompt encoded as one is (the chat
    template compiled, the tokenizer's first encode). Nothing is submitted: the engine
    warmed itself up (engine/core/warmup.py) before it reported ready, and metrics count only
    real traffic."""
    tokenizer = engine.tokenizer
    request = pb.GenerateRequest(
        text="Hello",
        sampling=pb.SamplingOptions(n=2, temperature=0.8, top_p=0.9, seed=0),
        stopping=pb.StoppingOptions(max_tokens=2, stop=["\n"]),
        output=pb.OutputOptions(logprobs=1, prompt_logprobs=1),
    )
    prompts = PromptEncoder.for_engine(tokenizer, engine.info)
    try:
        sampling_params(messages.generation_request(request))
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
        warm_up_doors(engine)
        model_name = served_name(engine.info.model_path)
        topic = config.kv_events_topic or f"kv@{socket.gethostname()}@{model_name}"
        server.door.kv_events.topic = topic
        await server.set_ready(engine, model_name)
        ready_seconds = time.monotonic() - started
        server.door.metrics.time_to_ready.set(ready_seconds)
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
