"""The engine's host work per step: what the GPU waits for whenever Python is the bottleneck.

    python benchmarks/host_overhead.py [--repeats 3] [--json-out result.json]

Runs gpu_bench's offline workload (nano-vllm's: 256 prompts of 100-1024 tokens, 100-1024
output tokens each) on the CPU, through a model of one tiny layer with random weights, and
times each engine step with the model's forward, its LM head and the sampler taken out.
What is left is the Python the engine runs per step on any device: the scheduler, the
step's inputs, the sampling rows, and the token post-processing (detokenize, stops,
events). On the GPU that work runs beside the device's (async scheduling); wherever it
takes longer than a step's kernels the GPU idles.

Greedy sampling by default: the CPU's random sampler over the vocabulary would set the run
time, and the host work around it is the same. The vocabulary size changes the model's
time, not the host's: the default keeps CPU runs short.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_bench import NANO_VLLM_WORKLOAD, Shape, write_random_model  # noqa: E402
from benchmarks.workload import make_workload, run_info  # noqa: E402

# A Qwen3 of one narrow layer: the model's size changes its compute, not the host's work.
TINY_QWEN3 = Shape("Qwen3ForCausalLM", "qwen3", 64, 1, 2, 1, 32, 128, 16384, True)

# The parts of a step that are not the engine's host work: model compute on the CPU
# (launches on a GPU), and the attention backend's per-step metadata, which each device's
# backend builds its own way (flashinfer's plan on a GPU, padded block tables here).
DEVICE_WORK = (
    "model forward",
    "LM head",
    "sampler",
    "attention metadata",
    "attention plan",
    "batch tables",
)


def timed(totals: dict[str, float], name: str, fn):
    """fn, adding the seconds each call takes to totals[name]."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    return wrapper


def instrument(engine) -> dict[str, float]:
    """Time the engine's phases; returns the totals the timed calls add to (seconds).
    Phases an engine does not have are skipped, so engines of different layouts compare."""
    totals: dict[str, float] = defaultdict(float)
    runner = engine.runner
    batch = getattr(runner, "batch", None)
    wrapped = [
        (engine, "step", "step"),
        (engine.scheduler, "schedule", "schedule"),
        (engine, "_plan", "step plan"),  # the persistent-batch engine's host arrays
        (engine, "_sample_rows", "sample rows"),  # the earlier layout's
        (runner, "_flatten", "step inputs"),
        (runner, "_sampling_tensors", "sampling tensors"),
        (engine, "_collect", "collect and post-process"),
        (runner.model, "forward", "model forward"),
        (runner.model, "compute_logits", "LM head"),
        (runner, "sampler", "sampler"),
        (runner, "_eager_metadata", "attention metadata"),
        (runner.attn, "plan", "attention plan"),
        (batch, "apply", "batch tables"),  # device work: the tables' writes and reads
        (batch, "inputs", "batch tables"),
        (batch, "write_tokens", "batch tables"),
    ]
    time_parts(totals, wrapped)
    return totals


def time_parts(totals: dict[str, float], parts: list[tuple]) -> Callable[[], None]:
    """Wrap each (owner, attribute, name) the owner has with timed(); returns what puts
    the originals back. Parts an engine does not have are skipped."""
    present = [(owner, attr, name) for owner, attr, name in parts if hasattr(owner, attr)]
    originals = [getattr(owner, attr) for owner, attr, _ in present]
    for owner, attr, name in present:
        setattr(owner, attr, timed(totals, name, getattr(owner, attr)))

    def restore() -> None:
        for (owner, attr, _), original in zip(present, originals, strict=True):
            setattr(owner, attr, original)

    return restore


def run_once(llm, work, params, totals: dict[str, float], shift: int) -> dict:
    """One run of the workload, its prompt ids shifted by `shift` (as gpu_bench does) so
    that no run hits the prefix cache an earlier one filled."""
    engine = llm.engine
    totals.clear()
    steps_before = engine.num_steps
    prompts = [[token + shift for token in prompt] for prompt in work.prompts]
    llm.generate(prompts, params, use_tqdm=True)
    steps = engine.num_steps - steps_before
    host = totals["step"] - sum(totals[name] for name in DEVICE_WORK)
    per_step_ms = {name: round(seconds / steps * 1e3, 4) for name, seconds in totals.items()}
    return {"steps": steps, "host_ms_per_step": round(host / steps * 1e3, 4), **per_step_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/pagedserve-bench-models"))
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument(
        "--max-out",
        type=int,
        default=NANO_VLLM_WORKLOAD.max_out,
        help="shorter outputs for a quicker run (the workload's lengths, capped)",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    work = make_workload(NANO_VLLM_WORKLOAD)
    work = replace(work, output_lens=[min(n, args.max_out) for n in work.output_lens])
    model_dir = write_random_model(TINY_QWEN3, args.model_dir / "qwen3-1x64")
    # A pool the whole workload fits in at once, as on the H200: no preemption.
    llm = LLM(
        str(model_dir),
        device="cpu",
        dtype="float32",
        max_num_batched_tokens=16384,
        kv_cache_memory_gib=3.0,
    )
    params = [
        SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n)
        for n in work.output_lens
    ]
    totals = instrument(llm.engine)
    runs = []
    for i in range(args.repeats):
        runs.append(run_once(llm, work, params, totals, shift=i))
        print(f"run {i + 1}: {runs[-1]['host_ms_per_step']:.3f} ms of host work per step")
    median = sorted(runs, key=lambda r: r["host_ms_per_step"])[len(runs) // 2]
    print(f"{median['steps']} steps a run; the median run, ms per step:")
    for name, ms in median.items():
        if name != "steps":
            print(f"  {name:28s} {ms:8.3f}")
    result = {
        "benchmark": "host_overhead",
        "workload": work.describe(),
        "temperature": args.temperature,
        "host_ms_per_step_runs": [r["host_ms_per_step"] for r in runs],
        "host_ms_per_step_median": statistics.median(r["host_ms_per_step"] for r in runs),
        # A shared machine only ever adds time: the least is the closest to the work itself.
        "host_ms_per_step_min": min(r["host_ms_per_step"] for r in runs),
        "median_run": median,
        "run_info": run_info(),
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
