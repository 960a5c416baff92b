"""AsyncEngine: the engine thread driven from asyncio (submit, stream, cancel, overload)."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.config import engine_config_from_flat
from engine.core.engine import LLMEngine
from engine.errors import EngineOverloaded, ValidationError
from engine.outputs import CandidateEvent, FinishReason, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.serving.async_engine import AsyncEngine, EngineThread
from engine.serving.request_stream import RequestStream, StreamOverflow
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen3")
    return LLMEngine(engine_config_from_flat(model=str(path), num_blocks=128, block_size=4))


@pytest.fixture
async def async_engine(engine):
    ae = AsyncEngine(EngineThread(engine), max_queued_requests=8)
    ae.start()
    yield ae
    ae.shutdown(timeout=5)
    assert engine.block_manager.num_used_blocks == 0


async def test_concurrent_streams_match_offline(async_engine, engine):
    params = SamplingParams(n=2, max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5][: i + 1] for i in range(5)]

    async def collect(i, prompt):
        texts, tokens = {0: "", 1: ""}, {0: [], 1: []}
        finals = []
        async for ev in await async_engine.submit(f"s{i}", prompt, params):
            texts[ev.index] += ev.text
            tokens[ev.index] += ev.token_ids
            if ev.finished:
                finals.append(ev)
        return tokens, finals

    results = await asyncio.gather(*(collect(i, p) for i, p in enumerate(prompts)))
    for tokens, finals in results:
        assert sorted(f.index for f in finals) == [0, 1]
        assert all(
            f.finish_reason is FinishReason.LENGTH and f.usage.completion_tokens == 12
            for f in finals
        )
        assert tokens[0] == tokens[1] and len(tokens[0]) == 12


async def test_validation_error_raised_at_submit(async_engine):
    with pytest.raises(ValidationError) as err:
        await async_engine.submit("bad", [1, 2], SamplingParams(top_p=0.0))
    assert err.value.field == "top_p"


async def test_leaving_the_stream_early_cancels(async_engine, engine):
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    seen = 0
    async for _ in await async_engine.submit("early", [1, 2, 3], params):
        seen += 1
        if seen == 3:
            break
    for _ in range(100):  # the cancel lands within an engine step or two
        if "early" not in engine.requests:
            break
        await asyncio.sleep(0.02)
    assert "early" not in engine.requests


async def test_cancel_by_id_ends_stream_with_cancelled(async_engine):
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    stream = await async_engine.submit("byid", [4, 5, 6], params)
    last = None
    async for ev in stream:
        last = ev
        if not ev.finished:
            async_engine.cancel("byid")
    assert last.finish_reason is FinishReason.CANCELLED


async def test_full_queue_is_refused_fast_and_queued_requests_still_run(engine):
    ae = AsyncEngine(
        EngineThread(engine), max_queued_requests=2
    )  # not started yet: nothing drains the inbox
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    pending = [asyncio.ensure_future(ae.submit(f"q{i}", [1, 2], params)) for i in range(2)]
    await asyncio.sleep(0)
    with pytest.raises(EngineOverloaded, match="queue is full"):
        await ae.submit("q-over", [1, 2], params)
    ae.start()
    try:
        for fut in pending:
            events = [ev async for ev in await fut]
            assert events[-1].finish_reason is FinishReason.LENGTH
    finally:
        ae.shutdown(timeout=5)
    assert "q-over" not in engine.requests


def step_event(index: int, token: int) -> CandidateEvent:
    return CandidateEvent("r", index, f"t{token}", [token])


def final_event(index: int) -> CandidateEvent:
    return CandidateEvent("r", index, "", [], finish_reason=FinishReason.LENGTH)


async def test_events_a_slow_consumer_left_waiting_come_out_merged_in_order():
    stream = RequestStream("r", 1)
    lp = [TokenLogprob(t, -0.5 * t) for t in range(4)]
    stream.push([CandidateEvent("r", 0, f"t{t}", [t], logprobs=[lp[t]]) for t in range(3)])
    iterator = aiter(stream)
    merged = await anext(iterator)
    assert (merged.text, merged.token_ids, merged.logprobs) == ("t0t1t2", [0, 1, 2], lp[:3])
    assert not merged.finished
    stream.push([CandidateEvent("r", 0, "t3", [3], logprobs=[lp[3]])])
    alone = await anext(iterator)  # one waiting event is handed out as it is
    assert (alone.text, alone.token_ids) == ("t3", [3])
    stream.push([final_event(0)])
    assert (await anext(iterator)).finish_reason is FinishReason.LENGTH
    assert [e async for e in iterator] == []


async def test_full_mailbox_fails_only_that_stream():
    overflows = []
    stream = RequestStream("r", 2, mailbox_size=4, abort=lambda door: overflows.append(door))
    stream.push([step_event(0, t) for t in range(6)])  # two more than the mailbox holds
    stream.push([step_event(0, 9)])
    assert overflows == ["slow_reader"]  # the request is cancelled once
    with pytest.raises(StreamOverflow, match="fell behind by 4 events"):
        async for _ in stream:
            pass


async def test_final_event_is_never_swallowed_by_a_full_mailbox():
    stream = RequestStream("r", 2, mailbox_size=3, abort=lambda door: pytest.fail("cancelled"))
    stream.push([step_event(0, t) for t in range(3)] + [final_event(0)])
    stream.push([step_event(1, 7), final_event(1), final_event(1)])  # a late duplicate too
    seen = [(e.index, e.token_ids, e.finished) async for e in stream]
    assert seen == [
        (0, [0, 1, 2], False),  # what piled up comes out as one delta
        (0, [], True),
        (1, [7], False),
        (1, [], True),
    ]


async def test_a_caller_who_leaves_before_admission_takes_its_request_back(engine):
    ae = AsyncEngine(EngineThread(engine, warmup=False))  # not started: the Submit waits
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    steps, inbox = engine.num_steps, engine.aborts["grpc_unary", "inbox"]
    waiting = asyncio.ensure_future(ae.submit("gone", [1, 2, 3], params, door="grpc_unary"))
    await asyncio.sleep(0)  # the Submit is in the inbox
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    ae.start()  # the loop meets the Submit and its withdrawal in one drain
    try:
        for _ in range(250):
            if engine.aborts["grpc_unary", "inbox"] > inbox:
                break
            await asyncio.sleep(0.02)
        assert engine.aborts["grpc_unary", "inbox"] == inbox + 1
        assert "gone" not in engine.requests and engine.num_steps == steps  # never ran
        assert not ae.has_work
    finally:
        ae.shutdown(timeout=5)


async def test_a_caller_cancelled_as_its_admission_arrives_takes_it_back(async_engine, engine):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    aborted = sum(engine.aborts.values())
    waiting = asyncio.ensure_future(async_engine.submit("raced", [1, 2, 3], params))
    await asyncio.sleep(0)  # the Submit is on its way
    for _ in range(500):  # hold the event loop, so the admission cannot reach the caller
        if "raced" in engine.requests:
            break
        time.sleep(0.01)
    assert "raced" in engine.requests
    waiting.cancel()  # admitted in the engine, but the caller never hears of it
    with pytest.raises(asyncio.CancelledError):
        await waiting
    for _ in range(250):
        if "raced" not in engine.requests:
            break
        await asyncio.sleep(0.02)
    assert "raced" not in engine.requests
    assert sum(engine.aborts.values()) == aborted + 1  # aborted, not run to max_tokens


async def test_a_late_abort_never_reaches_a_later_request_with_the_same_id(async_engine):
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = await async_engine.submit("reused", [1, 2], short)
    assert [e.finish_reason async for e in first if e.finished] == [FinishReason.LENGTH]
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    second = await async_engine.submit("reused", [1, 2, 3], long)
    first.abort("api")  # what the first stream's cleanup would send, arriving late
    finals = [e async for e in second if e.finished]
    assert [(f.finish_reason, f.usage.completion_tokens) for f in finals] == [
        (FinishReason.LENGTH, 30)
    ]
