"""The engine watchdog: a loop that is stuck (work waiting, no step finishing) or dead
(thread or child process gone) turns liveness and readiness NOT_SERVING over the real
gRPC health service, so Kubernetes restarts the pod; an idle or a slow loop never does."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.async_engine import AsyncEngine
from engine.config import engine_config_from_flat
from engine.engine_process import EngineProcess
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.server import SERVICE_NAME, ServerConfig, start_server
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

    async def wait_not_serving(self, timeout: float) -> float:
        """Seconds until both statuses are NOT_SERVING; fails after timeout."""
        start = time.monotonic()
        while await self.both() != (NOT_SERVING, NOT_SERVING):
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


async def test_a_stuck_loop_turns_liveness_and_readiness_not_serving(tiny_model):
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
                took = await health.wait_not_serving(timeout=5 * STALL_SECONDS)
                assert STALL_SECONDS / 3 < took < 3 * STALL_SECONDS
                assert srv.watchdog.done() and srv.watchdog.exception() is None
            finally:
                release.set()  # the step finishes; the request completes
            response = await asyncio.wait_for(stuck, 30)
            assert len(response.candidates[0].token_ids) == 3
            assert await health.both() == (NOT_SERVING, NOT_SERVING)  # for good
            async with httpx.AsyncClient() as http:  # the REST shim's /health agrees
                reply = await http.get(f"http://127.0.0.1:{srv.http_port}/health")
            assert reply.status_code == 503 and "stuck" in reply.json()["error"]["message"]
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
            assert await health.wait_not_serving(timeout=5) < 5
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(pb.GenerateRequest(text="after", **greedy(2)))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await srv.stop()
        engine.shutdown(timeout=5)
    assert srv.watchdog.done()
