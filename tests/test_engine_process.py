"""EngineProcess: the engine loop in a spawned child, behind the same AsyncEngine as the
thread, and the gRPC server over it (engine_process = true)."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from engine.config import engine_config_from_flat
from engine.errors import ModelLoadError, ValidationError
from engine.llm import LLM
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from engine.serving.async_engine import AsyncEngine, EngineStopped
from engine.serving.engine_process import EngineProcess
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.config import ServerConfig
from service.serve import load_engine, start_server
from tests.test_grpc_server import kv_back_to_zero
from tests.tiny_models import write_tiny_model

SETTINGS = dict(num_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("process-tiny"), "qwen3")


def start_engine(model, **settings) -> AsyncEngine:
    config = engine_config_from_flat(model=str(model), **{**SETTINGS, **settings})
    engine = AsyncEngine(EngineProcess(config), max_queued_requests=16)
    engine.start()
    return engine


@pytest.fixture(scope="module")
def process_engine(tiny_model):
    engine = start_engine(tiny_model)
    yield engine
    engine.shutdown(timeout=10)
    assert not engine.core.is_alive()


async def test_greedy_streams_equal_the_offline_engine(process_engine, tiny_model):
    params = SamplingParams(n=2, max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[3, 4, 5, 6][: i + 1] for i in range(4)]

    async def run(i: int, prompt: list[int]) -> dict[int, list[int]]:
        tokens: dict[int, list[int]] = {0: [], 1: []}
        async for event in await process_engine.submit(f"g{i}", prompt, params):
            tokens[event.index] += event.token_ids
            if event.finished:
                assert event.finish_reason is FinishReason.LENGTH
        return tokens

    got = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)))
    offline = LLM(str(tiny_model), **SETTINGS).generate(prompts, params)
    for tokens, want in zip(got, offline, strict=True):
        assert tokens == {c.index: c.token_ids for c in want.outputs}
    await kv_back_to_zero(process_engine)
    assert process_engine.stats.num_generated_tokens >= 4 * 2 * 10


async def test_a_refused_request_raises_its_validation_error_across_the_process(process_engine):
    with pytest.raises(ValidationError) as err:
        await process_engine.submit("bad", [1, 2], SamplingParams(top_p=0.0))
    assert err.value.field == "top_p" and "top_p" in str(err.value)
    assert process_engine.num_queued == 0  # the refused submit left nothing counted


async def test_cancel_ends_the_stream_and_frees_its_blocks(process_engine):
    params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
    stream = await process_engine.submit("long", [7, 8, 9], params)
    assert process_engine.is_running("long")
    last = None
    async for event in stream:
        last = event
        if not event.finished:
            process_engine.cancel("long")
    assert last.finish_reason is FinishReason.CANCELLED
    assert not process_engine.is_running("long")
    await kv_back_to_zero(process_engine)


async def test_a_dead_engine_process_fails_open_streams_and_refuses_new_work(tiny_model):
    engine = start_engine(tiny_model)
    try:
        params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
        stream = await engine.submit("victim", [1, 2, 3], params)
        events = aiter(stream)
        await anext(events)  # running
        os.kill(engine.core.pid, signal.SIGKILL)
        rest = [event async for event in events]
        assert rest[-1].finish_reason is FinishReason.ERROR
        assert "engine process died" in rest[-1].error
        assert not engine.is_alive
        with pytest.raises(EngineStopped, match="engine process died"):
            await engine.submit("after", [1], params)
    finally:
        engine.shutdown(timeout=5)


def test_a_model_that_cannot_load_fails_start_with_the_childs_error(tmp_path):
    config = engine_config_from_flat(model=str(tmp_path / "no-such-model"), **SETTINGS)
    core = EngineProcess(config)
    with pytest.raises(ModelLoadError, match="no-such-model"):
        AsyncEngine(core).start()
    assert not core.is_alive()


async def test_grpc_server_over_the_engine_process(tiny_model):
    config = ServerConfig(grpc_port=0, engine_process=True)
    engine = await asyncio.to_thread(
        load_engine, engine_config_from_flat(model=str(tiny_model), **SETTINGS), config
    )
    assert isinstance(engine.core, EngineProcess)
    server = await start_server(config)
    await server.set_ready(engine, "tiny")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5, 6, 7]),
                sampling=pb.SamplingOptions(temperature=0.0),
                stopping=pb.StoppingOptions(max_tokens=8, ignore_eos=True),
            )
            unary = await stub.Generate(request)
            streamed = [t async for m in stub.StreamGenerate(request) for t in m.token_ids]
            offline = LLM(str(tiny_model), **SETTINGS).generate(
                [[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            )[0]
            assert list(unary.candidates[0].token_ids) == streamed == offline.outputs[0].token_ids

            info = await stub.GetModelInfo(pb.GetModelInfoRequest())
            assert info.architecture == "Qwen3ForCausalLM" and info.kv_num_blocks == 64

            long = pb.GenerateRequest(
                request_id="c", text="abc", stopping=pb.StoppingOptions(max_tokens=240)
            )
            reasons = []
            async for message in stub.StreamGenerate(long):
                if not reasons:
                    reasons.append("started")
                    assert (await stub.Cancel(pb.CancelRequest(request_id="c"))).cancelled
                if message.finish_reason:
                    reasons.append(message.finish_reason)
            assert reasons[-1] == pb.FINISH_REASON_CANCELLED
        await kv_back_to_zero(engine)
    finally:
        await server.stop()
        engine.shutdown(timeout=10)
