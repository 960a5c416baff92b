"""GPU micro-benchmark: fp8 projections, the skinny-GEMM Triton kernel against
torch._scaled_mm, beside the bf16 projections they replace.

    python benchmarks/gpu_fp8_linear.py --json-out benchmarks/results/h100-fp8-linear.json

A decoder layer's four projections at Llama-3-8B's shapes (qkv, o_proj, gate_up, down),
x of 1 to 256 rows (decode batches) and 2,048 (a prefill chunk), timed in CUDA graphs
(triton.testing.do_bench_cudagraph) as a captured step runs them. Each call reads the
next of identical weight copies spanning 512 MB, so replays stream the weight from HBM as
32 layers do. Three ways to run a projection:

- skinny: engine/kernels/fp8_linear.py's fp8_linear with the skinny kernel at every row
  count (x quantized per token, then engine/kernels/triton_linear.py on fp8 operands);
- scaled_mm: fp8_linear with torch._scaled_mm at every row count (the same quantization);
- bf16: engine/model/llama.py's linear on the bf16 weight, the engine's bf16 projection.

The table gives the weight bytes read per second (1 byte a weight in fp8, 2 in bf16); the
summary sums a layer's four projections per row count and prints the largest row count up
to which the skinny kernel wins at every count: fp8_linear's SKINNY_MAX_ROWS.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_kernels import rotating_weights  # noqa: E402
from benchmarks.workload import run_info  # noqa: E402
from engine.kernels import fp8_linear  # noqa: E402
from engine.model.llama import linear  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336
SHAPES = {  # name: W's [N, K]
    "qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    "o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 2048)
IMPLS = ("skinny", "scaled_mm", "bf16")
# The skinny kernel holds all of x's rows in one block: past a decode batch it is not tried.
SKINNY_TRIED_ROWS = 256


def fp8_with_skinny_up_to(max_rows: int, x, weight, scale):
    """fp8_linear with SKINNY_MAX_ROWS set for this call (and its graph capture) only."""

    def call() -> torch.Tensor:
        saved = fp8_linear.SKINNY_MAX_ROWS
        fp8_linear.SKINNY_MAX_ROWS = max_rows
        try:
            return fp8_linear.fp8_linear(x, weight(), scale)
        finally:
            fp8_linear.SKINNY_MAX_ROWS = saved

    return call


def time_shape(name: str, rows: int) -> list[dict]:
    import triton.testing

    n, k = SHAPES[name]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    bf16 = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    quantized, scale = fp8_linear.quantize_rows(bf16)
    scale = scale.view(-1)
    calls = {
        "skinny": (fp8_with_skinny_up_to(1 << 30, x, rotating_weights(quantized), scale), 1),
        "scaled_mm": (fp8_with_skinny_up_to(0, x, rotating_weights(quantized), scale), 1),
        "bf16": ((lambda weight: lambda: linear(x, weight()))(rotating_weights(bf16)), 2),
    }
    reference = calls["scaled_mm"][0]()
    results = []
    for impl, (call, weight_bytes) in calls.items():
        row = {"op": name, "rows": rows, "impl": impl, "us": None, "weight_tbps": None}
        if impl == "skinny" and rows > SKINNY_TRIED_ROWS:
            row["error"] = "not tried: a prefill's rows"
            results.append(row)
            continue
        try:
            if impl != "bf16":  # the same operands and scales: only the summation order differs
                torch.testing.assert_close(call(), reference, rtol=2e-2, atol=2e-2)
            ms = triton.testing.do_bench_cudagraph(call, rep=20, return_mode="median")
            row.update(us=ms * 1e3, weight_tbps=n * k * weight_bytes / (ms * 1e-3) / 1e12)
        except Exception as error:  # one failing case must not lose the whole table
            row["error"] = f"{type(error).__name__}: {error}"
        results.append(row)
    return results


def summarize(rows: list[dict]) -> int:
    """Print the table and each row count's per-layer sums; return SKINNY_MAX_ROWS."""
    print(f"{'op':<8} {'rows':>5} | " + " | ".join(f"{impl + ' us  TB/s':>17}" for impl in IMPLS))
    cases: dict[tuple[str, int], dict[str, dict]] = {}
    for row in rows:
        cases.setdefault((row["op"], row["rows"]), {})[row["impl"]] = row
    for (name, count), by_impl in cases.items():
        cells = [
            f"{r['us']:9.1f} {r['weight_tbps']:6.2f}" if r.get("us") else f"{'error':>16}"
            for r in (by_impl[impl] for impl in IMPLS)
        ]
        print(f"{name:<8} {count:>5} | " + " | ".join(cells))
    limit, winning = 0, True
    print("\nper decoder layer (qkv + o_proj + gate_up + down), us")
    for count in sorted({count for _, count in cases}):
        sums = {
            impl: sum(cases[(name, count)][impl]["us"] or float("inf") for name in SHAPES)
            for impl in IMPLS
        }
        print(f"  rows {count:>5}: " + "  ".join(f"{i} {us:8.1f}" for i, us in sums.items()))
        winning = winning and sums["skinny"] < sums["scaled_mm"]
        limit = count if winning else limit
    print(f"the skinny kernel beats torch._scaled_mm per layer up to rows {limit}")
    return limit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    assert fp8_linear.fp8_linear_runs(torch.device("cuda")), "needs a GPU with fp8 tensor cores"
    torch.manual_seed(0)
    rows = []
    for name in SHAPES:
        for count in args.rows:
            rows += time_shape(name, count)
            torch.cuda.empty_cache()
    limit = summarize(rows)
    if args.json_out:
        info = {**run_info(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        payload = {"run": info, "rows": rows, "skinny_max_rows": limit}
        args.json_out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
