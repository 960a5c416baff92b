"""Where a GPU step's time goes: host phases timed per step, plus a cProfile of the run.

    python benchmarks/gpu_profile.py [--shape qwen3-0.6b] [--cprofile | --kernels]

Runs gpu_bench's offline workload and times, for every engine step, the scheduler, the
runner (input preparation, launch, the wait for the GPU at the sampled-token read) and the
token post-processing (detokenize, stops, events). A step whose runner time is mostly the
wait is GPU-bound; one whose time is mostly host phases is bound by Python. A timeline
then shows each window of 100 steps: its mean step time and what the steps held. --kernels
instead profiles 20 steady decode steps with torch.profiler: GPU time by kernel; --prefill
the workload's first steps, until every prompt is prefilled (with --cprofile, the host
under cProfile); --run-kernels the whole workload: GPU time by kernel, the share of the
run the GPU was busy, and its idle stretches by what the host was doing meanwhile (an
engine phase or Python's collector).
"""

from __future__ import annotations

import argparse
import bisect
import cProfile
import functools
import gc
import io
import pstats
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_bench import NANO_VLLM_WORKLOAD, SHAPES, write_random_model  # noqa: E402
from benchmarks.workload import make_workload  # noqa: E402


def timed(totals: dict[str, float], name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/pagedserve-bench-models"))
    p.add_argument("--cprofile", action="store_true", help="also profile the host (slower)")
    p.add_argument("--kernels", action="store_true", help="GPU time by kernel, 20 decode steps")
    p.add_argument(
        "--prefill",
        action="store_true",
        help="GPU time by kernel over the workload's first steps, until every prompt is prefilled",
    )
    p.add_argument(
        "--run-kernels",
        action="store_true",
        help="GPU time by kernel over the whole workload, and the share of it the GPU was busy",
    )
    p.add_argument(
        "--rows",
        type=int,
        default=None,
        help="with --kernels: decode this many sequences (128-token prompts), not the workload",
    )
    args = p.parse_args()

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    work = make_workload(NANO_VLLM_WORKLOAD)
    model_dir = write_random_model(SHAPES[args.shape], args.model_dir / args.shape)
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", max_num_batched_tokens=16384)
    engine = llm.engine
    llm.generate([work.prompts[0][:16]], SamplingParams(max_tokens=8))  # warm-up

    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in work.output_lens
    ]
    if args.prefill:
        profile_prefill(engine, work, params, with_cprofile=args.cprofile)
        return
    if args.run_kernels:
        profile_run_kernels(llm, work, params)
        return
    if args.kernels:
        if args.rows is not None:  # batch-1 latency's shape: short prompts, long outputs
            prompts = [p[:128] for p in work.prompts[: args.rows]]
            params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=1024)] * args.rows
            work = replace(work, prompts=prompts)
        profile_kernels(engine, work, params)
        return
    totals: dict[str, float] = defaultdict(float)
    engine.scheduler.schedule = timed(totals, "schedule", engine.scheduler.schedule)
    steps = record_steps(engine)
    engine._append_token = timed(totals, "append tokens (detok, stops)", engine._append_token)
    engine.step = timed(totals, "engine.step (all)", engine.step)
    gc_started = [0.0]

    def time_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        elif steps:
            steps[-1].gc_s += time.perf_counter() - gc_started[0]

    gc.callbacks.append(time_gc)

    profiler = cProfile.Profile() if args.cprofile else None
    torch.cuda.synchronize()
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    llm.generate(work.prompts, params)
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - start
    gc.callbacks.remove(time_gc)
    totals["runner.execute (queue a step)"] = sum(s.execute_s for s in steps)
    totals["runner.collect (wait, read back)"] = sum(s.collect_s for s in steps)

    print(f"{elapsed:.2f} s, {len(steps)} steps, {elapsed / len(steps) * 1e3:.2f} ms per step")
    for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:32s} {seconds:7.2f} s  {seconds / len(steps) * 1e3:7.3f} ms/step")
    print_timeline(steps, window=50)
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(35)
        print(out.getvalue())


def profile_kernels(engine, work, params) -> None:
    """Step the engine into steady decoding (every prompt prefilled), profile 20 steps on
    the GPU, then 100 more on the host (cProfile)."""
    for i, (prompt, sp) in enumerate(zip(work.prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, sp)
    for _ in range(100):
        engine.step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(20):
            engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(100):
        engine.step()
    profiler.disable()
    print(f"100 steps in {time.perf_counter() - start:.3f} s under cProfile")
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(30)
    print(out.getvalue())


def profile_run_kernels(llm, work, params) -> None:
    """The whole workload under torch.profiler: GPU time by kernel and by kind, the union
    of kernel intervals against the run's wall time, and the idle stretches between
    kernels by length (launch gaps inside graphs are a few us, waits for the host longer),
    the long ones set against the host's phases (annotate_host_phases). The profiler
    records the host's torch ops too and slows it, so the long stretches are an upper
    bound; kernel times are the GPU's own. One unprofiled run goes first: an engine's first
    pass over the workload pays one-time costs (cuBLAS picking kernels for new row counts,
    first launches of CUDA graphs) that the benchmark's median run does not."""
    # Token ids shifted by one, so the profiled run finds nothing in the prefix cache.
    llm.generate([[token + 1 for token in prompt] for prompt in work.prompts], params)
    undo = annotate_host_phases(llm.engine)
    torch.cuda.synchronize()
    allocator_before = allocator_counts()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    try:
        with torch.profiler.profile(activities=activities) as prof:
            start = time.perf_counter()
            llm.generate(work.prompts, params)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
    finally:
        undo()
    after = allocator_counts()
    print(
        "allocator calls during the run (a cudaMalloc/cudaFree or pinned alloc stalls the host):",
        {name: after[name] - allocator_before[name] for name in after},
    )
    kernels, phases, host_ops = [], [], []
    main_thread = None
    for event in prof.events():
        interval = (event.time_range.start, event.time_range.end, event.name)
        on_host = event.device_type == torch.autograd.DeviceType.CPU
        if event.name.startswith(PHASE_PREFIX):  # on the GPU too: the span of its kernels
            if on_host:
                phases.append(interval)
                main_thread = event.thread
        elif on_host:
            host_ops.append((event.thread, interval))
        elif event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append(interval)
    host_ops = [interval for thread, interval in host_ops if thread == main_thread]
    kernels.sort()
    busy_us, reach = 0.0, float("-inf")  # union of [start, end) intervals
    # Idle stretches by length: a few us between kernels of a graph is launch latency;
    # longer ones are the GPU waiting for the host to queue the next step.
    gaps = {"< 2 us": [0, 0.0], "2-10 us": [0, 0.0], "10-100 us": [0, 0.0], ">= 100 us": [0, 0.0]}
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_kind: dict[str, float] = defaultdict(float)
    for begin, end, name in kernels:
        if begin > reach > float("-inf"):
            gap = begin - reach
            length = next(k for k, top in zip(gaps, (2, 10, 100, float("inf"))) if gap < top)
            gaps[length][0] += 1
            gaps[length][1] += gap
        busy_us += max(0.0, end - max(begin, reach))
        reach = max(reach, end)
        by_name[name][0] += 1
        by_name[name][1] += end - begin
        by_kind[kernel_kind(name)] += end - begin
    span_us = reach - kernels[0][0]
    print(
        f"whole run: {elapsed:.3f} s wall under the profiler; {len(kernels)} kernels over"
        f" {span_us / 1e6:.3f} s from the first to the last; GPU busy {busy_us / 1e6:.3f} s"
        f" ({busy_us / span_us:.1%}), idle {(span_us - busy_us) / 1e6:.3f} s"
    )
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<12} {us / 1e6:7.3f} s  {us / busy_us:6.1%}")
    print("idle stretches between kernels, by length:")
    for length, (count, us) in gaps.items():
        print(f"  {length:<10} {count:8d} gaps  {us / 1e6:7.3f} s")
    print_long_gaps_by_host_phase(kernels, phases, host_ops)
    print(f"{'count':>8} {'total ms':>10} {'mean us':>8}  kernel")
    for name, (count, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]:
        print(f"{count:8d} {us / 1e3:10.1f} {us / count:8.1f}  {name[:110]}")


PHASE_PREFIX = "host:"
LONG_GAP_US = 100.0


def annotate_host_phases(engine):
    """Mark the engine's host phases, and Python's collector, as profiler ranges (named
    PHASE_PREFIX + phase) so that idle stretches of the GPU can be set against them.
    Returns a function that undoes it."""
    import engine.runner as runner_module

    runner = engine.runner
    wrapped = {
        (engine.scheduler, "schedule"): "schedule",
        (runner, "execute"): "execute",
        # execute's parts (the innermost phase names an idle stretch)
        (runner, "_flatten"): "execute: step inputs",
        (runner, "_sampling_tensors"): "execute: sampling tensors",
        (runner_module, "upload"): "execute: upload",
        (runner.attn, "plan"): "execute: attention plan",
        (runner.attn, "plan_graph"): "execute: graph attention plan",
        (runner.model, "compute_logits"): "execute: LM head",
        (runner, "_sample"): "execute: sample",
        (runner, "collect"): "collect (wait for the GPU)",
        (engine, "_collect"): "collect + token processing",
    }
    if runner.graphs is not None:
        wrapped[(runner.graphs, "run")] = "execute: graph replay"
    originals = {target: getattr(*target) for target in wrapped}
    for (owner, attr), phase in wrapped.items():
        fn = originals[(owner, attr)]
        setattr(owner, attr, _in_range(PHASE_PREFIX + phase, fn))
    collecting: list = []
    # generation -> [passes, seconds, longest pause, objects it held at its longest]
    passes: dict[int, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0])

    def on_gc(event: str, info: dict) -> None:
        generation = info["generation"]
        if event == "start":
            collecting.append(
                (
                    time.perf_counter(),
                    torch.profiler.record_function(f"{PHASE_PREFIX}gc gen{generation}"),
                )
            )
            collecting[-1][1].__enter__()
        elif collecting:
            started, annotation = collecting.pop()
            annotation.__exit__(None, None, None)
            pause = time.perf_counter() - started
            tally = passes[generation]
            tally[0] += 1
            tally[1] += pause
            if pause > tally[2]:
                tally[2] = pause
                tally[3] = len(gc.get_objects()) if generation == 2 else 0

    gc.callbacks.append(on_gc)

    def undo() -> None:
        gc.callbacks.remove(on_gc)
        for (owner, attr), fn in originals.items():
            setattr(owner, attr, fn)
        print(
            "Python's collector during the run (frozen at start-up:",
            gc.get_freeze_count(),
            "objects):",
        )
        for generation, (count, seconds, longest, objects) in sorted(passes.items()):
            print(
                f"  gen{generation}: {count:5d} passes, {seconds * 1e3:8.1f} ms, longest"
                f" {longest * 1e3:6.2f} ms"
                + (f" (objects tracked after it: {objects})" if generation == 2 else "")
            )

    return undo


def _in_range(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return wrapper


def allocator_counts() -> dict[str, int]:
    """torch's device and pinned-host allocator counters that mean a call into the driver."""
    device = torch.cuda.memory_stats()
    counts = {
        name: device.get(name, 0)
        for name in (
            "num_alloc_retries",
            "num_device_alloc",
            "num_device_free",
            "num_sync_all_streams",
        )
    }
    host = torch.cuda.host_memory_stats()
    counts.update({name: host.get(name, 0) for name in ("num_host_alloc", "num_host_free")})
    return counts


def innermost_segments(ranges: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """One thread's nested ranges as a timeline of [start, end) segments, each named by the
    innermost range holding it (a range that outlasts its parent is cut at the parent's end)."""
    ranges = sorted(ranges, key=lambda r: (r[0], -r[1]))
    segments: list[tuple[float, float, str]] = []
    stack: list[tuple[float, str]] = []  # (end, name), innermost last
    t = float("-inf")

    def close_until(moment: float) -> None:
        nonlocal t
        while stack and stack[-1][0] <= moment:
            end, name = stack.pop()
            if end > t:
                segments.append((t, end, name))
                t = end

    for begin, end, name in ranges:
        close_until(begin)
        if stack:
            if begin > t:
                segments.append((t, begin, stack[-1][1]))
            end = min(end, stack[-1][0])
        t = max(t, begin)
        stack.append((end, name))
    close_until(float("inf"))
    return segments


def print_long_gaps_by_host_phase(
    kernels: list[tuple[float, float, str]],
    phases: list[tuple[float, float, str]],
    host_ops: list[tuple[float, float, str]],
) -> None:
    """The GPU's idle stretches of >= LONG_GAP_US, by what the host was doing meanwhile: the
    innermost annotated phase, then the innermost torch op or CUDA runtime call (within the
    phases); and by where in the run they fell (the engine step they ended in)."""
    steps = sorted(begin for begin, _, name in phases if name == PHASE_PREFIX + "schedule")
    by_window: dict[int, list[float]] = defaultdict(lambda: [0, 0.0])
    gaps, reach = [], float("-inf")
    for begin, end, _ in kernels:
        if reach > float("-inf") and begin - reach >= LONG_GAP_US:
            gaps.append((reach, begin))
            window = (bisect.bisect_right(steps, begin) - 1) // 50 * 50
            by_window[window][0] += 1
            by_window[window][1] += begin - reach
        reach = max(reach, end)
    views = {
        "phase": innermost_segments(phases),
        "op or CUDA call, within the phases": innermost_segments(phases + host_ops),
    }
    for view, segments in views.items():
        starts = [segment[0] for segment in segments]
        by_name: dict[str, float] = defaultdict(float)
        for gap_start, gap_end in gaps:
            covered = 0.0
            i = max(0, bisect.bisect_right(starts, gap_start) - 1)
            while i < len(segments) and segments[i][0] < gap_end:
                overlap = min(gap_end, segments[i][1]) - max(gap_start, segments[i][0])
                if overlap > 0:
                    by_name[segments[i][2].removeprefix(PHASE_PREFIX)] += overlap
                    covered += overlap
                i += 1
            by_name["(outside the steps)"] += gap_end - gap_start - covered
        total = sum(by_name.values())
        print(f"idle stretches >= {LONG_GAP_US:.0f} us, {total / 1e6:.3f} s, by the host's {view}:")
        for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:25]:
            print(f"  {name[:60]:<60} {us / 1e3:8.1f} ms")
    print("  ... by engine step (window of 50):")
    for window, (count, us) in sorted(by_window.items()):
        print(f"  {window:5d}+  {count:5d} stretches  {us / 1e3:8.1f} ms")


def kernel_kind(name: str) -> str:
    """A kernel's kind, from its name: attention (flashinfer's, and the engine's Triton
    decode), GEMM (cuBLAS/CUTLASS), the engine's other Triton kernels, or other (copies,
    fills, torch's elementwise ops)."""
    lowered = name.lower()
    attention = ("flashinfer", "batchdecode", "batchprefill", "mergestate", "_decode_chunk")
    if any(part in lowered for part in attention):
        return "attention"
    if any(part in lowered for part in ("gemm", "nvjet", "xmma", "cutlass", "splitk")):
        return "gemm"
    if (lowered.startswith("_") and "kernel" in lowered) or "race" in lowered:
        return "triton"
    return "other"


def profile_prefill(engine, work, params, with_cprofile: bool) -> None:
    """The workload's steps from the first until every prompt has been prefilled: twice with
    each step's host phases timed (and the host under cProfile if asked), then under
    torch.profiler: GPU time by kernel. Between passes the batch is aborted, and each pass
    shifts the prompts' token ids, so nothing is a prefix-cache hit."""

    def prefilling() -> bool:
        scheduler = engine.scheduler
        return bool(scheduler.waiting) or any(
            s.num_uncomputed_tokens > 1 for s in scheduler.running
        )

    def add_all(shift: int) -> list[str]:
        ids = []
        for i, (prompt, sp) in enumerate(zip(work.prompts, params, strict=True)):
            ids.append(f"shift{shift}-{i}")
            engine.add_request(ids[-1], [t + shift for t in prompt], sp)
        return ids

    # Pass 1, run twice (the engine's first prefill-sized steps, then the same again on
    # other prompts): host phases (and cProfile).
    for shift, label in ((0, "first"), (2, "again")):
        unwrapped = engine.scheduler.schedule, engine.runner.execute, engine.runner.collect
        steps = record_steps(engine)
        ids = add_all(shift)
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        start = time.perf_counter()
        if with_cprofile:
            profiler.enable()
        while prefilling():
            engine.step()
        engine.step()
        torch.cuda.synchronize()
        profiler.disable()
        elapsed = time.perf_counter() - start
        engine.scheduler.schedule, engine.runner.execute, engine.runner.collect = unwrapped
        under = " (host under cProfile)" if with_cprofile else ""
        print(f"prefill ({label}): {len(steps)} steps in {elapsed:.3f} s{under}")
        print("step  decode rows  prefill tokens  wall ms  execute ms  collect ms  gpu ms")
        for i, (step, following) in enumerate(zip(steps, steps[1:], strict=False)):
            print(
                f"{i:4d} {step.decode_rows:12d} {step.prefill_tokens:15d}"
                f" {(following.scheduled_at - step.scheduled_at) * 1e3:8.2f}"
                f" {step.execute_s * 1e3:11.2f} {step.collect_s * 1e3:11.2f}"
                f" {step.gpu_start.elapsed_time(following.gpu_start):7.2f}"
            )
        if with_cprofile:
            out = io.StringIO()
            stats = pstats.Stats(profiler, stream=out)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(45)
            print(out.getvalue())
        for request_id in ids:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests:
            engine.step()

    # Pass 2: GPU time by kernel.
    add_all(1)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        while prefilling():
            engine.step()
        engine.step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))


@dataclass
class StepRecord:
    scheduled_at: float  # perf_counter when the scheduler returned
    decode_rows: int
    prefill_tokens: int
    gpu_start: torch.cuda.Event = field(
        default_factory=lambda: torch.cuda.Event(enable_timing=True)
    )
    execute_s: float = 0.0
    collect_s: float = 0.0  # the collect that ran in this step's engine.step()
    gc_s: float = 0.0  # Python's garbage collector, from this step's schedule to the next


def record_steps(engine) -> list[StepRecord]:
    """Wrap the engine's scheduler and its runner's execute and collect so that every step
    appends a StepRecord (what it held, when it was scheduled, its host phases, an event at
    its GPU start) to the list returned. Undo by restoring the three attributes."""
    steps: list[StepRecord] = []
    runner = engine.runner
    schedule, execute, collect = engine.scheduler.schedule, runner.execute, runner.collect

    def recorded_schedule():
        out = schedule()
        decodes = sum(c.num_tokens == 1 for c in out.chunks)
        steps.append(StepRecord(time.perf_counter(), decodes, out.num_tokens - decodes))
        return out

    def recorded_execute(*args, **kwargs):
        steps[-1].gpu_start.record()
        start = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            steps[-1].execute_s = time.perf_counter() - start

    def recorded_collect(launched):
        start = time.perf_counter()
        try:
            return collect(launched)
        finally:
            steps[-1].collect_s += time.perf_counter() - start

    engine.scheduler.schedule = recorded_schedule
    runner.execute = recorded_execute
    runner.collect = recorded_collect
    return steps


def print_timeline(steps: list[StepRecord], window: int) -> None:
    """Per window of steps, in ms per step: wall time between schedules, the GPU's time
    between step starts, and the host's execute / collect / GC shares."""
    steps = [s for s in steps if s.execute_s]  # the last schedule found nothing to run
    print("steps    wall    gpu  execute  collect     gc  decode rows  prefill tokens")
    for first in range(0, len(steps) - 1, window):
        part = steps[first : first + window + 1]
        n = len(part) - 1
        wall = (part[-1].scheduled_at - part[0].scheduled_at) / n * 1e3
        gpu = part[0].gpu_start.elapsed_time(part[-1].gpu_start) / n

        execute, collect, gc_ms, decodes, prefill = (
            sum(values) / n
            for values in zip(
                *(
                    (
                        p.execute_s * 1e3,
                        p.collect_s * 1e3,
                        p.gc_s * 1e3,
                        p.decode_rows,
                        p.prefill_tokens,
                    )
                    for p in part[:-1]
                )
            )
        )
        print(
            f"{first:5d}+ {wall:6.2f} {gpu:6.2f} {execute:8.2f} {collect:8.2f} {gc_ms:6.2f}"
            f" {decodes:12.1f} {prefill:15.1f}"
        )


if __name__ == "__main__":
    main()
