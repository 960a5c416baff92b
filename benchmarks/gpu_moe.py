"""GPU micro-benchmark: the experts of one MoE layer, reference path vs the fused ones.

    python benchmarks/gpu_moe.py [--shapes NAME ...] [--rows N ...] [--json-out FILE]

The evidence for engine/model/moe.py's FUSED_BY_TOKENS (which implementation at which
token count) and for fused_moe.py's MoeTiles. One layer's experts of Qwen3-30B-A3B (128
experts, top-8, hidden 2048, moe_intermediate 768) and of Mixtral-8x7B (8 experts, top-2,
hidden 4096, intermediate 14336), bf16, random router (uniform over experts, top-k,
renormalised), at decode rows 1 to 256 and prefill rows 1024 to 16384. Each way:

- reference: Experts.reference, the loop over the chosen experts (a host sync per call);
- triton: fused_moe.triton_experts, the Triton grouped GEMM with pick_tiles' tiles;
- grouped_mm: fused_moe.grouped_mm_experts, torch._grouped_mm.

us is the median time per call, eager, by CUDA events around each call (launch cost
included, as a prefill pays it); graph_us the same call replayed in a CUDA graph, as a
decode step runs it (fused ways at decode rows only). For decode rows, tb_s is the bytes
of the distinct experts the batch touched / graph time (else eager time): a decode layer
is a weight read. rel_err is each way's norm-wise error against the reference's output.
The summary prints the fastest way per shape and row count. --tile-sweep also times the
Triton kernel at each of TILE_CANDIDATES (named block_m/block_n/block_k/warps/stages), for
fused_moe's DECODE_TILES / BUSY_DECODE_TILES / PREFILL_TILES. Weights are 1.2 GB (Qwen3)
and 2.8 GB (Mixtral); the largest step's activations take a few GB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import astuple
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import run_info  # noqa: E402
from engine.kernels import fused_moe  # noqa: E402
from engine.model.moe import Experts  # noqa: E402

# name -> (experts, top-k, hidden, moe intermediate)
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_ROWS = (1024, 4096, 16384)
IMPLS = ("reference", "triton", "grouped_mm")
# --tile-sweep: Triton tiles to try beside pick_tiles' (block_m, block_n, block_k, warps, stages).
TILE_CANDIDATES = [
    fused_moe.MoeTiles(16, 32, 256, 4, 3),
    fused_moe.MoeTiles(16, 64, 128, 4, 4),
    fused_moe.MoeTiles(16, 128, 128, 4, 3),
    fused_moe.MoeTiles(32, 64, 128, 4, 3),
    fused_moe.MoeTiles(64, 64, 64, 4, 3),
    fused_moe.MoeTiles(64, 128, 64, 8, 4),
    fused_moe.MoeTiles(128, 128, 64, 8, 3),
]


def layer(shape: str) -> Experts:
    num_experts, _, hidden, inter = SHAPES[shape]
    config = SimpleNamespace(hidden_size=hidden)
    moe = SimpleNamespace(num_experts=num_experts, moe_intermediate_size=inter)
    with torch.device("cuda"):  # not 5.6 GB of float32 built on the host first
        experts = Experts(config, moe).to(torch.bfloat16).requires_grad_(False)
    experts.gate_up_proj.normal_(std=hidden**-0.5)
    experts.down_proj.normal_(std=inter**-0.5)
    return experts


def call(impl: str, experts: Experts, x, weights, ids, tiles: fused_moe.MoeTiles | None = None):
    if impl == "reference":
        return lambda: experts.reference(x, weights, ids)
    if impl == "triton":
        gate_up, down = experts.gate_up_proj, experts.down_proj
        return lambda: fused_moe.triton_experts(x, weights, ids, gate_up, down, tiles)
    return lambda: fused_moe.grouped_mm_experts(
        x, weights, ids, experts.gate_up_proj, experts.down_proj
    )


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graph_us(fn, repeats: int) -> float:
    """Median microseconds per replay of fn captured in a CUDA graph (10 calls a replay,
    so the replay's own launch is spread thin)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    return median_us(graph.replay, repeats) / 10


def time_rows(shape: str, experts: Experts, rows: int, sweep: bool) -> list[dict]:
    num_experts, top_k, hidden, inter = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).bfloat16()
    probs = torch.randn(rows, num_experts, device="cuda", generator=gen).softmax(-1)
    weights, ids = probs.topk(top_k, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    decode = rows <= DECODE_ROWS[-1]
    touched = ids.unique().numel()
    weight_bytes = touched * 3 * hidden * inter * 2
    repeats = 50 if decode else 10
    out, reference = [], None
    ways = [(impl, None) for impl in IMPLS]
    ways += [("triton", tiles) for tiles in TILE_CANDIDATES] if sweep else []
    for impl, tiles in ways:
        name = impl if tiles is None else f"triton {'/'.join(map(str, astuple(tiles)))}"
        row = dict(shape=shape, rows=rows, impl=name, experts_touched=touched)
        try:
            fn = call(impl, experts, x, weights, ids, tiles)
            result = fn()  # compiles the Triton kernels for this shape first
            torch.cuda.synchronize()
            if reference is None:
                reference = result.float()
            err = (result.float() - reference).norm() / reference.norm()
            row["rel_err"] = round(err.item(), 5)
            row["us"] = round(median_us(fn, repeats), 1)
            if decode and impl != "reference":
                row["graph_us"] = round(graph_us(fn, repeats), 1)
            if decode:
                row["tb_s"] = round(weight_bytes / row.get("graph_us", row["us"]) / 1e6, 3)
        except Exception as error:  # one way failing must not lose the others
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        print(row, flush=True)
        out.append(row)
    return out


def summary(rows: list[dict]) -> None:
    print("\nfastest per shape and row count (graph time where taken, else eager):")
    keys = sorted({(r["shape"], r["rows"]) for r in rows}, key=lambda k: (k[0], k[1]))
    for shape, count in keys:
        timed = [
            (r.get("graph_us", r["us"]), r["impl"])
            for r in rows
            if (r["shape"], r["rows"]) == (shape, count) and "us" in r
        ]
        if timed:
            best_us, best = min(timed)
            others = ", ".join(f"{impl} {us:.1f}" for us, impl in sorted(timed))
            print(f"  {shape:15} {count:6}: {best:10} ({others} us)")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--rows", nargs="+", type=int, default=[*DECODE_ROWS, *PREFILL_ROWS])
    p.add_argument(
        "--tile-sweep", action="store_true", help="also time the Triton kernel at TILE_CANDIDATES"
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    rows = []
    for shape in args.shapes:
        experts = layer(shape)
        for count in args.rows:
            rows += time_rows(shape, experts, count, args.tile_sweep)
            torch.cuda.empty_cache()
        del experts
        torch.cuda.empty_cache()
    summary(rows)
    if args.json_out:
        args.json_out.write_text(json.dumps({**run_info(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
