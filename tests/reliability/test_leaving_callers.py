"""Callers who leave stop their work at once, by every door, on `pagedserve serve`.

A storm of client-side aborts hits a real server process, driven only from outside
(gRPC, raw HTTP, the metrics endpoint): gRPC unary and streaming calls cancelled by the
client, past their deadline (0.05-2 s) or with their channel closed; client processes
killed mid-call; REST unary and SSE connections dropped; the Cancel RPC. Prompts are long
enough to be chunked, the KV pool small enough to preempt, and few sequences run at once,
so the doors open while requests wait, prefill, decode or sit preempted, some with n > 1.

The promise is checked at the moment it is due, not once the engine is idle anyway: one
second after the last call ended the engine runs nothing, waits for nothing and holds no
KV block, and over the next two seconds it samples no token. Each request asks for far more
tokens than it lives to see, so a request that ran on after its caller left shows at once.
The server's own count of aborts (pagedserve_requests_aborted_total) shows every door and
stage was hit (prefill surely by the probes that follow the storm). It runs with the
engine loop on a thread, in its own process, and with two other processes keeping the
cores busy (the load that widens the races).

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

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from tests.server_process import ServerProcess, free_port, start_server_process
from tests.tiny_models import write_tiny_model

NUM_CALLS = int(os.environ.get("LEAVING_CALLERS", 420))  # at least 400 aborts in CI
ARRIVAL_SECONDS = NUM_CALLS / 100  # ~100 new calls a second
MAX_TOKENS = 180  # far more than any call lives to see: a call left running keeps sampling
KILLED_PROCESSES, CALLS_PER_PROCESS = 3, 12
PREFILL_PROBES = 3
# Few running slots, so most calls wait; 8-token steps, so long prompts prefill in chunks;
# a pool of 192 tokens, so four growing sequences cannot all fit and some are preempted.
SERVER_ARGS = (
    "--max-num-seqs", "4", "--max-num-batched-tokens", "8", "--chunked-prefill",
    "--num-blocks", "48", "--block-size", "4", "--max-queued-requests", "4096",
)  # fmt: skip
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
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("leaving-tiny")
    return write_tiny_model(directory, "llama", max_position_embeddings=1024)


def prompt(rng: random.Random) -> list[int]:
    """A short prompt, or a long one that takes several steps to prefill."""
    return [rng.randrange(3, 300) for _ in range(rng.choice((4, rng.randint(60, 120))))]


def grpc_request(rng: random.Random, request_id: str = "") -> pb.GenerateRequest:
    ids = prompt(rng)
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingOptions(temperature=rng.choice((0.0, 0.8)), n=rng.choice((1, 1, 2, 3))),
        stopping=pb.StoppingOptions(max_tokens=MAX_TOKENS - len(ids), ignore_eos=True),
        priority=rng.choice((0, 0, 1)),
    )


async def grpc_call(stub, door: str, rng: random.Random, i: int) -> str:
    """One gRPC call whose client leaves by `door` after a random while."""
    leave_after = rng.uniform(0.05, 2.0)
    request = grpc_request(rng, f"leave-{i}" if door == "cancel_rpc" else "")
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
    try:
        reasons = await reading
    except asyncio.CancelledError:
        return "aborted"
    except grpc.aio.AioRpcError as exc:
        assert exc.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), exc
        return "aborted"
    return "aborted" if pb.FINISH_REASON_CANCELLED in reasons else "finished"


async def prefill_probe(server: ServerProcess, stub, rng: random.Random, i: int) -> str:
    """A call with the longest prompt a sequence holds, on an idle engine, cancelled (Cancel
    RPC) once the server's metrics show it running: its prompt, 8 tokens a step, is then
    still prefilling. A storm's random leaving catches a prefill seldom (a few steps of a
    request's life), so these make sure that stage is hit."""
    ids = [rng.randrange(3, 300) for _ in range(MAX_TOKENS - 8)]
    request = pb.GenerateRequest(
        request_id=f"prefill-{i}",
        token_ids=pb.TokenIds(ids=ids),
        stopping=pb.StoppingOptions(max_tokens=8, ignore_eos=True),
    )
    reading = asyncio.ensure_future(_finish_reasons(stub.StreamGenerate(request), False))
    while not reading.done() and not server.metrics()["pagedserve_num_requests_running"]:
        await asyncio.sleep(0.001)
    await stub.Cancel(pb.CancelRequest(request_id=request.request_id))
    return "aborted" if pb.FINISH_REASON_CANCELLED in await reading else "finished"


async def _finish_reasons(call, unary: bool) -> set[int]:
    """The finish reasons a call's answer carries, once it ends."""
    if unary:
        return {c.finish_reason for c in (await call).candidates}
    return {m.finish_reason async for m in call if m.finish_reason}


async def channel_closed_call(target: str, rng: random.Random) -> str:
    """A call on a channel of its own, which the client closes under it."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = grpc_request(rng)
        call = stub.StreamGenerate(request) if rng.random() < 0.5 else stub.Generate(request)
        reading = asyncio.ensure_future(_finish_reasons(call, hasattr(call, "__await__")))
        await asyncio.wait([reading], timeout=rng.uniform(0.05, 2.0))
    try:
        await reading
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        return "aborted"
    return "finished"


async def rest_call(port: int, stream: bool, rng: random.Random) -> str:
    """A REST completion over a raw connection that the client drops after a while."""
    ids = prompt(rng)
    body = json.dumps(
        {
            "prompt": ids,
            "max_tokens": MAX_TOKENS - len(ids),
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
    received = b""
    deadline = time.monotonic() + rng.uniform(0.05, 2.0)
    try:
        while (left := deadline - time.monotonic()) > 0:
            chunk = await asyncio.wait_for(reader.read(65536), left)
            if not chunk:
                break
            received += chunk
            if b"[DONE]" in received or (not stream and b'"usage"' in received):
                return "finished"
    except asyncio.TimeoutError:
        pass
    finally:
        writer.close()
        await writer.wait_closed()
    return "aborted"


async def killed_client_process(target: str, rng: random.Random) -> list[str]:
    """A client process with calls in flight, killed (SIGKILL) after a random while."""
    prompts = [prompt(rng) for _ in range(CALLS_PER_PROCESS)]
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLIENT_PROCESS, target, json.dumps(prompts), str(MAX_TOKENS),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert (await asyncio.wait_for(child.stdout.readline(), 60)) == b"started\n"
    await asyncio.sleep(rng.uniform(0.05, 2.0))
    child.send_signal(signal.SIGKILL)
    await child.wait()
    return ["aborted"] * CALLS_PER_PROCESS


async def storm(server: ServerProcess, http_port: int, rng: random.Random) -> collections.Counter:
    """Every call of the storm, each leaving by its door; returns (door, outcome) counts."""
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)

        async def one(i: int) -> tuple[str, str]:
            door = DOORS[i % len(DOORS)]
            await asyncio.sleep(rng.uniform(0.0, ARRIVAL_SECONDS))
            if door == "grpc_channel_closed":
                return door, await channel_closed_call(server.target, rng)
            if door.startswith("rest"):
                return door, await rest_call(http_port, door == "rest_sse", rng)
            return door, await grpc_call(stub, door, rng, i)

        async def killed(k: int) -> list[tuple[str, str]]:
            await asyncio.sleep(ARRIVAL_SECONDS * (k + 1) / (KILLED_PROCESSES + 1))
            return [("process_killed", o) for o in await killed_client_process(server.target, rng)]

        results = await asyncio.gather(
            *(one(i) for i in range(NUM_CALLS)), *(killed(k) for k in range(KILLED_PROCESSES))
        )
        flat = [r for item in results for r in (item if isinstance(item, list) else [item])]
        while (metrics := server.metrics())["pagedserve_num_requests_waiting"] or metrics[
            "pagedserve_num_requests_running"
        ]:
            await asyncio.sleep(0.01)  # the storm's last aborts land within a step or two
        for i in range(PREFILL_PROBES):
            flat.append(("prefill_probe", await prefill_probe(server, stub, rng, i)))
    return collections.Counter(flat)


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
@pytest.mark.parametrize(
    "engine_process,busy_cores,stages",
    [
        (False, 0, STAGES),
        (True, 0, STAGES),
        # Busy cores slow every step, so sequences grow too little to be surely preempted
        # before their callers leave; they widen the windows of the races (a caller leaving
        # before its request was admitted: stage inbox, which the unit tests of
        # tests/test_async_engine.py pin down), which is what this run is for.
        (False, 2, ("waiting", "prefill", "decode")),
    ],
    ids=["engine-thread", "engine-process", "engine-thread-busy-cores"],
)
async def test_callers_who_leave_stop_their_work_at_once(
    tiny_model, engine_process, busy_cores, stages
):
    http_port = free_port()
    flag = "--engine-process" if engine_process else "--no-engine-process"
    server = start_server_process(tiny_model, *SERVER_ARGS, flag, "--http-port", str(http_port))
    spinners = []
    try:
        server.wait_ready(timeout=120)
        spinners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy_cores)
        ]
        rng = random.Random(1234 + busy_cores + engine_process)
        started = time.monotonic()
        try:
            outcomes = await storm(server, http_port, rng)
        except BaseException:
            print(server.stderr()[-5000:])
            raise
        last_call_ended = time.monotonic()
        for spinner in spinners:
            spinner.kill()

        await asyncio.sleep(1.0)
        after_one_second = server.metrics()
        await asyncio.sleep(2.0)
        after_three_seconds = server.metrics()

        print(f"\n{sum(outcomes.values())} calls in {last_call_ended - started:.1f} s")
        for (door, outcome), count in sorted(outcomes.items()):
            print(f"  {door:20} {outcome:9} {count}")
        print("  aborted by door:", dict(aborted_by(after_three_seconds, "door")))
        print("  aborted by stage:", dict(aborted_by(after_three_seconds, "stage")))
        print("  preemptions:", after_three_seconds["pagedserve_preemptions_total"])

        aborted = sum(n for (_, outcome), n in outcomes.items() if outcome == "aborted")
        assert aborted >= 400, outcomes
        for name in (
            "pagedserve_num_requests_running",
            "pagedserve_num_requests_waiting",
            "pagedserve_kv_cache_blocks_used",
        ):
            assert after_one_second[name] == 0, (name, after_one_second[name])
        tokens = "pagedserve_generation_tokens_total"
        assert after_three_seconds[tokens] == after_one_second[tokens]

        by_door = aborted_by(after_three_seconds, "door")
        for door in ("grpc_unary", "grpc_stream", "rest_unary", "rest_stream", "cancel_rpc"):
            assert by_door[door] >= 10, by_door
        by_stage = aborted_by(after_three_seconds, "stage")
        for stage in stages:
            assert by_stage[stage] >= 1, by_stage
        assert server.health() == health_pb2.HealthCheckResponse.SERVING  # nothing else went down
    finally:
        for spinner in spinners:
            spinner.kill()
        server.stop()
