"""Engine placement: the engine loop on a thread or in a child process (AsyncEngine's two cores).

    python benchmarks/engine_placement.py --concurrency 16 64 \\
        --json-out benchmarks/results/cpu-engine-placement-smollm2.json

Both placements serve the same asyncio front end: a closed loop of `--concurrency` workers
over the serving workload (seeded token-id prompts, ignore_eos), timing each event as the
loop receives it. Beside them a ticker sleeps `--tick-ms` (1 ms) at a time and records how
late it wakes: that lag is what any other work on the loop (gRPC, health checks) would wait.
The ticker is load too (1,000 wakeups a second); `--tick-ms 0` measures without it.

- thread: AsyncEngine(EngineThread(...)): the engine loop and the event loop share one
  interpreter, so they take turns holding the GIL. The LLMEngine is built on a
  short-lived thread, so the engine thread owns the process's only OpenMP pool: a pool
  left on a live thread (the loop's, an executor's) slows every step (benchmarks/RESULTS.md
  as of 9361dce, "Serving over gRPC vs the offline engine on the CPU").
- process: AsyncEngine(EngineProcess(...)) (engine/serving/engine_process.py): the loop in a
  spawned child; requests go in and each drain's or step's LoopOutput comes back over
  multiprocessing queues.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving import RequestRecord, percentiles  # noqa: E402
from benchmarks.workload import (  # noqa: E402
    CpuShare,
    Workload,
    WorkloadSpec,
    add_workload_args,
    make_workload,
    run_info,
)
from engine.config import EngineConfig, engine_config_from_flat  # noqa: E402
from engine.core.engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.serving.async_engine import AsyncEngine, EngineThread  # noqa: E402
from engine.serving.engine_process import EngineProcess  # noqa: E402


def build_on_own_thread(config: EngineConfig) -> LLMEngine:
    built: list[LLMEngine] = []
    thread = threading.Thread(target=lambda: built.append(LLMEngine(config)))
    thread.start()
    thread.join()
    return built[0]


# ---- the shared front end --------------------------------------------------------------


async def ticker(period: float, lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(time.perf_counter() - start - period)


def lag_summary(lags: list[float]) -> dict:
    if not lags:
        return {}
    ms = {k: round(v * 1000, 3) for k, v in percentiles(lags).items()}
    return ms | {"max": round(max(lags) * 1000, 3), "ticks": len(lags)}


async def run_requests(
    engine: AsyncEngine, work: Workload, concurrency: int, tag: str, progress: bool
) -> list[RequestRecord]:
    indices = iter(range(len(work.prompts)))
    records: list[RequestRecord] = []
    bar = tqdm(total=len(work.prompts), desc=tag, unit="req", disable=not progress)

    async def worker() -> None:
        for index in indices:
            record = RequestRecord(work.output_lens[index], time.perf_counter())
            params = SamplingParams(
                max_tokens=work.output_lens[index], temperature=0.0, ignore_eos=True
            )
            stream = await engine.submit(f"{tag}-{index}", work.prompts[index], params)
            async for event in stream:
                if event.token_ids:
                    record.message_times.append(time.perf_counter())
                    record.message_tokens.append(len(event.token_ids))
                if event.error:
                    record.error = event.error
            record.end = time.perf_counter()
            records.append(record)
            bar.update()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    bar.close()
    return records


async def measure(
    placement: str, config: EngineConfig, work: Workload, warm: Workload, tick_s: float
) -> dict:
    pids = [os.getpid()]
    if placement == "thread":
        engine = AsyncEngine(EngineThread(build_on_own_thread(config)))
        engine.start()
    else:
        engine = AsyncEngine(EngineProcess(config))
        await asyncio.to_thread(engine.start)  # the model loads
        pids.append(engine.core.pid)
    await run_requests(engine, warm, 2, f"{placement}-warm", progress=False)

    lags: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(ticker(tick_s, lags, stop)) if tick_s > 0 else None
    cpu = CpuShare(pids).start()
    start = time.perf_counter()
    records = await run_requests(engine, work, config.scheduler.max_num_seqs, placement, True)
    elapsed = time.perf_counter() - start
    cpu_share = cpu.stop()
    stop.set()
    if tick is not None:
        await tick
    engine.shutdown(timeout=30)

    errors = [r.error for r in records if r.error]
    tokens = sum(r.tokens for r in records)
    assert not errors and tokens == work.output_tokens, (errors[:3], tokens, work.output_tokens)
    return {
        "placement": placement,
        "tick_ms": tick_s * 1000,
        "seconds": round(elapsed, 3),
        "output_tok_s": round(tokens / elapsed, 2),
        "ttft_s": percentiles([r.ttft for r in records]),
        "itl_s": percentiles([x for r in records for x in r.itls]),
        "loop_lag_ms": lag_summary(lags),
        "cpu": cpu_share,
    }


async def idle_lag(tick_s: float, seconds: float) -> dict:
    """The ticker on an otherwise idle loop: the floor the placements are measured against."""
    lags: list[float] = []
    stop = asyncio.Event()
    tick = asyncio.create_task(ticker(tick_s, lags, stop))
    await asyncio.sleep(seconds)
    stop.set()
    await tick
    return lag_summary(lags)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--placements", nargs="+", choices=["thread", "process"])
    p.add_argument("--repeats", type=int, default=1, help="runs of each; the order alternates")
    p.add_argument("--tick-ms", type=float, default=1.0, help="ticker period; 0: no ticker")
    p.add_argument("--model", default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    add_workload_args(p, num_prompts=64)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    placements = args.placements or ["thread", "process"]
    spec = WorkloadSpec.from_args(args)
    work = make_workload(spec)
    warm = make_workload(replace(spec, num_prompts=2, seed=spec.seed + 1))
    tick_s = args.tick_ms / 1000

    result: dict = {**run_info(), "workload": work.describe()}
    if tick_s > 0:
        result["idle_loop_lag_ms"] = asyncio.run(idle_lag(tick_s, 3.0))
    runs = []
    for concurrency in args.concurrency:
        config = engine_config_from_flat(
            model=args.model,
            max_num_seqs=concurrency,  # the batch occupancy the closed loop keeps
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,
        )
        for repeat in range(args.repeats):
            # Alternate the order, so a slow spell on a shared machine hits both placements.
            for placement in placements if repeat % 2 == 0 else placements[::-1]:
                run = asyncio.run(measure(placement, config, work, warm, tick_s))
                runs.append({"concurrency": concurrency, **run})
                print(format_run(runs[-1]))
    result["runs"] = runs
    result["summary"] = summarize(runs)
    for row in result["summary"]:
        print(row)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


def format_run(run: dict) -> str:
    lag = run["loop_lag_ms"]
    lag_text = "no ticker"
    if lag:
        lag_text = f"loop lag p50/p99/max {lag['p50']:.2f}/{lag['p99']:.2f}/{lag['max']:.1f} ms"
    return (
        f"c={run['concurrency']:<3} {run['placement']:8} {run['seconds']:7.1f} s "
        f"{run['output_tok_s']:7.2f} tok/s  TTFT p50 {run['ttft_s']['p50'] * 1000:7.0f} ms  "
        f"ITL p50/p99 {run['itl_s']['p50'] * 1000:5.0f}/{run['itl_s']['p99'] * 1000:5.0f} ms  "
        f"{lag_text}  CPU s {run['cpu']}"
    )


def summarize(runs: list[dict]) -> list[dict]:
    """Median output tok/s and loop lag p99 per (concurrency, placement) over the repeats."""
    keys = sorted({(r["concurrency"], r["placement"]) for r in runs})
    rows = []
    for c, placement in keys:
        mine = [r for r in runs if (r["concurrency"], r["placement"]) == (c, placement)]
        row = {"concurrency": c, "placement": placement, "runs": len(mine)}
        row["median_output_tok_s"] = round(statistics.median(r["output_tok_s"] for r in mine), 2)
        if mine[0]["loop_lag_ms"]:
            lag_p99 = statistics.median(r["loop_lag_ms"]["p99"] for r in mine)
            row["median_loop_lag_p99_ms"] = round(lag_p99, 3)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
