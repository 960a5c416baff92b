"""EngineStats from a real engine thread, and ServerMetrics scraped over real HTTP."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.error
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.config import engine_config_from_flat
from engine.core.engine import LLMEngine
from engine.outputs import CandidateEvent
from engine.sampling_params import SamplingParams
from engine.serving.async_engine import AsyncEngine, EngineThread
from service.metrics import ServerMetrics, rpc_status
from tests.tiny_models import write_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("metrics-tiny"), "llama")


def start_engine(tiny_model, **cache) -> AsyncEngine:
    core = LLMEngine(engine_config_from_flat(model=str(tiny_model), block_size=4, **cache))
    engine = AsyncEngine(EngineThread(core))
    engine.start()
    return engine


async def run(
    engine: AsyncEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[CandidateEvent]:
    """All events of one request."""
    return [event async for event in await engine.submit(request_id, prompt, params)]


def scrape(port: int) -> dict[str, float]:
    """name{label=value,...} -> value, from a real HTTP GET of /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


async def stats_while_running(engine: AsyncEngine, request_id: str, prompt: list[int]):
    """The engine's stats as seen right after a request's first event, and once the engine
    has settled after the request is cancelled there. The request asks for 200 tokens, so
    it is still running when the consumer looks unless the consumer lags 200 steps behind
    the engine (a request of a few tokens could be over by then on a loaded machine)."""
    params = SamplingParams(max_tokens=200, **GREEDY)  # 203 of the pool's 256 tokens
    async for _ in await engine.submit(request_id, prompt, params):
        during = engine.stats  # published before the event: at least as new
        break  # leaving the loop cancels the request
    for _ in range(500):
        settled = engine.stats
        if settled.num_running_requests == 0 and settled.num_kv_blocks_used == 0:
            return during, settled
        await asyncio.sleep(0.01)
    raise AssertionError(f"the engine did not settle after the cancel: {settled}")


async def test_engine_stats_count_work_and_prefix_hits(tiny_model):
    engine = start_engine(tiny_model, num_blocks=64)
    try:
        assert engine.stats.num_generated_tokens == 0 and engine.stats.num_kv_blocks_total == 64
        during, base = await stats_while_running(engine, "hold", [50, 51, 52])
        assert during.num_kv_blocks_used > 0 and during.kv_cache_usage > 0
        assert (during.num_running_requests, during.num_waiting_requests) == (1, 0)
        assert base.num_generated_tokens > 0 and base.prefix_cache_queried_tokens == 3

        prompt = list(range(1, 10))  # 9 tokens: two full blocks of 4, then the last token
        params = SamplingParams(n=2, max_tokens=6, **GREEDY)
        events = await run(engine, "a", prompt, params)
        after = engine.stats
        produced = sum(len(e.token_ids) for e in events)
        assert after.num_generated_tokens - base.num_generated_tokens == produced == 12
        # The n=2 candidates share the prefill: the second starts from the first's two
        # full blocks in the prefix cache (its query: 9 tokens, 8 hit) and computes only
        # the last token.
        assert after.num_prompt_tokens_computed - base.num_prompt_tokens_computed == 9 + 1
        assert after.num_kv_blocks_used == 0 and after.num_running_requests == 0
        assert after.num_steps - base.num_steps >= 6 and after.num_preemptions == 0
        assert after.prefix_cache_queried_tokens - base.prefix_cache_queried_tokens == 9 + 9
        assert after.prefix_cache_hit_tokens - base.prefix_cache_hit_tokens == 8
        assert base.prefix_cache_hit_tokens == 0

        await run(engine, "b", prompt, SamplingParams(max_tokens=2, **GREEDY))
        again = engine.stats
        # The two full prompt blocks are reused; the last prompt token is always computed.
        assert again.prefix_cache_hit_tokens - after.prefix_cache_hit_tokens == 8
        assert again.num_prompt_tokens_computed - after.num_prompt_tokens_computed == 1
        assert again.prefix_cache_hit_rate == pytest.approx((8 + 8) / (3 + 9 + 9 + 9))
        assert again.num_generated_tokens - after.num_generated_tokens == 2
    finally:
        engine.shutdown(timeout=5)


async def test_preemptions_counted_under_a_tiny_kv_pool(tiny_model):
    engine = start_engine(tiny_model, num_blocks=8)  # 32 tokens; four requests need 80
    try:
        params = SamplingParams(max_tokens=16, **GREEDY)
        prompts = [[i, i + 1, i + 2, i + 3] for i in range(1, 41, 10)]
        results = await asyncio.gather(
            *(run(engine, f"p{i}", p, params) for i, p in enumerate(prompts))
        )
        stats = engine.stats
        assert stats.num_preemptions > 0
        produced = sum(len(e.token_ids) for events in results for e in events)
        assert stats.num_generated_tokens == produced == 64  # recompute samples nothing twice
        assert stats.num_prompt_tokens_computed >= 16
        assert stats.num_kv_blocks_used == 0 and stats.num_waiting_requests == 0
    finally:
        engine.shutdown(timeout=5)


async def test_metrics_scraped_over_http(tiny_model):
    attached: list[AsyncEngine] = []  # the server starts before the engine exists
    metrics = ServerMetrics(lambda: attached[0].stats if attached else None)
    port = metrics.start_http_server("127.0.0.1", 0)
    engine = start_engine(tiny_model, num_blocks=64)
    try:
        assert port > 0
        before = scrape(port)
        assert "pagedserve_kv_cache_blocks_total" not in before
        assert before["pagedserve_e2e_request_latency_seconds_count"] == 0

        attached.append(engine)
        events = await run(engine, "m", [5, 6, 7], SamplingParams(n=2, max_tokens=6, **GREEDY))
        metrics.request_finished([e for e in events if e.finished])
        metrics.rpc_finished("Generate", grpc.StatusCode.OK)
        metrics.rpc_finished("Generate", grpc.StatusCode.INVALID_ARGUMENT)
        metrics.rpc_finished("Generate", grpc.StatusCode.INVALID_ARGUMENT)
        s = scrape(port)
    finally:
        metrics.stop_http_server()
        engine.shutdown(timeout=5)

    assert s["pagedserve_requests_total{code=OK,rpc=Generate}"] == 1
    assert s["pagedserve_requests_total{code=INVALID_ARGUMENT,rpc=Generate}"] == 2
    for name in (
        "time_to_first_token",
        "time_per_output_token",
        "e2e_request_latency",
        "queue_time",
    ):
        assert s[f"pagedserve_{name}_seconds_count"] == 1, name
    queue, ttft = (
        s["pagedserve_queue_time_seconds_sum"],
        s["pagedserve_time_to_first_token_seconds_sum"],
    )
    e2e, tpot = (
        s["pagedserve_e2e_request_latency_seconds_sum"],
        s["pagedserve_time_per_output_token_seconds_sum"],
    )
    assert 0 <= queue <= ttft < e2e
    assert tpot * 5 == pytest.approx(e2e - ttft)  # 6 tokens a candidate: 5 after the first
    assert s["pagedserve_generation_tokens_total"] == 12
    # 3 prompt tokens, less than a block: the second candidate computes them again
    assert s["pagedserve_prompt_tokens_total"] == 3 + 3
    assert s["pagedserve_kv_cache_blocks_total"] == 64
    assert s["pagedserve_kv_cache_blocks_used"] == 0 and s["pagedserve_kv_cache_usage_ratio"] == 0
    assert s["pagedserve_num_requests_running"] == s["pagedserve_num_requests_waiting"] == 0
    assert s["pagedserve_engine_steps_total"] >= 6
    assert s["pagedserve_preemptions_total"] == 0
    with pytest.raises(urllib.error.URLError):
        scrape(port)  # stopped: nothing listens any more


async def test_rpc_status_of_real_grpc_endings():
    """OK, an abort's code, the deadline and a client cancel, as a grpc.aio handler sees them."""
    codes: list[grpc.StatusCode] = []

    async def handler(request: bytes, context) -> bytes:
        error = None
        try:
            if request == b"abort":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad")
            if request == b"wait":
                await asyncio.sleep(10)
            return b"ok"
        except BaseException as exc:
            error = exc
            raise
        finally:
            codes.append(rpc_status(context, error))

    server = grpc.aio.server()
    methods = {"Run": grpc.unary_unary_rpc_method_handler(handler)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary("/t.Echo/Run")
    try:
        assert await call(b"hi") == b"ok"
        with pytest.raises(grpc.aio.AioRpcError):
            await call(b"abort")
        with pytest.raises(grpc.aio.AioRpcError):
            await call(b"wait", timeout=0.2)
        pending = call(b"wait")
        await asyncio.sleep(0.2)
        pending.cancel()
        for _ in range(100):
            if len(codes) == 4:
                break
            await asyncio.sleep(0.01)
    finally:
        await channel.close()
        await server.stop(0)
    assert codes == [
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    ]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_age_never_reaches_back_before_the_process_was_started():
    """Time to ready counts from process_age(): the start it implies is never earlier than
    the moment the process was spawned (the kernel's clocks are coarse: 10 ms)."""
    probe = "import time; from service.metrics import process_age; print(process_age(), time.monotonic())"
    for _ in range(5):
        spawned = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True
        )
        age, now = map(float, out.stdout.split())
        assert now - age >= spawned
