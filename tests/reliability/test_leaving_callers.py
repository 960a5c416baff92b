"""Callers who leave stop their work at once, by every door, on `pagedserve serve`.

A storm of client-side aborts hits a real server process, driven only from outside
(gRPC, raw HTTP, the metrics endpoint): gRPC unary and streaming calls cancelled by the
client, past their deadline (0.05-2 s) or with their channel closed; client processes
killed mid-call; REST unary and SSE connections dropped; the Cancel RPC. Prompts are long
enough to be chunked, and few sequences run at once, so the doors open while requests
wait, prefill, decode or (with a small KV pool) sit preempted, some with n > 1.

The promise is checked at the moment it is due, not once the engine is idle anyway: one
second after the storm's last call ended the engine runs nothing, waits for nothing and
holds no KV block. Then a few callers each leave while their long prompt's first step
runs (a storm's random leaving catches a prefill seldom), and one second after the last
of them left the same holds; over the next two seconds the engine samples no token. Each
request asks for far more tokens than it lives to see, so a request that ran on after its
caller left shows at once. The server's own count of aborts
(pagedserve_requests_aborted_total) shows every door and stage was hit.

It runs with the engine loop on a thread and in its own process, on small steps (8
tokens); and on the default step budget with prompts of up to 2,400 tokens while three
other processes keep the two cores busy, where an untimed step of 2,048 prompt tokens
takes seconds: there a caller who leaves waits for the step running, which only the CPU's
timed steps (target_step_seconds) keep well under a second.

    LEAVING_CALLERS=2000 python -m pytest -q -s tests/reliability/test_leaving_callers.py
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from tests.server_process import ServerProcess, free_port, start_server_process
from tests.tiny_models import write_tiny_model

NUM_CALLS = int(os.environ.get("LEAVING_CALLERS", 420))  # at least 400 aborts in CI
ARRIVAL_SECONDS = NUM_CALLS / 100  # ~100 new calls a second
KILLED_PROCESSES, CALLS_PER_PROCESS = 3, 12
PREFILL_PROBES = 3


@dataclass(frozen=True)
class Run:
    """A server to storm, its prompts, and the load beside it."""

    model: str  # a key of MODELS
    server_args: tuple[str, ...]
    long_prompt: tuple[int, int]  # a long prompt's length range (a short one has 4 tokens)
    max_tokens: int  # prompt and output: far more than any call lives to see
    engine_process: bool = False
    busy_cores: int = 0  # processes spinning on the cores meanwhile
    stages: tuple[str, ...] = ("waiting", "prefill", "decode", "preempted")


# Few running slots, so most calls wait; 8-token steps, so long prompts prefill in chunks;
# a pool of 192 tokens, so four growing sequences cannot all fit and some are preempted.
SMALL_STEPS = (
    "--max-num-seqs", "4", "--max-num-batched-tokens", "8", "--chunked-prefill",
    "--num-blocks", "48", "--block-size", "4", "--max-queued-requests", "4096",
)  # fmt: skip
# The default step budget (2,048 tokens), and a pool that holds four whole requests.
DEFAULT_STEPS = (
    "--max-num-seqs", "4", "--num-blocks", "640", "--block-size", "16",
    "--max-queued-requests", "4096",
)  # fmt: skip
# Tiny random models (tests/tiny_models.py): the test's own, and one wide enough that a step
# of 2,048 prompt tokens takes 4.7-5.2 s on one torch thread beside three busy processes
# on the two-core VM (the tiny one: 0.14-0.27 s).
MODELS = {
    "tiny": dict(max_position_embeddings=1024),
    "wide": dict(
        max_position_embeddings=4096, hidden_size=384, intermediate_size=1536,
        num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=3, head_dim=64,
    ),
}  # fmt: skip
# The servers run torch on one thread: two OpenMP threads that spin at every barrier while
# the busy processes hold the cores make a step of the tiny model 0.3-0.8 s whatever its
# tokens (0.03 s on one thread), a cost of its own that no step budget removes.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
RUNS = {
    "engine-thread": Run("tiny", SMALL_STEPS, (60, 120), 180),
    "engine-process": Run("tiny", SMALL_STEPS, (60, 120), 180, engine_process=True),
    # Busy cores slow every step, so sequences grow too little to be surely preempted
    # before their callers leave (the pool holds them all anyway); they widen the windows
    # of the races (a caller leaving before its request was admitted: stage inbox, which
    # the unit tests of tests/test_async_engine.py pin down) and make a step of 2,048
    # prompt tokens last seconds.
    "default-budget-busy-cores": Run(
        "wide",
        DEFAULT_STEPS,
        (600, 2000),
        2400,
        busy_cores=3,
        stages=("waiting", "prefill", "decode"),
    ),
}
DOORS = (
    "grpc_unary_cancel",
    "grpc_unary_deadline",
    "grpc_stream_cancel",
    "grpc_stream_deadline",
    "grpc_channel_closed",
    "cancel_rpc",
    "rest_unary",
    "rest_sse",
)
# A child process that starts its calls, says so, and reads them until it is killed.
CLIENT_PROCESS = """
import asyncio, json, sys
import grpc
from pagedserve.v1 import inference_pb2 as pb, inference_pb2_grpc

async def main(target, prompts, max_tokens):
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        calls = []
        for i, ids in enumerate(prompts):
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids),
                sampling=pb.SamplingOptions(temperature=0.0),
                stopping=pb.StoppingOptions(max_tokens=max_tokens - len(ids), ignore_eos=True),
            )
            calls.append(stub.StreamGenerate(request) if i % 2 else stub.Generate(request))
        print("started", flush=True)
        await asyncio.gather(*(c if hasattr(c, "__await__") else c.read() for c in calls))
        await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])))
"""


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> Callable[[str], Path]:
    """MODELS, each written once it is asked for."""
    written: dict[str, Path] = {}

    def write(name: str) -> Path:
        if name not in written:
            directory = tmp_path_factory.mktemp(f"leaving-{name}")
            written[name] = write_tiny_model(directory, "llama", **MODELS[name])
        return written[name]

    return write


def prompt(rng: random.Random, run: Run) -> list[int]:
    """A short prompt, or a long one that takes several steps to prefill."""
    return [rng.randrange(3, 300) for _ in range(rng.choice((4, rng.randint(*run.long_prompt))))]


def grpc_request(rng: random.Random, run: Run, request_id: str = "") -> pb.GenerateRequest:
    ids = prompt(rng, run)
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingOptions(temperature=rng.choice((0.0, 0.8)), n=rng.choice((1, 1, 2, 3))),
        stopping=pb.StoppingOptions(max_tokens=run.max_tokens - len(ids), ignore_eos=True),
        priority=rng.choice((0, 0, 1)),
    )


async def grpc_call(stub, door: str, rng: random.Random, run: Run, i: int) -> tuple[str, float]:
    """One gRPC call whose client leaves by `door` after a random while; its outcome, and
    when the caller left."""
    leave_after = rng.uniform(0.05, 2.0)
    request = grpc_request(rng, run, f"leave-{i}" if door == "cancel_rpc" else "")
    unary = door.startswith("grpc_unary") or (door == "cancel_rpc" and i % 2)
    timeout = leave_after if door.endswith("deadline") else 120
    call = (stub.Generate if unary else stub.StreamGenerate)(request, timeout=timeout)
    reading = asyncio.ensure_future(_finish_reasons(call, unary))
    done, _ = await asyncio.wait([reading], timeout=leave_after)
    if door == "cancel_rpc":
        # A Cancel that overtakes its request finds nothing (cancelled: false): ask again.
        cancel = pb.CancelRequest(request_id=request.request_id)
        while not reading.done() and not (await stub.Cancel(cancel)).cancelled:
            await asyncio.sleep(0.02)
    elif door.endswith("cancel") and not done:
        call.cancel()
    left = time.monotonic()  # past its deadline too; a Cancel RPC's answer still comes
    try:
        reasons = await reading
    except asyncio.CancelledError:
        return "aborted", left
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), exc
        return "aborted", left
    return "aborted" if pb.FINISH_REASON_CANCELLED in reasons else "finished", left


async def prefill_probe(
    server: ServerProcess, stub, rng: random.Random, run: Run, i: int
) -> tuple[asyncio.Future, float]:
    """A call with the longest prompt a sequence holds, on an idle engine, cancelled (Cancel
    RPC) once the server's metrics show it admitted: the step that prefills its first chunk
    is then running. Returns its answer's finish reasons (to come) and when its caller left."""
    ids = [rng.randrange(3, 300) for _ in range(run.max_tokens - 8)]
    request = pb.GenerateRequest(
        request_id=f"prefill-{i}",
        token_ids=pb.TokenIds(ids=ids),
        stopping=pb.StoppingOptions(max_tokens=8, ignore_eos=True),
    )
    reading = asyncio.ensure_future(_finish_reasons(stub.StreamGenerate(request), False))
    while not reading.done() and not live_requests(server.metrics()):
        await asyncio.sleep(0.001)
    await stub.Cancel(pb.CancelRequest(request_id=request.request_id))
    return reading, time.monotonic()


def live_requests(metrics: dict[str, float]) -> float:
    """Requests the engine holds: admitted, running or waiting."""
    return metrics["pagedserve_num_requests_running"] + metrics["pagedserve_num_requests_waiting"]


async def _finish_reasons(call, unary: bool) -> set[int]:
    """The finish reasons a call's answer carries, once it ends."""
    if unary:
        return {c.finish_reason for c in (await call).candidates}
    return {m.finish_reason async for m in call if m.finish_reason}


async def channel_closed_call(target: str, rng: random.Random, run: Run) -> tuple[str, float]:
    """A call on a channel of its own, which the client closes under it; its outcome, and
    when the channel closed."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = grpc_request(rng, run)
        call = stub.StreamGenerate(request) if rng.random() < 0.5 else stub.Generate(request)
        reading = asyncio.ensure_future(_finish_reasons(call, hasattr(call, "__await__")))
        await asyncio.wait([reading], timeout=rng.uniform(0.05, 2.0))
    left = time.monotonic()
    try:
        await reading
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        return "aborted", left
    return "finished", left


async def rest_call(port: int, stream: bool, rng: random.Random, run: Run) -> tuple[str, float]:
    """A REST completion over a raw connection that the client drops after a while; its
    outcome, and when the connection was dropped."""
    ids = prompt(rng, run)
    body = json.dumps(
        {
            "prompt": ids,
            "max_tokens": run.max_tokens - len(ids),
            "temperature": 0.0,
            "ignore_eos": True,
            "n": rng.choice((1, 2)),
            "stream": stream,
        }
    ).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    received, outcome = b"", "aborted"
    deadline = time.monotonic() + rng.uniform(0.05, 2.0)
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            chunk = await asyncio.wait_for(reader.read(65536), remaining)
            if not chunk:
                break
            received += chunk
            if b"[DONE]" in received or (not stream and b'"usage"' in received):
                outcome = "finished"
                break
    except asyncio.TimeoutError:
        pass
    finally:
        writer.close()
        left = time.monotonic()
        await writer.wait_closed()
    return outcome, left


async def killed_client_process(
    target: str, rng: random.Random, run: Run
) -> tuple[list[str], float]:
    """A client process with calls in flight, killed (SIGKILL) after a random while; their
    outcomes, and when it was killed."""
    prompts = [prompt(rng, run) for _ in range(CALLS_PER_PROCESS)]
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT_PROCESS, target, json.dumps(prompts), str(run.max_tokens),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert (await asyncio.wait_for(child.stdout.readline(), 60)) == b"started\n"
    await asyncio.sleep(rng.uniform(0.05, 2.0))
    child.send_signal(signal.SIGKILL)
    left = time.monotonic()
    await child.wait()
    return ["aborted"] * CALLS_PER_PROCESS, left


async def storm(
    server: ServerProcess, http_port: int, rng: random.Random, run: Run
) -> tuple[collections.Counter, float]:
    """Every call of the storm, each leaving by its door; returns (door, outcome) counts and
    when the last caller left."""
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(i: int) -> tuple[list[tuple[str, str]], float]:
            door = DOORS[i % len(DOORS)]
            await asyncio.sleep(rng.uniform(0.0, ARRIVAL_SECONDS))
            if door == "grpc_channel_closed":
                outcome, left = await channel_closed_call(server.target, rng, run)
            elif door.startswith("rest"):
                outcome, left = await rest_call(http_port, door == "rest_sse", rng, run)
            else:
                outcome, left = await grpc_call(stub, door, rng, run, i)
            return [(door, outcome)], left

        async def killed(k: int) -> tuple[list[tuple[str, str]], float]:
            await asyncio.sleep(ARRIVAL_SECONDS * (k + 1) / (KILLED_PROCESSES + 1))
            outcomes, left = await killed_client_process(server.target, rng, run)
            return [("process_killed", o) for o in outcomes], left

        results = await asyncio.gather(
            *(one(i) for i in range(NUM_CALLS)), *(killed(k) for k in range(KILLED_PROCESSES))
        )
    outcomes = collections.Counter(pair for pairs, _ in results for pair in pairs)
    return outcomes, max(left for _, left in results)


async def probes(
    server: ServerProcess, rng: random.Random, run: Run
) -> tuple[collections.Counter, float, dict[str, float]]:
    """The prefill probes, one after another on an idle engine; returns their outcomes,
    when the last one's caller left, and the metrics one second after that."""
    outcomes: collections.Counter = collections.Counter()
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for i in range(PREFILL_PROBES):
            while live_requests(server.metrics()):
                await asyncio.sleep(0.01)
            reading, left = await prefill_probe(server, stub, rng, run, i)
            if i == PREFILL_PROBES - 1:  # due then, whether its answer came or not
                one_second_later = asyncio.ensure_future(metrics_at(server, left + 1.0))
            cancelled = pb.FINISH_REASON_CANCELLED in await reading
            outcomes["prefill_probe", "aborted" if cancelled else "finished"] += 1
    return outcomes, left, await one_second_later


async def metrics_at(server: ServerProcess, moment: float) -> dict[str, float]:
    """A scrape at `moment` (time.monotonic())."""
    await asyncio.sleep(max(0.0, moment - time.monotonic()))
    return server.metrics()


def assert_nothing_left(metrics: dict[str, float], when: str) -> None:
    for name in (
        "pagedserve_num_requests_running",
        "pagedserve_num_requests_waiting",
        "pagedserve_kv_cache_blocks_used",
    ):
        assert metrics[name] == 0, (when, name, metrics[name])


def aborted_by(metrics: dict[str, float], label: str) -> collections.Counter:
    """pagedserve_requests_aborted_total summed by one of its labels."""
    counts: collections.Counter = collections.Counter()
    for key, value in metrics.items():
        if key.startswith("pagedserve_requests_aborted_total{"):
            labels = dict(part.split("=") for part in key[key.index("{") + 1 : -1].split(","))
            counts[labels[label].strip('"')] += value
    return counts


STAGES = ("waiting", "prefill", "decode", "preempted")


@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS.values(), ids=RUNS.keys())
async def test_callers_who_leave_stop_their_work_at_once(model_dirs, run):
    http_port = free_port()
    flag = "--engine-process" if run.engine_process else "--no-engine-process"
    args = (*run.server_args, flag, "--http-port", str(http_port))
    server = start_server_process(model_dirs(run.model), *args, env=SERVER_ENV)
    spinners = []
    try:
        server.wait_ready(timeout=120)
        spinners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(run.busy_cores)
        ]
        rng = random.Random(1234 + run.busy_cores + run.engine_process)
        started = time.monotonic()
        try:
            outcomes, last_left = await storm(server, http_port, rng, run)
            # A call ends once its caller left, but a Cancel RPC's answer comes when the
            # engine has the request out: past the moment due, it came too late.
            storm_ended = time.monotonic()
            after_the_storm = await metrics_at(server, last_left + 1.0)
            probed, last_probe_left, after_the_probes = await probes(server, rng, run)
        except BaseException:
            print(server.stderr()[-5000:])
            raise
        outcomes += probed
        after_three_seconds = await metrics_at(server, last_probe_left + 3.0)
        for spinner in spinners:
            spinner.kill()

        print(f"\n{sum(outcomes.values())} calls in {storm_ended - started:.1f} s")
        print(
            f"  the storm's calls ended {storm_ended - last_left:.2f} s after its last caller left"
        )
        for (door, outcome), count in sorted(outcomes.items()):
            print(f"  {door:20} {outcome:9} {count}")
        print("  aborted by door:", dict(aborted_by(after_three_seconds, "door")))
        print("  aborted by stage:", dict(aborted_by(after_three_seconds, "stage")))
        print("  preemptions:", after_three_seconds["pagedserve_preemptions_total"])
        print("  steps:", after_three_seconds.get("pagedserve_engine_steps_total"))

        aborted = sum(n for (_, outcome), n in outcomes.items() if outcome == "aborted")
        assert aborted >= 400, outcomes
        assert storm_ended - last_left < 1.0, "a call's answer came over 1 s after it left"
        assert_nothing_left(after_the_storm, "1 s after the storm's last caller left")
        assert_nothing_left(after_the_probes, "1 s after the last prefill probe left")
        tokens = "pagedserve_generation_tokens_total"
        assert after_three_seconds[tokens] == after_the_probes[tokens]

        by_door = aborted_by(after_three_seconds, "door")
        for door in ("grpc_unary", "grpc_stream", "rest_unary", "rest_stream", "cancel_rpc"):
            assert by_door[door] >= 10, by_door
        by_stage = aborted_by(after_three_seconds, "stage")
        for stage in run.stages:
            assert by_stage[stage] >= 1, by_stage
        assert server.health() == health_pb2.HealthCheckResponse.SERVING  # nothing else went down
    finally:
        for spinner in spinners:
            spinner.kill()
        server.stop()
