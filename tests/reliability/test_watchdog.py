"""The engine watchdog: health tells the truth about the engine loop. A loop that is stuck
(work waiting, no step finishing) turns liveness and readiness NOT_SERVING over the real
gRPC health service, and SERVING again once it steps; an idle or a slow loop never turns
them. A dead loop (thread or child process gone) fails its requests and ends
`pagedserve serve` with a non-zero exit, so Kubernetes restarts it. Tried in process and
against a real `pagedserve serve --engine-process` whose engine is stopped (SIGSTOP),
resumed (SIGCONT) and killed (SIGKILL) from outside."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import httpx2 as httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import engine_config_from_flat
from engine.serving.async_engine import AsyncEngine
from engine.serving.engine_process import EngineProcess
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.config import ServerConfig
from service.grpc.handlers import SERVICE_NAME
from service.serve import WATCHDOG_SECONDS, start_server
from tests.server_process import ServerProcess, free_port, running_server
from tests.test_grpc_server import greedy, serving
from tests.tiny_models import write_tiny_model

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
STALL_SECONDS = 1.0
EVERY = 0.1  # the watchdog's period in these tests (1 s in production)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("watchdog-tiny"), "llama")


class Health:
    """Readiness (the service name) and liveness ("") as a probe sees them."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = health_pb2_grpc.HealthStub(channel)

    async def both(self) -> tuple[int, int]:
        statuses = []
        for name in (SERVICE_NAME, ""):
            answer = await self.stub.Check(health_pb2.HealthCheckRequest(service=name))
            statuses.append(answer.status)
        return statuses[0], statuses[1]

    async def wait_for(self, status: int, timeout: float) -> float:
        """Seconds until both statuses are `status`; fails after timeout."""
        start = time.monotonic()
        while await self.both() != (status, status):
            assert time.monotonic() - start < timeout, await self.both()
            await asyncio.sleep(0.05)
        return time.monotonic() - start


def patch_forward(core, before_step) -> None:
    """Run before_step() on the engine loop's thread ahead of every model step."""
    forward = core.runner.forward

    def patched(*args, **kwargs):
        before_step()
        return forward(*args, **kwargs)

    core.runner.forward = patched


async def test_a_stuck_loop_is_not_serving_until_it_steps_again(tiny_model):
    config = ServerConfig(grpc_port=0, http_port=0)
    async with serving(tiny_model, config) as (srv, core, engine):
        srv.watch_engine(STALL_SECONDS, every=EVERY)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            health = Health(channel)
            stub = inference_pb2_grpc.InferenceStub(channel)
            await asyncio.sleep(3 * STALL_SECONDS)  # idle for longer than the limit
            assert await health.both() == (SERVING, SERVING)

            release = threading.Event()
            patch_forward(core, lambda: release.wait(timeout=60))  # every step hangs
            stuck = asyncio.ensure_future(stub.Generate(pb.GenerateRequest(text="x", **greedy(3))))
            try:
                await asyncio.sleep(STALL_SECONDS / 3)
                assert await health.both() == (SERVING, SERVING)  # the clock began at submit
                took = await health.wait_for(NOT_SERVING, timeout=5 * STALL_SECONDS)
                assert STALL_SECONDS / 3 < took < 3 * STALL_SECONDS
                async with httpx.AsyncClient() as http:  # the REST shim's /health agrees
                    reply = await http.get(f"http://127.0.0.1:{srv.http_port}/health")
                assert reply.status_code == 503 and "stuck" in reply.json()["error"]["message"]
            finally:
                release.set()  # the step finishes; the request completes
            response = await asyncio.wait_for(stuck, 30)
            assert len(response.candidates[0].token_ids) == 3
            assert await health.wait_for(SERVING, timeout=10 * EVERY) < 10 * EVERY
            async with httpx.AsyncClient() as http:
                reply = await http.get(f"http://127.0.0.1:{srv.http_port}/health")
            assert reply.status_code == 200
            assert not srv.watchdog.done()
        assert core.block_manager.num_used_blocks == 0


async def test_a_slow_loop_that_keeps_stepping_is_not_stuck(tiny_model):
    """Each step takes half the stall limit; the request takes several limits in all."""
    async with serving(tiny_model) as (srv, core, _):
        srv.watch_engine(STALL_SECONDS, every=EVERY)
        patch_forward(core, lambda: time.sleep(STALL_SECONDS / 2))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            start = time.monotonic()
            stub = inference_pb2_grpc.InferenceStub(channel)
            response = await stub.Generate(pb.GenerateRequest(text="slow", **greedy(6)))
            assert len(response.candidates[0].token_ids) == 6
            assert time.monotonic() - start > 2.5 * STALL_SECONDS
            assert await Health(channel).both() == (SERVING, SERVING)
            assert not srv.watchdog.done()


async def test_a_killed_engine_process_fails_its_streams_and_health(tiny_model):
    config = engine_config_from_flat(model=str(tiny_model), num_blocks=256, block_size=4)
    engine = AsyncEngine(EngineProcess(config))
    await asyncio.to_thread(engine.start)
    srv = await start_server(ServerConfig(grpc_port=0))
    await srv.set_ready(engine, "tiny")
    srv.watch_engine(60.0, every=EVERY)  # a dead loop trips it at once, however long the limit
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            health = Health(channel)
            streams = [
                stub.StreamGenerate(pb.GenerateRequest(text=f"victim {i}", **greedy(240)))
                for i in range(3)
            ]
            for stream in streams:
                assert (await stream.read()).token_ids  # all three are running
            assert await health.both() == (SERVING, SERVING)
            os.kill(engine.core.pid, signal.SIGKILL)
            for stream in streams:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while await stream.read() is not grpc.aio.EOF:
                        pass
                assert err.value.code() == grpc.StatusCode.INTERNAL
                assert "engine process died" in err.value.details()
            assert await health.wait_for(NOT_SERVING, timeout=5) < 5
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(pb.GenerateRequest(text="after", **greedy(2)))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # The watchdog's task ends with the reason, which ends `serve` (see below).
            assert "engine process died" in await asyncio.wait_for(srv.watchdog, 5)
    finally:
        await srv.stop()
        engine.shutdown(timeout=5)


# ---- against `pagedserve serve --engine-process`, from outside ---------------------------

SERVER_ARGS = (
    "--engine-process", "--engine-stall-seconds", str(STALL_SECONDS), "--drain-seconds", "5",
    "--num-blocks", "512", "--block-size", "4",
)  # fmt: skip
LONG = 400  # tokens: a stream runs for a while, so it is still running when its engine stops


def engine_process(server: ServerProcess) -> psutil.Process:
    """The server's engine child (spawned by multiprocessing, beside its resource tracker)."""
    (child,) = [
        p
        for p in psutil.Process(server.proc.pid).children()
        if any("spawn_main" in part for part in p.cmdline())
    ]
    return child


def wait_for_health(server: ServerProcess, status: int, timeout: float) -> float:
    """Seconds until readiness and liveness both answer `status`; fails after timeout."""
    start = time.monotonic()
    while (server.health(), server.health("")) != (status, status):
        assert time.monotonic() - start < timeout, (server.health(), server.health(""))
        time.sleep(0.05)
    return time.monotonic() - start


def long_streams(channel: grpc.Channel, count: int) -> list:
    """count greedy streams of LONG tokens, each read until its first message (running)."""
    stub = inference_pb2_grpc.InferenceStub(channel)
    streams = [
        stub.StreamGenerate(pb.GenerateRequest(text=f"stream {i}", **greedy(LONG)))
        for i in range(count)
    ]
    return [(next(stream), stream) for stream in streams]


def test_a_stopped_engine_process_is_not_serving_until_it_resumes(tiny_model):
    """SIGSTOP the engine with streams running: readiness and liveness go NOT_SERVING once
    the stall passes engine_stall_seconds (REST /health 503 with the reason); SIGCONT: both
    SERVING again within two watchdog periods, and the streams finish every token."""
    http_port = free_port()
    with running_server(tiny_model, *SERVER_ARGS, "--http-port", str(http_port)) as server:
        engine = engine_process(server)
        with grpc.insecure_channel(server.target) as channel:
            streams = long_streams(channel, 3)
            engine.suspend()
            try:
                took = wait_for_health(server, NOT_SERVING, timeout=5 * STALL_SECONDS)
                assert took < 3 * STALL_SECONDS
                reply = httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=5)
                assert reply.status_code == 503 and "stuck" in reply.json()["error"]["message"]
            finally:
                engine.resume()
            assert wait_for_health(server, SERVING, timeout=5) < 2 * WATCHDOG_SECONDS + 0.5
            assert httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=5).status_code == 200
            for first, stream in streams:
                rest = list(stream)
                assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == LONG
        assert server.proc.poll() is None  # it serves on
        assert "engine loop steps again" in server.stderr()


def test_a_killed_engine_process_fails_its_streams_and_ends_the_server(tiny_model):
    """SIGKILL the engine with streams running: each ends INTERNAL naming the engine's
    death, and `pagedserve serve` exits 1 (for Kubernetes to restart it), having logged
    why, within the watchdog's period plus the drain that lets those errors out."""
    with running_server(tiny_model, *SERVER_ARGS) as server:
        engine = engine_process(server)
        with grpc.insecure_channel(server.target) as channel:
            streams = long_streams(channel, 3)
            engine.kill()
            killed_at = time.monotonic()
            for _, stream in streams:
                with pytest.raises(grpc.RpcError) as err:
                    list(stream)
                assert err.value.code() == grpc.StatusCode.INTERNAL
                assert "engine process died" in err.value.details()
        assert server.proc.wait(timeout=15) == 1
        assert time.monotonic() - killed_at < 2 * WATCHDOG_SECONDS + 5
        log = server.stderr()
        assert "engine loop is dead: engine process died" in log and "exiting" in log, log
