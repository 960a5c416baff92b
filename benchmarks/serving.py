"""Serving benchmark: drive a pagedserve server over gRPC and measure what clients see.

    python benchmarks/serving.py --start-server --concurrency 16 --num-prompts 64 \\
        --compare-offline --json-out /tmp/serving.json

Load: `--concurrency N` is a closed loop (N workers, each sends its next request when its
last one finished); `--request-rate R` is an open loop with Poisson arrivals at R requests/s.
Requests take the workload's prompts in order (the same seeded workload as offline.py) and
stop when they run out. Every request is a StreamGenerate of token ids with ignore_eos, so
TTFT and inter-token latency are timed here, on the client, per streamed message.

Windows, from the first timed send (`--warmup-requests` untimed requests go before it;
none by default, so a started server is measured from the moment it reports SERVING, as
its first callers meet it):
  warm-up      [0, --warmup): completions are not counted;
  measurement  [--warmup, --warmup + --duration), or until the last request finished when
               --duration is not given; no new request is sent once it closes;
  drain        requests still running at the close finish (the server is left idle and
               their errors are counted) but do not count.
Latency percentiles and request throughput count the requests that started AND finished
inside the measurement window; output tok/s counts the tokens received inside the window
divided by its length. Errors (by gRPC status code, or a wrong finish / token count) are
counted over every timed request. The "whole run" figures cover all timed requests from
the first send to the last reply: with `--compare-offline` that is what is set against the
offline engine's `generate()` of the same requests, both including the ramp-up and the tail.
Each timed part also reports the CPU seconds the machine was busy and how many of them went
to other processes: on a shared machine, a run with a large "others_s" is not a measurement.

`--start-server` runs `python -m service.cli serve` on a free port with prefix caching off
(re-sent prompts must not hit the cache), waits for the health service to report SERVING
(the time that took is reported as time_to_ready_s) and stops it with SIGTERM at the end. `--compare-offline` then runs engine.llm.LLM
in-process with the same engine settings (max_num_seqs defaults to the concurrency), after
the server has exited, so the two never share the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import (  # noqa: E402
    ROOT,
    CpuShare,
    Workload,
    WorkloadSpec,
    add_workload_args,
    make_workload,
    run_info,
)
from pagedserve.v1 import inference_pb2 as pb  # noqa: E402
from pagedserve.v1 import inference_pb2_grpc  # noqa: E402

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """One timed request as the client saw it; times are time.perf_counter() seconds."""

    expected_tokens: int
    start: float
    end: float = math.nan
    message_times: list[float] = field(default_factory=list)  # messages that carried tokens
    message_tokens: list[int] = field(default_factory=list)
    error: str | None = None  # status code name, or what was wrong with a finished stream

    @property
    def tokens(self) -> int:
        return sum(self.message_tokens)

    @property
    def ttft(self) -> float:
        return self.message_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for single-token outputs."""
        if self.tokens < 2:
            return None
        return (self.message_times[-1] - self.message_times[0]) / (self.tokens - 1)

    @property
    def itls(self) -> list[float]:
        return list(np.diff(self.message_times))


@dataclass
class Windows:
    start: float  # the first timed send
    measure_start: float
    close: float | None  # None: the window ends with the last reply

    def is_closed(self) -> bool:
        return self.close is not None and time.perf_counter() >= self.close


def request_message(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingOptions(temperature=0.0),
        stopping=pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
    )


async def send(
    stub: inference_pb2_grpc.InferenceStub,
    work: Workload,
    index: int,
    timeout: float,
) -> RequestRecord:
    record = RequestRecord(work.output_lens[index], time.perf_counter())
    finish = pb.FINISH_REASON_UNSPECIFIED
    try:
        request = request_message(work.prompts[index], work.output_lens[index])
        async for message in stub.StreamGenerate(request, timeout=timeout):
            if message.token_ids:
                record.message_times.append(time.perf_counter())
                record.message_tokens.append(len(message.token_ids))
            if message.finish_reason:
                finish = message.finish_reason
    except grpc.aio.AioRpcError as exc:
        record.error = exc.code().name
    record.end = time.perf_counter()
    if record.error is None and finish != pb.FINISH_REASON_LENGTH:
        record.error = f"finish {pb.FinishReason.Name(finish)}"
    elif record.error is None and record.tokens != record.expected_tokens:
        record.error = "wrong token count"
    return record


async def closed_loop(
    stub, work: Workload, concurrency: int, windows: Windows, bar: tqdm, timeout: float
) -> list[RequestRecord]:
    indices = iter(range(len(work.prompts)))  # shared: each worker takes the next prompt
    records: list[RequestRecord] = []

    async def worker() -> None:
        for index in indices:
            if windows.is_closed():
                return
            records.append(await send(stub, work, index, timeout))
            bar.update()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


async def poisson(
    stub, work: Workload, rate: float, seed: int, windows: Windows, bar: tqdm, timeout: float
) -> list[RequestRecord]:
    rng = random.Random(seed)
    tasks = []
    due = windows.start
    for index in range(len(work.prompts)):
        # Arrival times are absolute, so a slow loop iteration does not stretch the gaps.
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        if windows.is_closed():
            break
        task = asyncio.create_task(send(stub, work, index, timeout))
        task.add_done_callback(lambda _: bar.update())
        tasks.append(task)
        due += rng.expovariate(rate)
    return list(await asyncio.gather(*tasks))


async def run_load(
    args: argparse.Namespace, target: str, work: Workload, server_pids: list[int]
) -> dict:
    warm = make_workload(
        replace(WorkloadSpec.from_args(args), num_prompts=args.warmup_requests, seed=args.seed + 1)
    )
    await wait_ready(target, args.server_timeout)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        untimed = range(args.warmup_requests)
        for record in await asyncio.gather(*(send(stub, warm, i, args.timeout) for i in untimed)):
            if record.error:
                raise SystemExit(f"warm-up request failed: {record.error}")
        cpu = CpuShare([os.getpid(), *server_pids]).start()
        start = time.perf_counter()
        measure_start = start + args.warmup
        close = None if args.duration is None else measure_start + args.duration
        windows = Windows(start, measure_start, close)
        with tqdm(total=len(work.prompts), desc="serving", unit="req") as bar:
            if args.request_rate is not None:
                load = poisson(stub, work, args.request_rate, args.seed, windows, bar, args.timeout)
            else:
                load = closed_loop(stub, work, args.concurrency, windows, bar, args.timeout)
            records = await load
            cpu_share = cpu.stop()
    return summarize(records, windows) | {"cpu": cpu_share}


def summarize(records: list[RequestRecord], windows: Windows) -> dict:
    last_reply = max(r.end for r in records)
    end = last_reply if windows.close is None else min(windows.close, last_reply)
    length = end - windows.measure_start
    if length <= 0:
        raise SystemExit("the measurement window is empty: lower --warmup or send more requests")
    ok = [r for r in records if r.error is None]
    counted = [r for r in ok if r.start >= windows.measure_start and r.end <= end]
    window_tokens = sum(
        n
        for r in records
        for t, n in zip(r.message_times, r.message_tokens)
        if windows.measure_start <= t <= end
    )
    run_s = last_reply - windows.start
    run_tokens = sum(r.tokens for r in records)
    return {
        "window": {
            "seconds": round(length, 3),
            "completed_requests": len(counted),
            "request_throughput": round(len(counted) / length, 4),
            "output_tokens": window_tokens,
            "output_tok_s": round(window_tokens / length, 2),
            "ttft_s": percentiles([r.ttft for r in counted]),
            "tpot_s": percentiles([r.tpot for r in counted if r.tpot is not None]),
            "itl_s": percentiles([x for r in counted for x in r.itls]),
            "e2e_s": percentiles([r.e2e for r in counted]),
        },
        "whole_run": {
            "seconds": round(run_s, 3),
            "requests": len(records),
            "succeeded": len(ok),
            "output_tokens": run_tokens,
            "output_tok_s": round(run_tokens / run_s, 2),
        },
        "errors": dict(Counter(r.error for r in records if r.error is not None)),
    }


def percentiles(values: list[float]) -> dict:
    if not values:
        return {f"p{q}": None for q in PERCENTILES}
    points = np.percentile(values, PERCENTILES)
    return {f"p{q}": round(float(v), 5) for q, v in zip(PERCENTILES, points)}


# ---- the server and the offline engine -----------------------------------------------


def add_engine_args(
    parser: argparse.ArgumentParser, used_by: str, max_num_seqs_help: str, **defaults
) -> None:
    """The engine flags engine_flags() reads, and how long to wait for a started server."""
    engine = parser.add_argument_group(f"engine ({used_by})")
    engine.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    engine.add_argument("--max-num-seqs", type=int, help=max_num_seqs_help)
    engine.add_argument("--max-num-batched-tokens", type=int)
    engine.add_argument("--num-blocks", type=int)
    engine.add_argument("--kv-cache-memory-gib", type=float)
    parser.add_argument("--server-timeout", type=float, default=300.0, help="s to wait for SERVING")
    parser.set_defaults(**defaults)


def engine_flags(args: argparse.Namespace) -> dict:
    """Engine settings shared by the started server and the offline engine (None: default)."""
    return {
        "model": args.model,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_blocks": args.num_blocks,
        "kv_cache_memory_gib": args.kv_cache_memory_gib,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def started_server(
    args: argparse.Namespace, extra: Sequence[str] = ()
) -> Iterator[tuple[str, int]]:
    """Yields the server's address, pid and the seconds from its start to SERVING; `extra`
    are more `serve` flags."""
    port = free_port()
    cmd = [sys.executable, "-m", "service.cli", "serve", "--log-level", "INFO"]
    cmd += ["--host", "127.0.0.1", "--grpc-port", str(port), "--no-prefix-caching", *extra]
    for name, value in engine_flags(args).items():
        if value is not None:
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT)
    target = f"127.0.0.1:{port}"
    try:
        asyncio.run(wait_ready(target, args.server_timeout, proc))
        yield target, proc.pid, time.monotonic() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def wait_ready(target: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Poll the health service until the Inference service reports SERVING."""
    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"the server exited with status {proc.returncode}")
            try:
                reply = await health.Check(
                    health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=1
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass  # not listening yet, or the service is not registered yet
            await asyncio.sleep(0.5)
    raise SystemExit(f"the server was not SERVING after {timeout:.0f} s")


def run_offline(args: argparse.Namespace, work: Workload) -> dict:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    settings = {k: v for k, v in engine_flags(args).items() if v is not None}
    llm = LLM(**settings, enable_prefix_caching=False)
    warm = make_workload(replace(WorkloadSpec.from_args(args), num_prompts=2, seed=args.seed + 1))

    def params(lens: list[int]) -> list[SamplingParams]:
        return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lens]

    llm.generate(warm.prompts, params(warm.output_lens))
    cpu = CpuShare([os.getpid()]).start()
    start = time.perf_counter()
    outputs = llm.generate(work.prompts, params(work.output_lens), use_tqdm=True)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == work.output_tokens, (produced, work.output_tokens)
    return {
        "seconds": round(elapsed, 3),
        "output_tok_s": round(produced / elapsed, 2),
        "cpu": cpu.stop(),
    }


# ---- report --------------------------------------------------------------------------


def print_report(result: dict) -> None:
    serving, window = result["serving"], result["serving"]["window"]
    run = serving["whole_run"]
    print(
        f"\nmeasurement window {window['seconds']:.1f} s: {window['completed_requests']} requests "
        f"started and finished inside it"
    )
    print(f"  request throughput  {window['request_throughput']:10.3f} req/s")
    print(f"  output throughput   {window['output_tok_s']:10.2f} tok/s")
    print(f"  {'latency (ms)':18} {'p50':>9} {'p90':>9} {'p99':>9}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = window[f"{name}_s"]
        cells = "".join(f"{'-' if v is None else f'{v * 1000:.1f}':>10}" for v in row.values())
        print(f"  {name.upper():18}{cells}")
    print(
        f"whole run {run['seconds']:.1f} s: {run['succeeded']}/{run['requests']} requests ok, "
        f"{run['output_tokens']} output tokens, {run['output_tok_s']:.2f} tok/s"
    )
    print(f"errors: {serving['errors'] or 'none'}")
    print(f"CPU seconds during the timed run: {serving['cpu']}")
    if "offline" in result:
        off = result["offline"]
        print(f"offline generate(): {off['seconds']:.1f} s, {off['output_tok_s']:.2f} tok/s")
        print(f"CPU seconds during the offline run: {off['cpu']}")
        print(f"serving / offline output tok/s (whole run): {result['ratio']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="host:port of a running server")
    where.add_argument("--start-server", action="store_true", help="run one for this benchmark")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--concurrency", type=int, help="closed loop with this many workers")
    mode.add_argument("--request-rate", type=float, help="Poisson arrivals, requests/s")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds not counted (default 0)")
    p.add_argument(
        "--warmup-requests", type=int, default=0, help="untimed requests first (default 0)"
    )
    p.add_argument("--duration", type=float, default=None, help="measurement seconds")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline, s")
    add_workload_args(p, num_prompts=64)
    add_engine_args(p, "--start-server and --compare-offline", "default: --concurrency")
    p.add_argument("--compare-offline", action="store_true", help="also run engine.llm.LLM")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    if args.max_num_seqs is None:
        args.max_num_seqs = args.concurrency
    if args.compare_offline and args.concurrency is None:
        p.error("--compare-offline needs --concurrency: generate() is a closed loop")

    work = make_workload(WorkloadSpec.from_args(args))
    print(
        f"workload: {len(work.prompts)} prompts, {work.prompt_tokens} prompt tokens, "
        f"{work.output_tokens} output tokens"
    )
    result: dict = {**run_info(), "settings": vars(args) | {"json_out": str(args.json_out)}}
    result["workload"] = work.describe()
    if args.start_server:
        with started_server(args) as (target, pid, time_to_ready):
            print(f"server SERVING {time_to_ready:.1f} s after its start")
            result["time_to_ready_s"] = round(time_to_ready, 2)
            result["serving"] = asyncio.run(run_load(args, target, work, [pid]))
    else:  # the target's CPU time counts as "others" unless it is ours
        result["serving"] = asyncio.run(run_load(args, args.target, work, []))
    if args.compare_offline:
        result["offline"] = run_offline(args, work)
        serving_tok_s = result["serving"]["whole_run"]["output_tok_s"]
        result["ratio"] = round(serving_tok_s / result["offline"]["output_tok_s"], 3)
    print_report(result)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
