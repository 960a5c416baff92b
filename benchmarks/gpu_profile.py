"""Where a GPU step's time goes: host phases timed per step, plus a cProfile of the run.

    python benchmarks/gpu_profile.py [--shape qwen3-0.6b] [--cprofile | --kernels]

Runs gpu_bench's offline workload and times, for every engine step, the scheduler, the
runner (input preparation, launch, the wait for the GPU at the sampled-token read) and the
token post-processing (detokenize, stops, events). A step whose runner time is mostly the
wait is GPU-bound; one whose time is mostly host phases is bound by Python. --kernels
instead profiles 20 steady decode steps with torch.profiler: GPU time by kernel.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import sys
import time
from collections import defaultdict
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
    args = p.parse_args()

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    work = make_workload(NANO_VLLM_WORKLOAD)
    model_dir = write_random_model(SHAPES[args.shape], args.model_dir / args.shape)
    llm = LLM(str(model_dir), device="cuda", dtype="bfloat16", max_num_batched_tokens=16384)
    engine, runner = llm.engine, llm.engine.runner
    llm.generate([work.prompts[0][:16]], SamplingParams(max_tokens=8))  # warm-up

    params = [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in work.output_lens
    ]
    if args.kernels:
        profile_kernels(engine, work, params)
        return
    totals: dict[str, float] = defaultdict(float)
    engine.scheduler.schedule = timed(totals, "schedule", engine.scheduler.schedule)
    runner.execute = timed(totals, "runner.execute (queue a step)", runner.execute)
    runner.collect = timed(totals, "runner.collect (wait, read back)", runner.collect)
    engine._append_token = timed(totals, "append tokens (detok, stops)", engine._append_token)
    steps = [0]
    engine.step = timed(totals, "engine.step (all)", _counting(engine.step, steps))

    profiler = cProfile.Profile() if args.cprofile else None
    torch.cuda.synchronize()
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    llm.generate(work.prompts, params)
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - start

    print(f"{elapsed:.2f} s, {steps[0]} steps, {elapsed / steps[0] * 1e3:.2f} ms per step")
    for name, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:32s} {seconds:7.2f} s  {seconds / steps[0] * 1e3:7.3f} ms/step")
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(35)
        print(out.getvalue())


def profile_kernels(engine, work, params) -> None:
    """Step the engine into steady decoding (every prompt prefilled), then profile 20 steps."""
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


def _counting(fn, counter: list[int]):
    def wrapper(*args, **kwargs):
        counter[0] += 1
        return fn(*args, **kwargs)

    return wrapper


if __name__ == "__main__":
    main()
