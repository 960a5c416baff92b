"""A long prompt arriving while streams decode, through a real gRPC server on loopback.

With chunked prefill no step carries more than max_num_batched_tokens tokens: the long
prompt prefills over several steps and every running stream gets its token in each of
them, so their inter-token latency stays bounded by one small step. Without it the whole
prompt runs in one step that every running stream waits for. Structural, not timed: the
engine's steps are recorded as the scheduler made them. The timings are
benchmarks/reliability/long_prompt_itl.py's (docs/RELIABILITY.md)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from tests.reliability.test_abort_storm import consume, phase
from tests.test_grpc_server import greedy, serving
from tests.tiny_models import write_tiny_model

STREAMS, STREAM_TOKENS = 4, 80
LONG_PROMPT = 300
BUDGET = 32  # max_num_batched_tokens with chunked prefill


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("long-prompt-tiny"), "llama")


def record_steps(core) -> list[dict[str, int]]:
    """Every step the engine schedules from now on, as {request id: tokens in the step}."""
    steps: list[dict[str, int]] = []
    schedule = core.scheduler.schedule

    def recording():
        out = schedule()
        if not out.is_empty:
            steps.append({c.seq.request.request_id: c.end - c.start for c in out.chunks})
        return out

    core.scheduler.schedule = recording
    return steps


async def run_long_prompt_among_streams(model, **settings) -> list[dict[str, int]]:
    """STREAMS streams start; once they all decode, a LONG_PROMPT-token prompt
    arrives. Returns the steps from then on; checks every request got all its tokens."""
    async with serving(model, num_blocks=256, max_num_seqs=8, **settings) as (srv, core, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            calls = [
                stub.StreamGenerate(
                    pb.GenerateRequest(
                        request_id=f"stream-{i}",
                        token_ids=pb.TokenIds(ids=[5 + i, 6, 7]),
                        **greedy(STREAM_TOKENS),
                    )
                )
                for i in range(STREAMS)
            ]
            reading = [asyncio.ensure_future(consume(call)) for call in calls]
            while any(phase(core, f"stream-{i}") != "decode" for i in range(STREAMS)):
                await asyncio.sleep(0.001)
            steps = record_steps(core)
            long = pb.GenerateRequest(
                request_id="long",
                token_ids=pb.TokenIds(ids=[3 + i % 290 for i in range(LONG_PROMPT)]),
                **greedy(4),
            )
            results = await asyncio.gather(consume(stub.StreamGenerate(long)), *reading)
    for expected, (messages, error) in zip([4] + [STREAM_TOKENS] * STREAMS, results):
        assert error is None, error
        assert sum(len(m.token_ids) for m in messages) == expected
    return steps


def prefill_steps(steps: list[dict[str, int]]) -> list[dict[str, int]]:
    """The steps that computed part of the long prompt (its first token comes with the last)."""
    done, out = 0, []
    for step in steps:
        if done < LONG_PROMPT and "long" in step:
            out.append(step)
            done += step["long"]
    assert done >= LONG_PROMPT, done
    return out


async def test_with_chunked_prefill_running_streams_get_a_token_every_step(tiny_model):
    steps = await run_long_prompt_among_streams(
        tiny_model, max_num_batched_tokens=BUDGET, enable_chunked_prefill=True
    )
    assert all(sum(step.values()) <= BUDGET for step in steps)
    during = prefill_steps(steps)
    assert len(during) >= -(-LONG_PROMPT // (BUDGET - STREAMS))  # prefilled over many steps
    for step in during:  # ... and in each of them every running stream decoded one token
        assert all(step.get(f"stream-{i}") == 1 for i in range(STREAMS)), step


async def test_without_chunked_prefill_one_step_carries_the_whole_prompt(tiny_model):
    steps = await run_long_prompt_among_streams(
        tiny_model, max_num_batched_tokens=512, enable_chunked_prefill=False
    )
    (step,) = prefill_steps(steps)
    assert step["long"] == LONG_PROMPT and sum(step.values()) == LONG_PROMPT + STREAMS
