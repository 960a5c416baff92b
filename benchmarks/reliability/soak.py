"""Soak: minutes of Poisson load against one server, watched for drift.

    python benchmarks/reliability/soak.py --start-server --model DIR --max-num-seqs 32 \\
        --measure-capacity 30 --load 0.8 --minutes 3 --interval 15
    python benchmarks/reliability/soak.py --target HOST:PORT --metrics-url http://HOST:PORT/metrics \\
        --pid PID --rate 5 --minutes 60

Requests are the shared workload's prompts, over and over (benchmarks/workload.py; with
ignore_eos each produces its output length), sent as StreamGenerate and timed on the client
(serving.py's send()). `--measure-capacity S` first runs a closed loop of max_num_seqs
workers for S seconds and takes the requests per second it completes as the capacity; the
soak then runs at `--load` times that (else at `--rate`). Every `--interval` seconds one
line: the server's resident memory (its process and its children: an engine process), GPU
memory its processes hold (nvidia-smi, when there is one), KV use and running / waiting
requests from its /metrics, requests finished and failed in the interval, and TTFT and ITL
p50 / p99 of the requests finished in it. At the end, after the requests in flight finish:
a verdict on flatness, from the RSS slope (least squares, MiB per minute, over the second
half of the lines: growth that stops early is warm-up, a leak keeps its slope), the ITL
p50 of the last third of the lines against the first third, the errors, and the KV blocks
still used once idle.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.serving import (  # noqa: E402
    RequestRecord,
    Windows,
    add_engine_args,
    closed_loop,
    free_port,
    send,
    started_server,
    summarize,
    wait_ready,
)
from benchmarks.workload import (  # noqa: E402
    CpuShare,
    Workload,
    WorkloadSpec,
    add_workload_args,
    make_workload,
    run_info,
)
from pagedserve.v1 import inference_pb2_grpc  # noqa: E402
from tests.server_process import scrape_metrics  # noqa: E402

MIB = 2**20


def rss_bytes(pid: int) -> int:
    """Resident memory of pid and its descendants (an engine child process)."""
    total, pids = 0, [pid]
    while pids:
        p = pids.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile
    return total


def gpu_bytes(pid: int) -> int | None:
    """GPU memory held by pid's processes (nvidia-smi), None without a GPU."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    children = set(Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    used = [line.split(",") for line in out.strip().splitlines() if "," in line]
    return sum(int(m) * MIB for p, m in used if p.strip() in children | {str(pid)})


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


async def measure_capacity(stub, work: Workload, workers: int, seconds: float) -> float:
    """Requests per second a closed loop of `workers` completes in `seconds`."""
    start = time.perf_counter()
    windows = Windows(start, start, start + seconds)

    with tqdm(disable=True) as bar:
        records = await closed_loop(stub, work, workers, windows, bar, 600)
    window = summarize(records, windows)["window"]
    print(
        f"capacity: {window['request_throughput']:.2f} req/s with {workers} workers "
        f"({window['output_tok_s']:.0f} output tok/s) over {window['seconds']:.0f} s"
    )
    return window["request_throughput"]


class Soak:
    def __init__(self, args: argparse.Namespace, pid: int, metrics_url: str):
        self.args, self.pid, self.metrics_url = args, pid, metrics_url
        self.cpu = CpuShare([os.getpid(), pid]).start()  # since the last line
        self.finished: list[RequestRecord] = []  # since the last line
        self.lines: list[dict] = []
        self.errors = 0

    def sample(self, start: float) -> dict:
        """One interval's line, printed and kept."""
        done, self.finished = self.finished, []
        ok = [r for r in done if r.error is None]
        self.errors += len(done) - len(ok)
        itls = [gap for r in ok for gap in r.itls]
        metrics = scrape_metrics(self.metrics_url)
        cpu, self.cpu = self.cpu.stop(warn=False), CpuShare([os.getpid(), self.pid]).start()
        line = {
            "t": time.perf_counter() - start,
            "rss": rss_bytes(self.pid),
            "gpu": gpu_bytes(self.pid),
            "kv": metrics.get("pagedserve_kv_cache_usage_ratio", float("nan")),
            "running": metrics.get("pagedserve_num_requests_running", 0),
            "waiting": metrics.get("pagedserve_num_requests_waiting", 0),
            "done": len(ok),
            "failed": len(done) - len(ok),
            "ttft50": percentile_ms([r.ttft for r in ok], 50),
            "ttft99": percentile_ms([r.ttft for r in ok], 99),
            "itl50": percentile_ms(itls, 50),
            "itl99": percentile_ms(itls, 99),
            "others": cpu["others_s"] / max(cpu["machine_busy_s"], 1e-9),
        }
        gpu = "-" if line["gpu"] is None else f"{line['gpu'] / MIB:.0f}"
        print(
            f"{line['t']:7.0f} {line['rss'] / MIB:9.1f} {gpu:>8} {line['kv']:6.1%} "
            f"{line['running']:4.0f} {line['waiting']:4.0f} {line['done']:5} {line['failed']:4} "
            f"{line['ttft50']:8.1f} {line['ttft99']:8.1f} "
            f"{line['itl50']:7.1f} {line['itl99']:7.1f} "
            f"{line['others']:7.0%}",
            flush=True,
        )
        self.lines.append(line)
        return line

    async def run(self, stub, work: Workload, rate: float) -> None:
        args = self.args
        print(f"\nsoak: {args.minutes:g} min of Poisson arrivals at {rate:.2f} req/s")
        print(f"{'t (s)':>7} {'RSS MiB':>9} {'GPU MiB':>8} {'KV':>6} {'run':>4} {'wait':>4} "
              f"{'done':>5} {'fail':>4} {'TTFT p50':>8} {'p99':>8} {'ITL p50':>7} {'p99':>7} "
              f"{'others':>7}")  # fmt: skip
        rng = random.Random(args.seed)
        start = time.perf_counter()
        end = start + args.minutes * 60
        next_line, due, index, tasks = start + args.interval, start, 0, set()
        while due < end:
            while next_line <= due:  # a line is due before the next arrival
                await asyncio.sleep(max(0.0, next_line - time.perf_counter()))
                await asyncio.to_thread(self.sample, start)
                next_line += args.interval
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            task = asyncio.create_task(send(stub, work, index % len(work.prompts), 600))
            task.add_done_callback(lambda t: self.finished.append(t.result()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            index += 1
            due += rng.expovariate(rate)
        await asyncio.gather(*tasks)  # the requests in flight finish
        await asyncio.sleep(0.5)  # and the engine publishes its idle stats
        await asyncio.to_thread(self.sample, start)

    def verdict(self) -> bool:
        args = self.args
        body = self.lines[1:-1]  # the first line is the warm-up, the last one the drain
        minutes = np.array([line["t"] / 60 for line in body])
        rss = np.array([line["rss"] / MIB for line in body])

        def slope(part: slice) -> float:  # MiB per minute, least squares
            if len(minutes[part]) < 3:
                return float("nan")
            return float(np.polyfit(minutes[part], rss[part], 1)[0])

        # Growth that stops (allocator arenas, buffers sized by the first peak) is warm-up;
        # a leak keeps its slope in the second half.
        whole, late = slope(slice(None)), slope(slice(len(body) // 2, None))
        print(f"RSS slope over the run {whole:+.2f} MiB/min, over its second half {late:+.2f}")
        third = max(1, len(body) // 3)
        first = np.nanmean([line["itl50"] for line in body[:third]])
        last = np.nanmean([line["itl50"] for line in body[-third:]])
        kv_idle = self.lines[-1]["kv"]
        others = max(line["others"] for line in body)
        itl_check = f"ITL p50 last third / first third {last / first:.2f} (limit 1.25)"
        checks = {
            f"RSS slope, second half {late:+.2f} MiB/min (limit {args.rss_slope:g})": late
            <= args.rss_slope,
            f"errors {self.errors}": self.errors == 0,
            f"KV use once idle {kv_idle:.3f}": kv_idle == 0,
        }
        if others <= 0.1:
            checks[itl_check] = last / first <= 1.25
        else:  # latency then measures the neighbours as much as the server
            print(f"  n/a  {itl_check}: other processes took up to {others:.0%} of the CPU")
        for what, ok in checks.items():
            print(f"  {'ok  ' if ok else 'FAIL'} {what}")
        flat = all(checks.values())
        print(f"verdict: {'FLAT' if flat else 'NOT FLAT'} (RSS {rss[0]:.1f} -> {rss[-1]:.1f} MiB)")
        return flat


async def soak(args: argparse.Namespace, target: str, pid: int, metrics_url: str) -> bool:
    work = make_workload(WorkloadSpec.from_args(args))
    await wait_ready(target, args.server_timeout)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        rate = args.rate
        if args.measure_capacity:
            capacity = await measure_capacity(stub, work, args.workers, args.measure_capacity)
            rate = args.load * capacity
        runner = Soak(args, pid, metrics_url)
        await runner.run(stub, work, rate)
    return runner.verdict()


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="host:port of a running server (with --pid)")
    where.add_argument("--start-server", action="store_true", help="run one for the soak")
    p.add_argument("--pid", type=int, help="the running server's pid (for its RSS)")
    p.add_argument("--metrics-url", help="the running server's /metrics")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="Poisson arrivals, requests/s")
    load.add_argument("--measure-capacity", type=float, metavar="S", help="closed loop first")
    p.add_argument("--load", type=float, default=0.8, help="share of the measured capacity")
    p.add_argument("--workers", type=int, help="capacity loop workers (default max_num_seqs)")
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--interval", type=float, default=15.0, help="s between lines")
    p.add_argument("--rss-slope", type=float, default=1.0, help="flat: |MiB/min| at most")
    add_workload_args(p, num_prompts=1024)
    add_engine_args(p, "--start-server", "default: 32", max_num_seqs=32)
    args = p.parse_args()
    args.workers = args.workers or args.max_num_seqs
    print(run_info())
    if args.start_server:
        metrics_port = free_port()
        extra = ("--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port))
        with started_server(args, extra) as (target, pid, _):
            flat = asyncio.run(soak(args, target, pid, f"http://127.0.0.1:{metrics_port}/metrics"))
    else:
        if args.pid is None or args.metrics_url is None:
            p.error("--target needs --pid and --metrics-url")
        flat = asyncio.run(soak(args, args.target, args.pid, args.metrics_url))
    sys.exit(0 if flat else 1)


if __name__ == "__main__":
    main()
