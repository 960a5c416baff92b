"""Skinny GEMMs for decoding: out[M, N] = x[M, K] @ W[N, K]^T (+ bias) for a few rows of x.

At batch 1 to 16 a projection is a weight read: W (N x K, bf16/fp16, row-major) is
megabytes, x and out are kilobytes, so the kernel is designed for memory bandwidth, not
FLOPs. Each program owns BLOCK_N rows of W (BLOCK_N output columns) and walks the whole
of K in BLOCK_K steps, loading a [BLOCK_N, BLOCK_K] tile of W once (16-byte loads along
K, evicted first: nothing reads it again in the step) and applying it to every row of x
(rows padded to a power of two repeat x's last row and are never stored), so W is read
exactly once; accumulation is float32, the output is rounded once to x's dtype, after the
bias is added in float32. There is no K split, so no atomics and no second pass: the grid
is cdiv(N, BLOCK_N) programs, and a small BLOCK_N (4 rows: 256 programs for N = 1024)
fills the GPU's 132 SMs where N is small.

Two ways to form the products, chosen per shape by `pick_config`:
- CUDA cores (use_dot=False): per row m of x, sum(W_tile * x[m]) over K in float32,
  meant for 1-2 rows, where tensor cores would pad the rows to 16 (its multiply-adds
  grow with the rows and would compete with the loads at 8 or more);
- tensor cores (use_dot=True): tl.dot(x_tile, W_tile^T), x padded to 16 rows (the mma's
  smallest M): the multiply-adds stop costing CUDA-core time as the rows grow, and the
  W tiles stream through Triton's software pipeline (num_stages).

Block sizes come from `pick_config`, a fixed rule that benchmarks/gpu_kernels.py
--linear-sweep checks against every candidate; nothing is autotuned at run time (an
autotuner would benchmark inside a CUDA-graph capture). The launcher never reads tensor values on the host, so it can be
captured; the row count is not specialized on (do_not_specialize), so a new batch size
only compiles again when it changes the power-of-two row block.

`skinny_fp8_linear` runs the same kernel on an fp8 (e4m3) W with a float32 scale per
output row, and x as it is (16-bit): a decode batch's x is kilobytes, so quantizing it
would save no bytes and cost a kernel. Each W tile is widened to x's dtype (exact: every
e4m3 value is a bfloat16 and a float16), and the scale multiplies each float32 sum before
the bias and the one rounding. On CUDA cores pick_config keeps a program's bytes of W
the same for one-byte weights as for two-byte ones (K steps twice as long); the tensor-core
form keeps its K steps, whose shared memory is mostly x's padded rows.

TRITON_INTERPRET=1 runs this kernel on CPU tensors (tests/test_triton_linear.py does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# At most this many rows take the CUDA-core products; more take tensor cores.
CUDA_CORE_MAX_ROWS = 2


@dataclass(frozen=True)
class SkinnyConfig:
    use_dot: bool  # tensor cores (tl.dot) or CUDA-core multiply-and-sum
    block_n: int  # W rows (output columns) per program
    block_k: int  # K per loop step
    num_warps: int
    num_stages: int


def pick_config(rows: int, n: int, k: int, weight_bytes: int = 2) -> SkinnyConfig:
    """The launch configuration for an x of `rows` rows and a W of [n, k], weight_bytes
    bytes an element (1: fp8).

    A program's W tile is its bytes in flight: with BLOCK_K = 1024 the 256 programs of an
    N = 1024 weight (all resident at once) have 2 MB in flight on CUDA cores, about the
    H200's bandwidth-latency product; tensor cores get there through pipeline stages.
    A first rule, reasoned rather than measured: benchmarks/gpu_kernels.py --linear-sweep
    prints the best candidate per shape and row count beside this rule's pick.
    """
    if rows <= CUDA_CORE_MAX_ROWS:
        block_k = min(triton.next_power_of_2(k), 1024 * 2 // weight_bytes)
        return SkinnyConfig(use_dot=False, block_n=4, block_k=block_k, num_warps=4, num_stages=2)
    block_k = min(triton.next_power_of_2(k), 256)
    return SkinnyConfig(use_dot=True, block_n=16, block_k=block_k, num_warps=4, num_stages=4)


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    w_scale_ptr,
    num_rows,
    n,
    k,
    HAS_BIAS: tl.constexpr,
    HAS_W_SCALE: tl.constexpr,
    USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Padding rows (num_rows <= m < BLOCK_M) read x's last row instead of a masked load
    # (in bounds, from L1) and are never stored. The K mask stays constant over 16
    # elements when k % 16 == 0 (Triton specializes k on that), so loads stay 16 bytes wide.
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    col_ok = cols < n
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * k + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_tile = x_ptr + tl.minimum(rows, num_rows - 1)[:, None] * k + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_ok = (k0 + offs_k < k)[None, :]
        w = tl.load(
            w_tile + k0, mask=col_ok[:, None] & k_ok, other=0.0, eviction_policy="evict_first"
        )
        if USE_DOT:
            x = tl.load(x_tile + k0, mask=k_ok, other=0.0)  # [BLOCK_M, BLOCK_K]
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        else:
            w32 = w.to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                # Row m of x as [1, BLOCK_K]; a row of BLOCK_M beyond num_rows repeats the last.
                x_m = tl.load(
                    x_ptr + tl.minimum(m, num_rows - 1) * k + k0 + offs_k[None, :],
                    mask=k_ok,
                    other=0.0,
                )
                part = tl.sum(w32 * x_m.to(tl.float32), axis=1)  # [BLOCK_N]
                acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    if HAS_W_SCALE:  # an fp8 W: its scale per output column
        acc *= tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None] * n + cols[None, :]
    tl.store(
        out, acc.to(out_ptr.dtype.element_ty), mask=(rows < num_rows)[:, None] & col_ok[None, :]
    )


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> a fresh contiguous [M, N] in x's dtype.

    x and weight must be contiguous and of one 16-bit float dtype (bias too); `config`
    overrides pick_config (the benchmark's sweep passes candidates).
    """
    assert weight.dtype == x.dtype, "x and weight must share a dtype"
    return _launch(x, weight, bias, None, config)


def skinny_fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] * weight_scale [N])^T (+ bias [N]) -> [M, N] in x's
    dtype, for an fp8 weight with a float32 scale per output row (engine/kernels/
    fp8_linear.py), the scale applied to the float32 sums before the one rounding."""
    assert weight.dtype == torch.float8_e4m3fn, "an fp8 (e4m3fn) weight only"
    assert weight_scale.numel() == weight.shape[0] and weight_scale.dtype == torch.float32
    return _launch(x, weight, bias, weight_scale, config)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    config: SkinnyConfig | None,
) -> torch.Tensor:
    """The checks both weights share (x 16-bit, shapes, layout, the bias in x's dtype),
    then the kernel into a fresh [M, N] of x's dtype."""
    assert x.dtype in (torch.bfloat16, torch.float16), "16-bit float inputs only"
    assert x.dim() == 2 and weight.dim() == 2, "x is [M, K], weight [N, K]"
    assert x.is_contiguous() and weight.is_contiguous(), "x and weight must be contiguous"
    num_rows, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k, f"x is [{num_rows}, {k}] but weight is {list(weight.shape)}"
    if bias is not None:
        assert bias.shape == (n,) and bias.dtype == x.dtype and bias.is_contiguous()
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    config = config or pick_config(num_rows, n, k, weight.element_size())
    block_m = triton.next_power_of_2(num_rows)
    if config.use_dot:
        block_m = max(block_m, 16)  # the mma's rows; padding rows are never stored
    _skinny_linear_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        bias,
        out,
        weight_scale,
        num_rows,
        n,
        k,
        HAS_BIAS=bias is not None,
        HAS_W_SCALE=weight_scale is not None,
        USE_DOT=config.use_dot,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
