"""A burst of unary calls far beyond the queue, against `pagedserve serve`, from one client.

Overload is answered as documented at any burst size: each call is served or refused with
RESOURCE_EXHAUSTED and the `retry-after-ms` trailer, and every one is counted in
pagedserve_requests_total. grpc.aio takes the calls that arrive one at a time off the event
loop; the rest wait in grpc core, which by default sheds them once 1,000 wait (all of them at
3,000) with a bare CANCELLED that no handler sees. A burst of thousands at once is what
fills that backlog.

    BURST_CALLS=10000 python -m pytest -q -s tests/reliability/test_burst.py
"""

from __future__ import annotations

import asyncio
import collections
import os
import time

import grpc
import pytest

from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from tests.server_process import start_server_process
from tests.tiny_models import write_tiny_model

BURST_CALLS = int(os.environ.get("BURST_CALLS", 3000))
MAX_TOKENS = 4
SERVER_ARGS = (
    "--max-queued-requests", "8", "--max-num-seqs", "4", "--num-blocks", "64",
    "--block-size", "4",
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("burst-tiny"), "llama")


async def burst(target: str, num_calls: int) -> list[tuple[str, bool]]:
    """Start num_calls Generate calls at once; each one's status name and whether it
    carried the retry-after-ms trailer."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(i: int) -> tuple[str, bool]:
            request = pb.GenerateRequest(
                text=f"burst {i}",
                sampling=pb.SamplingOptions(temperature=0.0),
                stopping=pb.StoppingOptions(max_tokens=MAX_TOKENS, ignore_eos=True),
            )
            try:
                await stub.Generate(request, timeout=120)
                return "OK", False
            except grpc.aio.AioRpcError as err:
                trailer = dict(err.trailing_metadata() or ()).get("retry-after-ms")
                return err.code().name, trailer == "250"

        return await asyncio.gather(*(one(i) for i in range(num_calls)))


def test_a_burst_far_beyond_the_queue_is_served_or_refused_with_a_retry_hint(tiny_model):
    server = start_server_process(tiny_model, *SERVER_ARGS)
    try:
        server.wait_ready(timeout=120)
        start = time.monotonic()
        outcomes = asyncio.run(burst(server.target, BURST_CALLS))
        seconds = time.monotonic() - start
        answers = collections.Counter(outcomes)
        print(f"\n{BURST_CALLS} calls at once, answered in {seconds:.1f} s: {dict(answers)}")
        assert set(answers) <= {("OK", False), ("RESOURCE_EXHAUSTED", True)}, answers
        assert answers["OK", False] >= 8  # the queue's worth at least was served
        # Every call reached a handler, which counted it as it answered.
        metrics = server.metrics()
        counted = {
            name: value
            for name, value in metrics.items()
            if name.startswith("pagedserve_requests_total{") and 'rpc="Generate"' in name
        }
        assert counted == {
            'pagedserve_requests_total{code="OK",rpc="Generate"}': answers["OK", False],
            'pagedserve_requests_total{code="RESOURCE_EXHAUSTED",rpc="Generate"}': answers[
                "RESOURCE_EXHAUSTED", True
            ],
        }
    finally:
        server.stop()
