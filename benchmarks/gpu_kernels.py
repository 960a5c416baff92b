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

store_kv's torch path finds padding rows with a host sync and cannot be captured, so its
eager and compile columns time the plain indexed write it reduces to when no row is
padding (a prefill's case).

    python benchmarks/gpu_kernels.py --tokens 1 256 --sample-rows 1 256   # decode shapes only
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
from engine.kernels.rotary import rotary_qk_torch  # noqa: E402
from engine.sampler import exponential_race_torch  # noqa: E402

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


COMPILED = {  # compiled lazily, on first call, once per shape
    fn: torch.compile(fn, dynamic=False)
    for fn in (
        fused_add_rms_norm_torch,
        rms_norm_torch,
        silu_and_mul_torch,
        store_kv_indexed,
        rotary_qk_torch,
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

    # Qwen3's attention input: q and k normed per head and rotated, read from the qkv output.
    k_heads = qkv[:, NUM_HEADS * HEAD_DIM : (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM]
    k_heads = k_heads.view(tokens, NUM_KV_HEADS, HEAD_DIM)
    angles = torch.rand(tokens, HEAD_DIM // 2, device="cuda") * 6.3
    cos, sin = angles.cos(), angles.sin()
    q_weight, k_weight = (1 + 0.1 * randn(HEAD_DIM) for _ in range(2))
    rotary_args = (q, k_heads, cos, sin, q_weight, k_weight, EPS)
    rotary = {
        "triton": lambda: triton_kernels.rotary_qk(*rotary_args),
        "eager": lambda: rotary_qk_torch(*rotary_args),
        "compile": lambda: COMPILED[rotary_qk_torch](*rotary_args),
    }

    gate_up = randn(tokens, 2 * INTERMEDIATE)
    silu = {
        "triton": lambda: triton_kernels.silu_and_mul(gate_up),
        "eager": lambda: silu_and_mul_torch(gate_up),
        "compile": lambda: COMPILED[silu_and_mul_torch](gate_up),
    }

    k, v = randn(tokens, NUM_KV_HEADS, HEAD_DIM), randn(tokens, NUM_KV_HEADS, HEAD_DIM)
    num_blocks = 2 * -(-8192 // BLOCK_SIZE)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device="cuda")[:tokens]  # scattered, as decodes
    caches = {  # one pool each, so the correctness check compares two writes
        impl: torch.zeros(
            num_blocks, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype
        )
        for impl in IMPLS
    }

    def store_with(store_kv: Callable[..., None], impl: str) -> Callable[[], torch.Tensor]:
        def call() -> torch.Tensor:
            store_kv(k, v, caches[impl], slots)
            return caches[impl]

        return call

    store = {
        "triton": store_with(triton_kernels.store_kv, "triton"),
        "eager": store_with(store_kv_indexed, "eager"),
        "compile": store_with(COMPILED[store_kv_indexed], "compile"),
    }

    row_bytes = tokens * size
    qk_bytes = row_bytes * (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM * 2  # read q, k; write both
    return [
        Op("fused_add_rms_norm", add_norm, row_bytes * HIDDEN * 4),  # read x, r; write out, r
        Op("rms_norm q heads", qk_norm, row_bytes * NUM_HEADS * HEAD_DIM * 2),
        # An input one bf16 ulp off (its rsqrt) rotates into an output one ulp of the input
        # off, however small the output (tests/test_kernels.py rotary_tolerance).
        Op(
            "rotary_qk + qk norm",
            rotary,
            qk_bytes + tokens * HEAD_DIM * 4,
            {"rtol": 2e-2, "atol": 0.125},
        ),
        Op("silu_and_mul", silu, row_bytes * INTERMEDIATE * 3),
        Op("store_kv", store, row_bytes * NUM_KV_HEADS * HEAD_DIM * 4),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 2048, 8192])
    parser.add_argument(
        "--sample-rows", type=int, nargs="*", default=[1, 256], help="rows of logits to sample"
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
        payload = {"run": info, "results": [asdict(result) for result in results]}
        args.json_out.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
