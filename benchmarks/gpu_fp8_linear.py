"""GPU micro-benchmark: fp8 projections, the skinny-GEMM Triton kernel against
torch._scaled_mm, beside the bf16 projections they replace.

    python benchmarks/gpu_fp8_linear.py --json-out benchmarks/results/h100-fp8-linear.json

A decoder layer's four projections at Llama-3-8B's shapes (qkv, o_proj, gate_up, down),
x of 1 to 256 rows (decode batches) and 2,048 (a prefill chunk), timed in CUDA graphs
(triton.testing.do_bench_cudagraph) as a captured step runs them. Each call reads the
next of identical weight copies spanning 512 MB, so replays stream the weight from HBM as
32 layers do. Three ways to run a projection:

- skinny: engine/kernels/fp8_linear.py's fp8_linear with the skinny kernel at every row
  count (engine/kernels/triton_linear.py: the fp8 weight times x as it is, 16-bit);
- scaled_mm: fp8_linear with torch._scaled_mm at every row count (x quantized per token);
- bf16: engine/model/llama.py's linear on the bf16 weight, the engine's bf16 projection.

The table gives the weight bytes read per second (1 byte a weight in fp8, 2 in bf16); the
summary sums a layer's four projections per row count and prints the largest row count up
to which the skinny kernel wins at every count: fp8_linear's SKINNY_MAX_ROWS.

--sweep also times the skinny kernel's candidate launch configurations on fp8 operands up
to 64 rows (K steps of up to 4,096 one-byte weights) and prints the best per shape and
row count beside pick_config's and torch._scaled_mm:

    python benchmarks/gpu_fp8_linear.py --sweep --rows 1 2 4 8 16 32 64
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_kernels import config_name, rotating_weights  # noqa: E402
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
    fp8_weight, scale = rotating_weights(quantized), scale.view(-1)
    calls = {
        "skinny": (fp8_with_skinny_up_to(1 << 30, x, fp8_weight, scale), 1),
        "scaled_mm": (fp8_with_skinny_up_to(0, x, fp8_weight, scale), 1),
        "bf16": ((lambda weight: lambda: linear(x, weight()))(rotating_weights(bf16)), 2),
    }
    # Each fp8 way against the float32 product of what it multiplies: the dequantized
    # weight times x (skinny), or times x quantized per token (scaled_mm).
    weight_f32 = quantized.float() * scale[:, None]
    x_fp8, x_scale = fp8_linear.quantize_rows(x)
    expected = {
        "skinny": x.float() @ weight_f32.T,
        "scaled_mm": (x_fp8.float() * x_scale) @ weight_f32.T,
    }
    results = []
    for impl, (call, weight_bytes) in calls.items():
        row = {"op": name, "rows": rows, "impl": impl, "us": None, "weight_tbps": None}
        if impl == "skinny" and rows > SKINNY_TRIED_ROWS:
            row["error"] = "not tried: a prefill's rows"
            results.append(row)
            continue
        try:
            if impl in expected:  # only the summation order and the one rounding differ
                torch.testing.assert_close(call().float(), expected[impl], rtol=2e-2, atol=2e-2)
            ms = triton.testing.do_bench_cudagraph(call, rep=20, return_mode="median")
            row.update(us=ms * 1e3, weight_tbps=n * k * weight_bytes / (ms * 1e-3) / 1e12)
        except Exception as error:  # one failing case must not lose the whole table
            row["error"] = f"{type(error).__name__}: {error}"
        results.append(row)
    return results


def sweep_configs(rows: int, k: int) -> list:
    """Candidate launch configurations: CUDA-core products up to 8 rows, tensor cores at
    any row count, K steps sized for one-byte weights."""
    from engine.kernels.triton_linear import SkinnyConfig

    steps = [step for step in (256, 512, 1024, 2048, 4096) if step <= k]
    configs = []
    if rows <= 8:
        configs += [
            SkinnyConfig(False, block_n, block_k, warps, stages)
            for block_n in (4, 8)
            for block_k in steps
            if block_k >= 1024
            for warps, stages in ((4, 1), (8, 2))
        ]
    configs += [
        SkinnyConfig(True, block_n, block_k, warps, stages)
        for block_n in (16, 32)
        for block_k in steps
        if block_k <= 1024
        for warps, stages in ((4, 4), (8, 4))
    ]
    return configs


def sweep_shape(name: str, rows: int) -> dict:
    """Every candidate on one shape and row count: the best against pick_config's pick and
    torch._scaled_mm (which includes the per-token quantization of x)."""
    import triton.testing

    from engine.kernels.triton_linear import pick_config, skinny_fp8_linear

    n, k = SHAPES[name]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    quantized, scale = fp8_linear.quantize_rows(torch.randn(n, k, device="cuda") / k**0.5)
    weight, scale = rotating_weights(quantized), scale.view(-1)

    def skinny_with(config):
        def call() -> torch.Tensor:
            return skinny_fp8_linear(x, weight(), scale, None, config)

        return call

    def time(call) -> float | None:
        try:
            return triton.testing.do_bench_cudagraph(call, rep=10, return_mode="median") * 1e3
        except Exception:  # a configuration that does not compile or fit is left out
            return None

    timed = [(config, time(skinny_with(config))) for config in sweep_configs(rows, k)]
    ok = [(config, us) for config, us in timed if us is not None]
    best, best_us = min(ok, key=lambda pair: pair[1])
    return {
        "op": name,
        "rows": rows,
        "best": asdict(best),
        "best_us": best_us,
        "best_weight_tbps": n * k / (best_us * 1e-6) / 1e12,
        "rule": asdict(pick_config(rows, n, k, weight_bytes=1)),
        "rule_us": time(skinny_with(None)),
        "scaled_mm_us": time(fp8_with_skinny_up_to(0, x, weight, scale)),
        "failed": len(timed) - len(ok),
    }


def print_sweep(found: list[dict]) -> None:
    print("\nskinny fp8 sweep: the best configuration per shape and rows")
    for case in found:
        print(
            f"  {case['op']:<8} rows {case['rows']:>3}: best {config_name(case['best']):<26} "
            f"{case['best_us']:7.1f} us {case['best_weight_tbps']:.2f} TB/s | rule "
            f"{config_name(case['rule']):<26} {case['rule_us']} us | _scaled_mm {case['scaled_mm_us']} us"
        )
    for count in sorted({case["rows"] for case in found}):
        layer = [case for case in found if case["rows"] == count]
        best = sum(case["best_us"] for case in layer)
        scaled = sum(case["scaled_mm_us"] or float("inf") for case in layer)
        print(f"  per layer at {count} rows: best skinny {best:.1f} us, _scaled_mm {scaled:.1f} us")


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
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time the skinny kernel's candidate configurations",
    )
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
    sweep = []
    if args.sweep:
        sweep = [sweep_shape(name, count) for name in SHAPES for count in args.rows if count <= 64]
        print_sweep(sweep)
    if args.json_out:
        info = {**run_info(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
        payload = {"run": info, "rows": rows, "skinny_max_rows": limit, "sweep": sweep}
        args.json_out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
