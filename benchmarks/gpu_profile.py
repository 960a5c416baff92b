"""Where a GPU step's time goes: the engine's kernels, ranked by their share of device time.

    python benchmarks/gpu_profile.py --shape llama-3-8b [--quantization fp8]
        [--kv-cache-dtype fp8_e4m3] [--json-out result.json]

The engine and the model are gpu_bench's (the same flags: a random model of a real shape,
weights drawn on load). gpu_bench's nano-vllm workload runs once untimed (kernel builds,
autotuning), then a second run of it is profiled in two windows, and a single stream in a
third:

- prefill: its first --prefill-steps steps (max_num_batched_tokens prompt tokens each);
- decode: --decode-steps steps once every prompt is in, the workload's busiest decode
  (up to 256 sequences of 100-2,000 tokens);
- batch-1 decode: --decode-steps steps of one 128-token prompt's decode.

For each: the wall time per step, the device time per step (the sum of its kernels'
durations, so the GPU's idle share is the difference), and every kernel by its total time
with its calls per step, in groups (projections, attention, experts, ...) that say which
part of the model a gain must come from. torch.profiler records the kernels CUDA graphs
replay as well as eager ones. The profiler slows the host a little (wall times are upper
bounds); kernel durations are the device's own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_bench import (  # noqa: E402
    NANO_VLLM_WORKLOAD,
    SHAPES,
    add_engine_arguments,
    run_workload,
    start_engine,
    workload_params,
    write_random_model,
)
from benchmarks.workload import make_workload, run_info  # noqa: E402

# A kernel's group: the first whose any word its name contains (case-insensitive).
# Attention first: flashinfer's kernel names can hold the GEMM group's words (sm90, mma).
# torch's own kernels (the MoE router's softmax and top-k, copies, ...) fall in "other".
GROUPS = (
    ("attention", ("decode_chunk", "merge_chunks", "prefill", "decode", "attention", "flash")),
    ("experts (MoE)", ("grouped_gemm", "grouped_mm")),
    ("routing and row layout (MoE)", ("top_k_softmax", "align_kernel", "expert_counts")),
    ("activation quantization (fp8)", ("quantize",)),
    ("projections (GEMM)", ("gemm", "xmma", "nvjet", "cutlass", "skinny", "matmul", "sm90")),
    ("norms, rotary + KV write, SiLU", ("rms_norm", "rotary", "silu")),
    ("all-reduce", ("allreduce", "all_reduce", "nccl")),
    ("sampling", ("exponential_race",)),
)


def group_of(kernel: str) -> str:
    name = kernel.lower()
    for group, words in GROUPS:
        if any(word in name for word in words):
            return group
    return "other"


@dataclass
class Window:
    """One profiled window of engine steps."""

    name: str
    steps: int
    sequences_per_step: float  # sequences running after each step, averaged
    wall_ms_per_step: float
    device_ms_per_step: float
    groups: dict[str, float]  # ms per step
    kernels: list[dict]  # name, group, ms per step, calls per step, us per call


def profile_steps(engine, name: str, steps: int) -> Window:
    """Step the engine `steps` times under the profiler."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    running = 0
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        start = time.perf_counter()
        done = 0
        while done < steps and engine.has_unfinished_requests:
            engine.step()
            running += len(engine.scheduler.running)
            done += 1
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])  # us, calls
    for event in profiled.events():
        if event.device_type == DeviceType.CUDA:
            totals[event.name][0] += event.time_range.elapsed_us()
            totals[event.name][1] += 1
    per_step = max(done, 1)
    kernels = [
        {
            "kernel": kernel,
            "group": group_of(kernel),
            "ms_per_step": round(us / 1e3 / per_step, 4),
            "calls_per_step": round(calls / per_step, 2),
            "us_per_call": round(us / calls, 2),
        }
        for kernel, (us, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0])
    ]
    groups: dict[str, float] = defaultdict(float)
    for row in kernels:
        groups[row["group"]] += row["ms_per_step"]
    return Window(
        name,
        done,
        round(running / per_step, 1),
        round(wall * 1e3 / per_step, 3),
        round(sum(row["ms_per_step"] for row in kernels), 3),
        {group: round(ms, 3) for group, ms in sorted(groups.items(), key=lambda g: -g[1])},
        kernels,
    )


def print_window(window: Window, top: int) -> None:
    print(
        f"\n== {window.name}: {window.steps} steps, {window.sequences_per_step} sequences, "
        f"{window.wall_ms_per_step} ms wall / {window.device_ms_per_step} ms of kernels a step"
    )
    for group, ms in window.groups.items():
        share = ms / window.device_ms_per_step if window.device_ms_per_step else 0.0
        print(f"  {group:32s} {ms:9.3f} ms  {share:6.1%}")
    print(f"  top {top} kernels (ms a step, calls a step, us a call):")
    for row in window.kernels[:top]:
        print(
            f"    {row['ms_per_step']:8.3f} {row['calls_per_step']:8.1f} {row['us_per_call']:9.2f}"
            f"  [{row['group']}] {row['kernel'][:110]}"
        )


def profile_workload(llm, work, params: list, args: argparse.Namespace) -> list[Window]:
    """The prefill and busy-decode windows of one run of the workload (its requests'
    sampling `params`), then batch-1."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    requests = [
        engine.add_request(f"profile-{i}", prompt, request_params)
        for i, (prompt, request_params) in enumerate(zip(work.prompts, params, strict=True))
    ]
    windows = [profile_steps(engine, "prefill", args.prefill_steps)]
    while engine.has_unfinished_requests and any(r.stage != "decode" for r in requests):
        engine.step()
    windows.append(profile_steps(engine, "decode, every prompt in", args.decode_steps))
    for request in requests:
        engine.abort_request(request.request_id)
    while engine.has_unfinished_requests:
        engine.step()
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.decode_steps + 8)
    engine.add_request("profile-batch-1", list(range(1, 129)), params)
    engine.step()  # its prefill
    windows.append(profile_steps(engine, "batch-1 decode", args.decode_steps))
    while engine.has_unfinished_requests:
        engine.step()
    return windows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_arguments(p)
    p.add_argument("--prefill-steps", type=int, default=4)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25, help="kernels printed per window")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args()

    work = make_workload(NANO_VLLM_WORKLOAD)
    model_dir = write_random_model(SHAPES[args.shape], args.model_dir / args.shape, weights=False)
    llm = start_engine(args, model_dir)
    params = workload_params(work)
    # Ids shifted by one: the profiled run finds none of this run's prompts cached.
    run_workload(llm, work, params, 1, "untimed run")
    windows = profile_workload(llm, work, params, args)
    for window in windows:
        print_window(window, args.top)
    if args.json_out:
        result = {
            **run_info(),
            "gpu": torch.cuda.get_device_name(),
            "shape": args.shape,
            "kv_cache_dtype": args.kv_cache_dtype,
            "quantization": args.quantization,
            "windows": [asdict(window) for window in windows],
        }
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
