"""GPU micro-benchmark of host costs: what queueing the engine's kinds of work costs the host.

    python benchmarks/gpu_host_costs.py [--json-out FILE]

Why: in the offline run the GPU idles ~0.5 s while the host is inside the runner's execute
(`gpu_profile.py --run-kernels`, results/h200-profile-run-edb824a.txt), and a steady
decode step spends ~1.2 ms of host time in CUDAGraph.replay() under cProfile
(results/h200-profile-kernels-edb824a.txt), against a few us per graph launch one would
expect. Each case below is timed on the host (perf_counter around the calls only):

- replay of a captured graph of many small kernels behind one long one (so a replay takes
  a known GPU time): with the GPU idle before each call; back to back, the same graph
  relaunched while its previous launch is still queued or running (a decode step relaunches
  the bucket graph of the step before); and two captures of the same work in turn. If the
  driver makes a relaunch of an in-flight graph wait, back-to-back calls take about the
  graph's GPU time and alternating captures do not.
- F.linear at an eager prefill step's shape (16,384 rows x 1,024 -> 6,144) and at the LM
  head's (256 rows x 1,024 -> 151,936), with the same row count every call, then a new row
  count every call (as the decode batch shrinks step by step; cuBLAS picks a kernel per new
  shape), on each of torch's two BLAS back ends (cuBLAS, cuBLASLt; the default first).
- planning a CUDA-graph decode step of 256 sequences on the engine's backend (page table,
  KV split, copies; FlashInferAttention.plan_graph).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import run_info  # noqa: E402

GRAPH_KERNELS = 320  # about a decode step's graph (313 kernels a step in the offline run)
GRAPH_SLEEP_CYCLES = 4_000_000  # ~2 ms at the H200's ~1.98 GHz: the graph's long kernel
CALLS = 40
# torch's BLAS back ends for CUDA matmuls (torch.backends.cuda.preferred_blas_library); the
# cuBLASLt path asks cuBLASLt for a kernel on every call.
BLAS_BACKENDS = ("cublas", "cublaslt")


def host_us_per_call(call: Callable[[int], object], calls: int, sync_each: bool = False) -> float:
    """Mean host time of call(i), i = 0..calls-1; with sync_each the GPU is idle before each."""
    torch.cuda.synchronize()
    spent = 0.0
    for i in range(calls):
        if sync_each:
            torch.cuda.synchronize()
        start = time.perf_counter()
        call(i)
        spent += time.perf_counter() - start
    torch.cuda.synchronize()
    return spent / calls * 1e6


def capture_step_like_graph(x: torch.Tensor) -> torch.cuda.CUDAGraph:
    """One long kernel, then GRAPH_KERNELS tiny ones, like a decode step's chain."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda._sleep(GRAPH_SLEEP_CYCLES)
        for _ in range(GRAPH_KERNELS):
            x.add_(1.0)
    return graph


def time_graphs() -> list[dict]:
    x = torch.zeros(1024, device="cuda")
    first, second = capture_step_like_graph(x), capture_step_like_graph(x)
    for graph in (first, second):  # first launches upload the graphs
        graph.replay()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    first.replay()
    end.record()
    end.synchronize()
    gpu_ms = start.elapsed_time(end)
    cases = {
        "replay, GPU idle before each": (lambda i: first.replay(), True),
        "replay, same graph back to back": (lambda i: first.replay(), False),
        "replay, two captures in turn": (lambda i: (first, second)[i % 2].replay(), False),
    }
    rows = []
    for name, (call, sync_each) in cases.items():
        us = host_us_per_call(call, CALLS, sync_each=sync_each)
        rows.append(
            {
                "case": name,
                "graph_kernels": GRAPH_KERNELS + 1,
                "graph_gpu_ms": gpu_ms,
                "host_us_per_call": round(us, 1),
            }
        )
    return rows


def time_linears() -> list[dict]:
    """Each shape on each of torch's BLAS back ends (the default one first), restored after."""
    default = torch.backends.cuda.preferred_blas_library().name.lower()  # e.g. 'cublas'
    shapes = {"prefill step (qkv)": (16_384, 1024, 6144), "LM head": (256, 1024, 151_936)}
    rows = []
    try:
        for turn, backend in enumerate(dict.fromkeys([default, *BLAS_BACKENDS])):
            torch.backends.cuda.preferred_blas_library(backend)
            for name, shape in shapes.items():
                # Each turn's new row counts are new to cuBLAS too: the turns' ranges differ.
                rows += time_linear(f"{name}, {backend}", *shape, first_new=1 + turn * CALLS)
    finally:
        torch.backends.cuda.preferred_blas_library(default)
    return rows


def time_linear(name: str, m: int, k: int, n: int, first_new: int) -> list[dict]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    F.linear(x, weight)  # the first call of a shape pays library set-up
    same = host_us_per_call(lambda i: F.linear(x, weight), CALLS)
    # Row counts not seen before, one per call: m - first_new, m - first_new - 1, ...
    shrinking = host_us_per_call(lambda i: F.linear(x[: m - first_new - i], weight), CALLS)
    return [
        {
            "case": f"F.linear, {name}: {case}",
            "m": m,
            "k": k,
            "n": n,
            "host_us_per_call": round(us, 1),
        }
        for case, us in (("same rows every call", same), ("new row count every call", shrinking))
    ]


def time_decode_plans() -> list[dict]:
    """The host cost of planning a CUDA-graph decode step of the workload's 256 sequences
    (their contexts after 50 decode steps) on the engine's backend: page table, KV split
    and their copies (FlashInferAttention.plan_graph)."""
    from benchmarks.gpu_bench import NANO_VLLM_WORKLOAD
    from benchmarks.workload import make_workload
    from engine.attention.flashinfer_backend import FlashInferAttention

    lens = [len(prompt) + 50 for prompt in make_workload(NANO_VLLM_WORKLOAD).prompts]
    batch, block_size = len(lens), 64
    pages = [-(-n // block_size) for n in lens]
    starts = list(itertools.accumulate(pages, initial=0))
    tables = [list(range(start, start + n)) for start, n in zip(starts[:-1], pages, strict=True)]
    attn = FlashInferAttention(torch.device("cuda"))
    attn.configure(16, 8, 128, torch.bfloat16)  # the Qwen3-0.6B shape's heads
    attn.add_graph_batch_size(batch, torch.zeros(sum(pages), dtype=torch.int32, device="cuda"))

    def plan(i: int) -> None:
        attn.plan_graph(lens, tables, block_size)

    plan(0)
    us = host_us_per_call(plan, CALLS)
    return [
        {
            "case": "graph decode plan, 256 seqs (64-token blocks)",
            "pages": sum(pages),
            "host_us_per_call": round(us, 1),
        }
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_host_costs.py needs a CUDA GPU")
    rows = time_graphs() + time_linears() + time_decode_plans()
    for row in rows:
        print(f"{row['host_us_per_call']:9.1f} us  {row['case']}")
    if args.json_out:
        args.json_out.write_text(json.dumps({**run_info(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
