"""KV oversubscription: far more concurrent requests than the KV pool holds, with long
outputs, through a real gRPC server on loopback. The scheduler preempts (by recompute) over
and over; every request still finishes with the greedy tokens a run without pressure
produces, the preemptions show in the Prometheus metrics, and requests cancelled while
preempted (or while being recomputed) leave no KV block behind."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.config import ServerConfig
from tests.reliability.test_abort_storm import consume, phase
from tests.server_process import scrape_metrics
from tests.test_grpc_server import greedy, kv_back_to_zero, serving
from tests.tiny_models import write_tiny_model

NUM_REQUESTS = 24
# 24 blocks of 4 tokens: the pool holds 96 tokens, one request at its full length (up to 90),
# while 24 requests want ~1,800 at once; 16 may run, so they keep pushing each other out.
SETTINGS = dict(num_blocks=24, block_size=4, max_num_seqs=16, max_num_batched_tokens=32)
ROOMY = dict(SETTINGS, num_blocks=1024)  # the same engine with no pressure at all


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("kv-pressure-tiny"), "llama")


def workload(seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request: 6-26 prompt tokens, 40-64 output tokens."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, 300) for _ in range(rng.randint(6, 26))], rng.randint(40, 64))
        for _ in range(NUM_REQUESTS)
    ]


def unpressured(model, work: list[tuple[list[int], int]]) -> list[list[int]]:
    """Greedy token ids of each request from an offline engine with room for them all."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in work]
    outputs = LLM(str(model), **ROOMY).generate([ids for ids, _ in work], params)
    return [o.outputs[0].token_ids for o in outputs]


def request(i: int, ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=f"kv-{i}", token_ids=pb.TokenIds(ids=ids), **greedy(max_tokens)
    )


@pytest.fixture
def metered():
    """A server config with a Prometheus endpoint on a free loopback port."""
    return ServerConfig(grpc_port=0, metrics_host="127.0.0.1", metrics_port=0)


async def test_oversubscribed_kv_preempts_and_every_request_finishes_unchanged(tiny_model, metered):
    work = workload(seed=11)
    async with serving(tiny_model, metered, **SETTINGS) as (srv, core, engine):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            results = await asyncio.gather(
                *(consume(stub.StreamGenerate(request(i, *w))) for i, w in enumerate(work))
            )
        await kv_back_to_zero(engine)
        url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
        metrics = await asyncio.to_thread(scrape_metrics, url)
        assert core.block_manager.num_used_blocks == 0 and not core.requests
    preemptions = metrics["pagedserve_preemptions_total"]
    print(f"\n{NUM_REQUESTS} requests over a {SETTINGS['num_blocks']}-block pool: "
          f"{preemptions:.0f} preemptions")  # fmt: skip
    assert preemptions >= NUM_REQUESTS  # pressure indeed: each request pushed out once or more
    assert metrics['pagedserve_requests_total{code="OK",rpc="StreamGenerate"}'] == NUM_REQUESTS
    assert metrics["pagedserve_kv_cache_blocks_used"] == 0
    expected = unpressured(tiny_model, work)
    for i, (messages, error) in enumerate(results):
        assert error is None, (i, error)
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH, i
        assert [t for m in messages for t in m.token_ids] == expected[i], i


async def cancel_when_preempted(stub, core, i: int, ids: list[int], max_tokens: int):
    """Stream a request; the odd ones are cancelled (Cancel RPC or the client leaving, in
    turn) as soon as the engine has preempted them, or (every other one of those) once it
    recomputes them. Returns (door, phase at the cancel or "finished", the stream's
    messages and error)."""
    call = stub.StreamGenerate(request(i, ids, max_tokens), timeout=120)
    reading = asyncio.ensure_future(consume(call))
    door = ("none", "cancel_rpc", "none", "client_cancel")[i % 4]
    targets = ("recompute",) if i % 8 >= 4 else ("preempted", "recompute")
    when = "finished"
    if door != "none":
        while not reading.done() and phase(core, f"kv-{i}") not in targets:
            await asyncio.sleep(0.001)
        if not reading.done():
            when = phase(core, f"kv-{i}")
            if door == "cancel_rpc":
                await stub.Cancel(pb.CancelRequest(request_id=f"kv-{i}"))
            else:
                call.cancel()
    return door, when, *(await reading)


async def test_requests_cancelled_while_preempted_leave_no_blocks(tiny_model):
    work = workload(seed=12)
    async with serving(tiny_model, **SETTINGS) as (srv, core, engine):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            results = await asyncio.gather(
                *(cancel_when_preempted(stub, core, i, *w) for i, w in enumerate(work))
            )
            await kv_back_to_zero(engine)
            assert engine.stats.num_waiting_requests == 0 and not engine.has_work
            assert core.block_manager.num_used_blocks == 0 and not core.requests
            preemptions = engine.stats.num_preemptions
    whens = [when for door, when, _, _ in results if door != "none"]
    print(f"\ncancelled at: {sorted(whens)}; {preemptions} preemptions in all")
    assert whens.count("preempted") >= 3 and len(whens) - whens.count("finished") >= 8, whens
    expected = unpressured(tiny_model, work)
    for i, (door, when, messages, error) in enumerate(results):
        if when == "finished":  # left alone, or never preempted before it finished
            assert error is None and messages[-1].finish_reason == pb.FINISH_REASON_LENGTH, i
            assert [t for m in messages for t in m.token_ids] == expected[i], i
        elif door == "cancel_rpc":
            assert error is None and messages[-1].finish_reason == pb.FINISH_REASON_CANCELLED
        else:
            assert isinstance(error, asyncio.CancelledError), (i, error)
