"""Ready means full speed: `pagedserve serve` as a real process on a tiny model, whose first
request after readiness turns SERVING is as quick to its first token as the same request
sent again, and whose metrics do not count the start-up warm-up."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import grpc
import pytest

from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from tests.server_process import ServerProcess, start_server_process
from tests.tiny_models import write_tiny_model

# Every request is sent after the same pause (PAUSE_SECONDS), as the first request after
# readiness always follows one. The servers run torch on one thread (OMP_NUM_THREADS): with
# two, a third of the requests after any pause, first or not, wait 10-30 ms more for the
# sleeping OpenMP thread to wake on this two-core VM (measured: 6 ms, or 15-40 ms, to the
# first token; never over 7.2 ms on one thread), which is noise to what the warm-up does.
# So, on this tiny model, a server's first request takes 0.9-1.05x as long to its first
# token as the same request again; 1.3-2.4x (median 2.0) without the warm-up. Each
# server's first request is one sample: the test takes the median over fresh servers.
PAUSE_SECONDS = 0.5
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
MAX_FIRST_TTFT_RATIO = 1.5  # the server's own TTFT, first request over the repeats'
MAX_FIRST_CLIENT_TTFT_RATIO = 2.0  # the caller's: it adds its own first call's costs
FRESH_SERVERS = 7
REPEATS = 5  # the warm TTFT is the median of this many sends


@pytest.fixture
def tiny_model(tmp_path) -> Path:
    return write_tiny_model(tmp_path / "tiny", "qwen3", max_position_embeddings=1024)


def start_fresh(model: Path) -> ServerProcess:
    started = time.monotonic()
    server = start_server_process(
        model,
        *("--max-num-seqs", "8", "--max-num-batched-tokens", "32", "--log-level", "INFO"),
        env=SERVER_ENV,
    )
    server.started = started  # when the test started it: time to ready cannot exceed ours
    return server


def first_request_shape() -> pb.GenerateRequest:
    """Paths a one-prompt greedy warm-up never takes: the chat template, n=2 (fork and
    copy-on-write), seeded top-k/top-p/min-p sampling with penalties, logprobs with top
    alternatives, prompt logprobs, min_tokens bans, stop strings, and a prompt longer than a
    step's token budget (chunked prefill)."""
    content = "Once upon a time there was a small model that served tokens very quickly."
    return pb.GenerateRequest(
        chat=pb.ChatMessages(
            messages=[
                pb.ChatMessage(role="system", content="You are brief."),
                pb.ChatMessage(role="user", content=content),
            ]
        ),
        sampling=pb.SamplingOptions(
            n=2,
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            min_p=0.02,
            repetition_penalty=1.1,
            presence_penalty=0.3,
            frequency_penalty=0.2,
            seed=11,
        ),
        stopping=pb.StoppingOptions(max_tokens=4, min_tokens=2, stop=["\n\n", "zzz"]),
        output=pb.OutputOptions(logprobs=5, prompt_logprobs=3),
    )


def timed_stream(stub, request: pb.GenerateRequest) -> tuple[float, float]:
    """(client TTFT: call to first message, the server's own ttft_seconds)."""
    start = time.perf_counter()
    client_ttft = None
    server_ttft = None
    for message in stub.StreamGenerate(request, timeout=120):
        if client_ttft is None:
            client_ttft = time.perf_counter() - start
        assert not message.error, message.error
        if message.finish_reason and message.index == 0:
            server_ttft = message.timing.ttft_seconds
    assert client_ttft is not None and server_ttft is not None
    return client_ttft, server_ttft


def assert_ready_state_is_fresh(server: ServerProcess) -> None:
    """At readiness: the warm-up ran, and nothing of it is counted or held."""
    seen_ready = time.monotonic() - server.started
    metrics = server.metrics()
    assert 0 < metrics["pagedserve_time_to_ready_seconds"] <= seen_ready
    counted = ("engine_steps", "prompt_tokens", "generation_tokens", "grammar_forced_tokens")
    for name in (*counted, "prefix_cache_queries"):
        assert metrics[f"pagedserve_{name}_total"] == 0, name
    assert metrics["pagedserve_kv_cache_blocks_used"] == 0
    log = server.stderr()
    for phase in ("model loaded in", "KV pool sized", "warm-up:", "ready"):
        assert phase in log, f"start-up log lacks {phase!r}:\n{log}"


def first_and_repeat_ttft(server: ServerProcess) -> tuple[float, float]:
    """(client, server) TTFT of the first request over the median of its repeats', each
    sent PAUSE_SECONDS after the one before (the first: after the checks at readiness)."""
    request = first_request_shape()
    with grpc.insecure_channel(server.target) as channel:
        grpc.channel_ready_future(channel).result(timeout=10)
        stub = inference_pb2_grpc.InferenceStub(channel)
        sends = []
        for _ in range(1 + REPEATS):
            time.sleep(PAUSE_SECONDS)
            sends.append(timed_stream(stub, request))
    (first_client, first_server), again = sends[0], sends[1:]
    warm_client = statistics.median(c for c, _ in again)
    warm_server = statistics.median(s for _, s in again)
    print(
        f"first TTFT {first_client * 1e3:.1f} ms (server {first_server * 1e3:.1f} ms), "
        f"repeat median {warm_client * 1e3:.1f} ms (server {warm_server * 1e3:.1f} ms)"
    )
    return first_client / warm_client, first_server / warm_server


def test_the_first_request_after_ready_is_as_quick_as_a_repeat(tiny_model):
    client_ratios, server_ratios = [], []
    for _ in range(FRESH_SERVERS):
        server = start_fresh(tiny_model)
        try:
            server.wait_ready(timeout=300)
            assert_ready_state_is_fresh(server)
            client_ratio, server_ratio = first_and_repeat_ttft(server)
        finally:
            server.stop()
        client_ratios.append(round(client_ratio, 2))
        server_ratios.append(round(server_ratio, 2))
    report = f"first/repeat TTFT per server: client {client_ratios}, server {server_ratios}"
    assert statistics.median(server_ratios) <= MAX_FIRST_TTFT_RATIO, report
    assert statistics.median(client_ratios) <= MAX_FIRST_CLIENT_TTFT_RATIO, report
