"""GPU micro-benchmark: engine/kernels' Triton kernels vs eager torch vs torch.compile.

    python benchmarks/gpu_kernels.py --json-out benchmarks/results/h200-kernels.json

The evidence behind "Triton where a library has none (or show that torch.compile does as
well)". Shapes are Qwen3-0.6B's: hidden 1024, 16 q / 8 kv heads of 128, intermediate
3072, vocab 151,936, bf16, at 1 to 8192 tokens; the sampler's fast path (no penalty, ban,
filter or logprobs: temperature 0.6 on every row) at 1 and 256 rows of logits, in the
tokens column. Each op runs three ways on the same inputs:

- triton: engine/kernels/triton_kernels.py;
- eager: the torch path (engine/kernels' CPU code) run on the GPU;
- compile: torch.compile of that same torch function, compiled per shape (dynamic=False).

and is timed twice:

- graph: triton.testing.do_bench_cudagraph, the kernels alone, as a captured decode
  step replays them (inputs may stay in the 50 MB L2 between calls);
- launch: triton.testing.do_bench, one call at a time with L2 flushed, host launch cost
  included, as an eager prefill pays it.

rotary_and_store_kv's torch path finds padding rows with a host sync and cannot be
captured, so its eager and compile columns store with the plain indexed write it reduces
to when no row is padding (a prefill's case).

    python benchmarks/gpu_kernels.py --tokens 1 256 --sample-rows 1 256   # decode shapes only

The linear section times a decode step's projections (qkv, o_proj, gate_up, down and the
LM head, x of 1 to 256 rows) in CUDA graphs: the skinny-GEMM Triton kernel
(engine/kernels/triton_linear.py, its pick_config), F.linear, (W @ x.T).T, for which
cuBLAS may pick a GEMV, torch on cuBLASLt, flashinfer's tinygemm2, and flashinfer's
mm_bf16 on cuBLASLt with every algorithm the library offers for the shape timed by
flashinfer's autotuner (cublaslt-tuned; cuBLAS itself takes its heuristic's first pick),
and F.linear on one weight copy held in L2 (F.linear-l2, the bound of an L2 prefetch;
--linear-impls picks some). Each call reads the next of identical weight copies spanning
512 MB, so replays stream the weight from HBM as 28 layers do, and the table gives
weight bytes read per second (TB/s). Its summary sums one layer's four projections per
row count and prints the SKINNY_MAX_ROWS (engine/model/llama.py) the numbers support.
--linear-sweep also times every candidate configuration of the kernel up to 16 rows (a
few minutes; --linear-shapes splits it) and prints the best against pick_config's:

    python benchmarks/gpu_kernels.py --tokens --sample-rows --linear-sweep   # linear only
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import run_info  # noqa: E402
from engine.kernels.activation import silu_and_mul_torch  # noqa: E402
from engine.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch  # noqa: E402
from engine.kernels.race import exponential_race_torch  # noqa: E402
from engine.kernels.rotary import rotary_qk_torch  # noqa: E402

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTERMEDIATE = 1024, 16, 8, 128, 3072
VOCAB = 151936
BLOCK_SIZE = 16
EPS = 1e-6
IMPLS = ("triton", "eager", "compile")


@dataclass
class Result:
    op: str
    tokens: int
    impl: str
    graph_us: float | None
    launch_us: float | None
    graph_gbps: float | None  # bytes the op must move / graph time
    error: str | None = None


@dataclass
class Op:
    """One op at one token count: a call per implementation, and the bytes it must move."""

    name: str
    calls: dict[str, Callable[[], torch.Tensor | tuple[torch.Tensor, ...]]]  # what to compare
    bytes_moved: int
    # How close each implementation's result must be to eager's before it is timed.
    tolerance: dict[str, float] = field(default_factory=lambda: {"rtol": 2e-2, "atol": 1e-2})


def store_kv_indexed(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """store_kv_torch without its padding check (no slot is -1 here): no host sync."""
    blocks, offsets = slot_mapping // BLOCK_SIZE, slot_mapping % BLOCK_SIZE
    kv_cache[blocks, 0, offsets] = k
    kv_cache[blocks, 1, offsets] = v


def rotary_and_store_kv_indexed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """rotary_and_store_kv_torch, storing through store_kv_indexed: no host sync."""
    q, k = rotary_qk_torch(q, k, cos, sin, q_norm_weight, k_norm_weight, eps)
    store_kv_indexed(k, v, kv_cache, slot_mapping)
    return q


COMPILED = {  # compiled lazily, on first call, once per shape
    fn: torch.compile(fn, dynamic=False)
    for fn in (
        fused_add_rms_norm_torch,
        rms_norm_torch,
        silu_and_mul_torch,
        rotary_and_store_kv_indexed,
        exponential_race_torch,
    )
}


def make_ops(tokens: int, dtype: torch.dtype) -> list[Op]:
    from engine.kernels import triton_kernels

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype)

    size = torch.finfo(dtype).bits // 8

    x, residual, weight = randn(tokens, HIDDEN), randn(tokens, HIDDEN), randn(HIDDEN)
    add_norm = {
        "triton": lambda: triton_kernels.fused_add_rms_norm(x, residual, weight, EPS)[0],
        "eager": lambda: fused_add_rms_norm_torch(x, residual, weight, EPS)[0],
        "compile": lambda: COMPILED[fused_add_rms_norm_torch](x, residual, weight, EPS)[0],
    }

    # q heads read in place from the merged qkv projection's output, as Qwen3's q_norm does.
    qkv = randn(tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM)
    q = qkv[:, : NUM_HEADS * HEAD_DIM].view(tokens, NUM_HEADS, HEAD_DIM)
    head_weight = randn(HEAD_DIM)
    qk_norm = {
        "triton": lambda: triton_kernels.rms_norm(q, head_weight, EPS),
        "eager": lambda: rms_norm_torch(q, head_weight, EPS),
        "compile": lambda: COMPILED[rms_norm_torch](q, head_weight, EPS),
    }

    # Qwen3's attention input: q and k normed per head and rotated, read from the qkv output;
    # the rotated k and v stored in the KV pool at scattered slots, as decodes write them.
    k_heads = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM]
    k_heads = k_heads.view(tokens, NUM_KV_HEADS, HEAD_DIM)
    v_heads = qkv[:, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM :].view(tokens, NUM_KV_HEADS, HEAD_DIM)
    angles = torch.rand(tokens, HEAD_DIM // 2, device="cuda") * 6.3
    cos, sin = angles.cos(), angles.sin()
    q_weight, k_weight = (1 + 0.1 * randn(HEAD_DIM) for _ in range(2))
    num_blocks = 2 * -(-8192 // BLOCK_SIZE)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:tokens]
    caches = {  # one pool each, so the correctness check compares two writes
        impl: torch.zeros(
            num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype
        )
        for impl in IMPLS
    }

    def rotary_with(
        rotary_and_store_kv: Callable[..., torch.Tensor], impl: str
    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def call() -> tuple[torch.Tensor, torch.Tensor]:
            pool = caches[impl]
            args = (q, k_heads, v_heads, cos, sin, pool, slots, q_weight, k_weight, EPS)
            return rotary_and_store_kv(*args), pool

        return call

    rotary = {
        "triton": rotary_with(triton_kernels.rotary_and_store_kv, "triton"),
        "eager": rotary_with(rotary_and_store_kv_indexed, "eager"),
        "compile": rotary_with(COMPILED[rotary_and_store_kv_indexed], "compile"),
    }

    gate_up = randn(tokens, 2 * INTERMEDIATE)
    silu = {
        "triton": lambda: triton_kernels.silu_and_mul(gate_up),
        "eager": lambda: silu_and_mul_torch(gate_up),
        "compile": lambda: COMPILED[silu_and_mul_torch](gate_up),
    }

    row_bytes = tokens * size
    qkv_bytes = row_bytes * (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM * 2  # read q, k, v; write
    return [
        Op("fused_add_rms_norm", add_norm, row_bytes * HIDDEN * 4),  # read x, r; write out, r
        Op("rms_norm q heads", qk_norm, row_bytes * NUM_HEADS * HEAD_DIM * 2),
        # An input one bf16 ulp off (its rsqrt) rotates into an output one ulp of the input
        # off, however small the output (tests/test_kernels.py rotary_tolerance).
        Op(
            "rotary_and_store_kv",  # with q/k norm
            rotary,
            qkv_bytes + tokens * HEAD_DIM * 4,
            {"rtol": 2e-2, "atol": 0.125},
        ),
        Op("silu_and_mul", silu, row_bytes * INTERMEDIATE * 3),
    ]


def make_sampler_op(rows: int, dtype: torch.dtype) -> Op:
    """The sampler's fast path: every row tempered (0.6, as gpu_bench.py samples) and raced."""
    from engine.kernels import triton_kernels

    logits = 3 * torch.randn(rows, VOCAB, device="cuda", dtype=dtype)
    args = (
        logits,
        torch.full((rows,), 0.6, device="cuda"),  # temperature
        torch.zeros(rows, dtype=torch.bool, device="cuda"),  # is_greedy
        torch.randint(2**40, (rows,), device="cuda"),  # seeds
        torch.randint(1000, (rows,), device="cuda"),  # counters
    )
    calls = {
        "triton": lambda: triton_kernels.exponential_race(*args),
        "eager": lambda: exponential_race_torch(*args),
        "compile": lambda: COMPILED[exponential_race_torch](*args),
    }
    # The same seeds draw the same tokens on every path: the check is exact.
    return Op(
        "sampler fast path", calls, logits.numel() * logits.element_size(), {"rtol": 0, "atol": 0}
    )


def measure(op: Op, tokens: int, impl: str) -> Result:
    import triton.testing

    call = op.calls[impl]
    try:
        torch.testing.assert_close(call(), op.calls["eager"](), **op.tolerance)  # sanity only
        graph_ms = triton.testing.do_bench_cudagraph(call, return_mode="median")
        launch_ms = triton.testing.do_bench(call, return_mode="median")
    except Exception as error:  # one failing implementation must not lose the whole table
        return Result(op.name, tokens, impl, None, None, None, f"{type(error).__name__}: {error}")
    gbps = op.bytes_moved / (graph_ms * 1e-3) / 1e9
    return Result(op.name, tokens, impl, graph_ms * 1e3, launch_ms * 1e3, gbps)


def print_table(results: list[Result]) -> None:
    def cell(result: Result) -> str:
        if result.error:
            return f"{'error':>22}"
        return f"{result.graph_us:8.1f} {result.launch_us:7.1f} {result.graph_gbps:5.0f}"

    rows: dict[tuple[str, int], dict[str, Result]] = {}
    for result in results:
        rows.setdefault((result.op, result.tokens), {})[result.impl] = result
    header = " | ".join(f"{impl:>22}" for impl in IMPLS)
    print(f"{'op':<20} {'tokens':>6} | {header}")
    print(f"{'':<20} {'':>6} | " + " | ".join(f"{'graph us  launch GB/s':>22}" for _ in IMPLS))
    for (op, tokens), by_impl in rows.items():
        print(f"{op:<20} {tokens:>6} | " + " | ".join(cell(by_impl[impl]) for impl in IMPLS))
    for result in results:
        if result.error:
            print(f"{result.op} {result.tokens} {result.impl}: {result.error}")


# ---- skinny GEMMs: a decode step's projections, the Triton kernel against cuBLAS ---------

LINEAR_SHAPES = {  # name: W's [N, K] (x is [rows, K])
    "qkv": ((NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, HIDDEN),
    "o_proj": (HIDDEN, NUM_HEADS * HEAD_DIM),
    "gate_up": (2 * INTERMEDIATE, HIDDEN),
    "down": (HIDDEN, INTERMEDIATE),
    "lm_head": (VOCAB, HIDDEN),
}
LAYER_SHAPES = ("qkv", "o_proj", "gate_up", "down")  # one decoder layer's projections
NUM_LAYERS = 28
LINEAR_IMPLS = (
    "triton",
    "F.linear",
    "W@x.T",
    "cublaslt",
    "tinygemm",
    "cublaslt-tuned",
    "F.linear-l2",
)
# Copies of a weight cycled through call after call, so that graph replays stream it from
# HBM as a decode step does (28 layers' weights do not fit in the H200's 50 MB L2).
ROTATION_BYTES = 512 << 20


def rotating_weights(weight: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Each call returns the next of enough identical copies to span ROTATION_BYTES."""
    from itertools import cycle

    copies = max(1, -(-ROTATION_BYTES // (weight.numel() * weight.element_size())))
    order = cycle([weight] + [weight.clone() for _ in range(copies - 1)])
    return lambda: next(order)


def linear_calls(rows: int, n: int, k: int, dtype: torch.dtype):
    """A call per implementation on one x and one weight rotation (identical copies, so
    every call computes the same product whichever copy it reads), and a maker of Triton
    calls with a given configuration."""
    from engine.kernels.triton_linear import skinny_linear

    x = torch.randn(rows, k, device="cuda", dtype=dtype)
    weight = rotating_weights((torch.randn(n, k, device="cuda") / k**0.5).to(dtype))

    def triton_with(config) -> Callable[[], torch.Tensor]:
        return lambda: skinny_linear(x, weight(), None, config)

    def cublaslt() -> torch.Tensor:  # torch's other BLAS backend, which may split K
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            return torch.nn.functional.linear(x, weight())
        finally:
            torch.backends.cuda.preferred_blas_library("cublas")

    def tinygemm() -> torch.Tensor:  # flashinfer's port of TensorRT-LLM's tinygemm2 (SM90+)
        from flashinfer.gemm import tinygemm_bf16

        out = torch.empty(rows, n, device="cuda", dtype=dtype)
        tinygemm_bf16(x, weight(), out)
        return out

    tuned = False
    held_weight = weight()

    def cublaslt_tuned() -> torch.Tensor:
        # Every algorithm cuBLASLt offers for the shape, timed by flashinfer's autotuner on
        # the first (eager) call, the fastest kept: cuBLAS's heuristic takes its first pick.
        import flashinfer

        nonlocal tuned
        if not tuned:
            with flashinfer.autotune(True):
                flashinfer.mm_bf16(x, weight().T, backend="cublaslt")
            tuned = True
        return flashinfer.mm_bf16(x, weight().T, backend="cublaslt")

    calls = {
        "triton": triton_with(None),  # pick_config's choice, as linear() runs it
        "F.linear": lambda: torch.nn.functional.linear(x, weight()),
        "W@x.T": lambda: (weight() @ x.T).T,  # a transposed view: cuBLAS may pick a GEMV
        "cublaslt": cublaslt,
        "tinygemm": tinygemm,
        "cublaslt-tuned": cublaslt_tuned,
        # One weight copy every call: after the first it is read from the 50 MB L2, which
        # bounds what prefetching the weight into L2 ahead of the GEMM could give.
        "F.linear-l2": lambda: torch.nn.functional.linear(x, held_weight),
    }
    return calls, triton_with


def time_linear(
    name: str, rows: int, impl: str, call: Callable[[], torch.Tensor], reference, rep: int = 20
) -> Result:
    """Graph time only: decode projections always run inside a captured step."""
    import triton.testing

    n, k = LINEAR_SHAPES[name]
    try:
        torch.testing.assert_close(call(), reference(), rtol=2e-2, atol=2e-2)  # sanity only
        graph_ms = triton.testing.do_bench_cudagraph(call, rep=rep, return_mode="median")
    except Exception as error:  # one failing configuration must not lose the whole table
        return Result(name, rows, impl, None, None, None, f"{type(error).__name__}: {error}")
    weight_gbps = n * k * 2 / (graph_ms * 1e-3) / 1e9  # weight bytes read / graph time
    return Result(name, rows, impl, graph_ms * 1e3, None, weight_gbps)


def run_linear(
    rows_list: list[int], names: list[str], impls: list[str], dtype: torch.dtype
) -> list[Result]:
    results = []
    for name in names:
        for rows in rows_list:
            calls, _ = linear_calls(rows, *LINEAR_SHAPES[name], dtype)
            for impl in impls:
                results.append(time_linear(name, rows, impl, calls[impl], calls["F.linear"]))
        torch.cuda.empty_cache()
    return results


def sweep_configs(rows: int, k: int) -> list:
    """The Triton kernel's candidate configurations: CUDA-core products up to 8 rows,
    tensor cores at any row count."""
    import triton

    from engine.kernels.triton_linear import SkinnyConfig

    fit = sorted(
        {min(block_k, triton.next_power_of_2(k)) for block_k in (128, 256, 512, 1024, 2048)}
    )
    configs = []
    if rows <= 8:
        configs += [
            SkinnyConfig(False, block_n, block_k, warps, stages)
            for block_n in (2, 4, 8)
            for block_k in fit
            if block_k >= min(512, fit[-1])
            for warps, stages in ((4, 1), (8, 1), (4, 3))
        ]
    configs += [
        SkinnyConfig(True, block_n, block_k, warps, stages)
        for block_n in (16, 32)
        for block_k in fit
        if block_k <= 512
        for warps, stages in ((4, 3), (4, 5), (8, 4))
    ]
    return configs


def sweep_linear(name: str, rows: int, dtype: torch.dtype) -> dict | None:
    """Every candidate configuration at one shape and row count, against the rule's pick
    (engine/kernels/triton_linear.py pick_config) and F.linear."""
    from engine.kernels.triton_linear import pick_config

    n, k = LINEAR_SHAPES[name]
    calls, triton_with = linear_calls(rows, n, k, dtype)
    reference = calls["F.linear"]
    timed = [
        (config, time_linear(name, rows, "triton", triton_with(config), reference, rep=10))
        for config in sweep_configs(rows, k)
    ]
    ok = [(config, result) for config, result in timed if result.error is None]
    if not ok:
        print(f"linear sweep {name} rows {rows}: every configuration failed: {timed[0][1].error}")
        return None
    best_config, best = min(ok, key=lambda pair: pair[1].graph_us)
    rule = time_linear(name, rows, "triton", calls["triton"], reference, rep=10)
    cublas = time_linear(name, rows, "F.linear", reference, reference, rep=10)
    return {
        "op": name,
        "rows": rows,
        "best": asdict(best_config),
        "best_us": best.graph_us,
        "best_weight_tbps": best.graph_gbps / 1e3,
        "rule": asdict(pick_config(rows, n, k)),
        "rule_us": rule.graph_us,
        "f_linear_us": cublas.graph_us,
        "failed": len(timed) - len(ok),
        "all": [
            {**asdict(config), "us": result.graph_us, "error": result.error}
            for config, result in timed
        ],
    }


def run_linear_sweep(rows_list: list[int], names: list[str], dtype: torch.dtype) -> list[dict]:
    """The evidence for pick_config's rule, at up to 16 rows (where linear() may use it)."""
    found = []
    for name in names:
        for rows in [r for r in rows_list if r <= 16]:
            case = sweep_linear(name, rows, dtype)
            if case is not None:
                found.append(case)
            torch.cuda.empty_cache()
    return found


def print_linear_table(results: list[Result]) -> None:
    def cell(result: Result | None) -> str:
        if result is None or result.error:
            return f"{'error':>14}"
        return f"{result.graph_us:7.1f} {result.graph_gbps / 1e3:6.2f}"

    by_case: dict[tuple[str, int], dict[str, Result]] = {}
    for result in results:
        by_case.setdefault((result.op, result.tokens), {})[result.impl] = result
    impls = [impl for impl in LINEAR_IMPLS if any(r.impl == impl for r in results)]
    print(
        f"\n{'linear':<8} {'N x K':>13} {'rows':>4} | "
        + " | ".join(f"{impl:>14}" for impl in impls)
    )
    print(f"{'':<8} {'':>13} {'':>4} | " + " | ".join(f"{'graph us  TB/s':>14}" for _ in impls))
    for (name, rows), by_impl in by_case.items():
        shape = "x".join(map(str, LINEAR_SHAPES[name]))
        cells = " | ".join(cell(by_impl.get(impl)) for impl in impls)
        print(f"{name:<8} {shape:>13} {rows:>4} | {cells}")
    for result in results:
        if result.error:
            print(f"{result.op} {result.tokens} {result.impl}: {result.error}")

    # A decode step's share: one layer's four projections, and that times the layers.
    totals: dict[int, dict[str, float]] = {}
    for rows in sorted({rows for _, rows in by_case}):
        for impl in impls:
            parts = [by_case.get((name, rows), {}).get(impl) for name in LAYER_SHAPES]
            if all(part is not None and part.error is None for part in parts):
                totals.setdefault(rows, {})[impl] = sum(part.graph_us for part in parts)
    if not totals:
        return
    print(
        f"\nper decoder layer (qkv + o_proj + gate_up + down), graph us; x{NUM_LAYERS} layers in ms"
    )
    for rows, by_impl in totals.items():
        cells = "  ".join(
            f"{impl} {us:6.1f} ({us * NUM_LAYERS / 1e3:.3f})" for impl, us in by_impl.items()
        )
        print(f"  rows {rows:>3}: {cells}")
    if not any("triton" in by_impl for by_impl in totals.values()):
        return
    faster = [
        rows
        for rows, by_impl in totals.items()
        if by_impl.get("triton", 1e30) < by_impl.get("F.linear", 0.0)
    ]
    limit = 0
    for rows in totals:  # the largest row count up to which the kernel wins at every count
        if rows not in faster:
            break
        limit = rows
    print(f"the Triton kernel beats F.linear per layer at rows {faster}: SKINNY_MAX_ROWS = {limit}")


def config_name(config: dict) -> str:
    """A SkinnyConfig (as a dict) in one short word group: "cores n4 k1024 w4 s2"."""
    kind = "dot" if config["use_dot"] else "cores"
    return (
        f"{kind} n{config['block_n']} k{config['block_k']} "
        f"w{config['num_warps']} s{config['num_stages']}"
    )


def print_linear_sweep(found: list[dict]) -> None:
    if not found:
        return
    print("\nlinear sweep: the best configuration per shape and rows, against the rule's pick")
    for case in found:
        rule_us = case["rule_us"]
        rule = f"{rule_us:6.1f} us" if rule_us is not None else "error"
        cublas = case["f_linear_us"]
        print(
            f"  {case['op']:<8} rows {case['rows']:>2}: best {config_name(case['best']):<26}"
            f" {case['best_us']:6.1f} us {case['best_weight_tbps']:.2f} TB/s | rule"
            f" {config_name(case['rule']):<26} {rule} | F.linear"
            f" {cublas if cublas is None else round(cublas, 1)} us"
            + (f" | {case['failed']} configs failed" if case["failed"] else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="*", default=[1, 64, 256, 2048, 8192])
    parser.add_argument(
        "--sample-rows", type=int, nargs="*", default=[1, 256], help="rows of logits to sample"
    )
    parser.add_argument(
        "--linear-rows",
        type=int,
        nargs="*",
        default=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        help="rows of x (decode batch sizes) for the projections; none to skip them",
    )
    parser.add_argument(
        "--linear-shapes", nargs="+", default=list(LINEAR_SHAPES), choices=list(LINEAR_SHAPES)
    )
    parser.add_argument(
        "--linear-impls", nargs="+", default=list(LINEAR_IMPLS), choices=list(LINEAR_IMPLS)
    )
    parser.add_argument(
        "--linear-sweep",
        action="store_true",
        help="also time every candidate configuration of the Triton kernel (minutes)",
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--json-out", type=Path, help="also write the results here")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    import triton

    dtype = getattr(torch, args.dtype)
    # One compile per token count: past the limit torch.compile would fall back to eager.
    torch._dynamo.config.recompile_limit = max(8, 2 * len(args.tokens), 2 * len(args.sample_rows))
    torch.manual_seed(0)
    results = [
        measure(op, tokens, impl)
        for tokens in args.tokens
        for op in make_ops(tokens, dtype)
        for impl in IMPLS
    ]
    results += [
        measure(make_sampler_op(rows, dtype), rows, impl)
        for rows in args.sample_rows
        for impl in IMPLS
    ]
    print_table(results)
    linear_results = run_linear(args.linear_rows, args.linear_shapes, args.linear_impls, dtype)
    print_linear_table(linear_results)
    sweep = (
        run_linear_sweep(args.linear_rows, args.linear_shapes, dtype) if args.linear_sweep else []
    )
    print_linear_sweep(sweep)
    if args.json_out:
        info = {
            **run_info(),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "dtype": args.dtype,
            "shape": {
                "hidden": HIDDEN,
                "num_heads": NUM_HEADS,
                "num_kv_heads": NUM_KV_HEADS,
                "head_dim": HEAD_DIM,
                "intermediate": INTERMEDIATE,
                "vocab": VOCAB,
            },
        }
        payload = {
            "run": info,
            "results": [asdict(result) for result in results],
            # graph_gbps: weight bytes read per graph second; launch_us is not timed
            "linear": [asdict(result) for result in linear_results],
            "linear_sweep": sweep,
        }
        args.json_out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
