"""Skinny GEMMs for decoding: out[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M up to a few
hundred rows of x.

A decode step's projections are small: W (N x K, bf16/fp16, row-major) is 4-13 MB, x a
few hundred rows at most. cuBLAS tiles such a product into a handful of output tiles, so
a few SMs each stream megabytes of W while the rest idle: the four projections of a
Qwen3-0.6B layer take 25-28 us from 8 to 256 rows against ~7 us of weight reads at the
H200's bandwidth. This kernel spreads W over every SM instead:

- each program owns a [BLOCK_M, BLOCK_N] output tile and one of SPLIT_K equal slices of
  K, so W's N x K is cut into enough pieces to fill the GPU (split-K);
- W is loaded once per tile, evicted first (nothing reads it again in the step); x's
  rows are re-read from L2 by every column tile;
- with SPLIT_K > 1 each program writes its float32 partial tile to a workspace, then
  counts itself in on the tile's counter (an atomic); the last of the tile's programs to
  arrive sums the SPLIT_K partials in order 0..SPLIT_K-1 (the same order whichever
  arrives last, so results are deterministic), adds the bias, rounds once to x's dtype,
  stores, and resets the counter for the next call. One kernel, no memset, no second
  pass. The counters are one zeroed buffer per device, shared by every call: calls on one
  stream run one after another, and each leaves its counters at zero.

Two ways to form the products, chosen per shape by `pick_config`:
- CUDA cores (use_dot=False): per row m of x, sum(W_tile * x[m]) over K in float32,
  for 1-2 rows, where tensor cores would pad the rows to 16;
- tensor cores (use_dot=True): tl.dot(x_tile, W_tile^T), x padded to BLOCK_M >= 16 rows.

`gated=True` fuses SwiGLU's activation into the product: x is the gate-up projection's
output [M, 2K] and the kernel multiplies silu(x[:, :K]) * x[:, K:] (computed and rounded
exactly as engine/kernels' silu_and_mul does) by W, so a decode step's down projection
needs no separate activation kernel and no [M, K] intermediate.

Block sizes come from `pick_config`, a fixed rule that benchmarks/gpu_kernels.py
--linear-sweep checks against every candidate; nothing is autotuned at run time (an
autotuner would benchmark inside a CUDA-graph capture). The launcher never reads tensor
values on the host, so it can be captured; the row count is not specialized on
(do_not_specialize). The configuration depends on the row count only through thresholds
that are CUDA-graph batch sizes (engine/cuda_graphs.py), so an eager step and the graph
it pads to run the same configuration and give the same numbers.

TRITON_INTERPRET=1 runs this kernel on CPU tensors (tests/test_triton_linear.py does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# At most this many rows take the CUDA-core products; more take tensor cores.
CUDA_CORE_MAX_ROWS = 2
# Split-K aims for about this many programs per GEMM: two per SM of the H200's 132.
TARGET_PROGRAMS = 264
# Tiles one call may count on (the counters buffer's length).
MAX_TILES = 16384


@dataclass(frozen=True)
class SkinnyConfig:
    use_dot: bool  # tensor cores (tl.dot) or CUDA-core multiply-and-sum
    block_n: int  # W rows (output columns) per program
    block_k: int  # K per loop step
    num_warps: int
    num_stages: int
    split_k: int = 1  # programs sharing one output tile, each over a slice of K
    block_m: int = 64  # most x rows per program on tensor cores (at least 16 are used)


def pick_config(rows: int, n: int, k: int) -> SkinnyConfig:
    """The launch configuration for an x of `rows` rows and a W of [n, k].

    CUDA cores (1-2 rows): a program's W tile is its bytes in flight, and with BLOCK_K =
    1024 the 256 programs of an N = 1024 weight have 2 MB in flight, about the H200's
    bandwidth-latency product. Tensor cores: 64-column tiles, K split until the GEMM has
    about TARGET_PROGRAMS programs, each slice at least two BLOCK_K steps long.
    benchmarks/gpu_kernels.py --linear-sweep prints the best candidate per shape and row
    count beside this rule's pick.
    """
    if rows <= CUDA_CORE_MAX_ROWS:
        block_k = min(triton.next_power_of_2(k), 1024)
        return SkinnyConfig(use_dot=False, block_n=4, block_k=block_k, num_warps=4, num_stages=2)
    block_m = 16 if rows <= 16 else 64  # 16 and 64 are CUDA-graph batch sizes
    block_n, block_k = 64, 128
    tiles = triton.cdiv(n, block_n) * triton.cdiv(rows, block_m)
    split_k = max(1, min(TARGET_PROGRAMS // tiles, k // (2 * block_k)))
    return SkinnyConfig(
        use_dot=True,
        block_n=block_n,
        block_k=block_k,
        num_warps=4,
        num_stages=3,
        split_k=split_k,
        block_m=block_m,
    )


@triton.jit
def _load_x(x_ptr, rows, offs_k, k0, k, x_stride, k_ok, GATED: tl.constexpr):
    # x's [rows, BLOCK_K] tile at k0 (rows are in bounds). Gated: silu(gate) * up from the
    # two halves of a gate-up row, rounded where silu_and_mul rounds.
    at = x_ptr + rows[:, None] * x_stride + k0 + offs_k[None, :]
    if GATED:
        gate = tl.load(at, mask=k_ok, other=0.0)
        up = tl.load(at + k, mask=k_ok, other=0.0)
        gate32 = gate.to(tl.float32)
        act = (gate32 * tl.sigmoid(gate32)).to(gate.dtype)
        return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    return tl.load(at, mask=k_ok, other=0.0)


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partials_ptr,  # float32 [SPLIT_K, num_rows, n] (SPLIT_K > 1 only)
    counters_ptr,  # int32, one per output tile, zero between calls
    num_rows,
    n,
    k,
    x_stride,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    USE_DOT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Padding rows (num_rows <= row < BLOCK_M) read x's last row instead of a masked load
    # (in bounds, from L1) and are never stored. The K mask stays constant over 16
    # elements when k % 16 == 0 (Triton specializes k on that), so loads stay 16 bytes wide.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_read = tl.minimum(rows, num_rows - 1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    col_ok = cols < n
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k, k_start + k_per_split)
    w_tile = w_ptr + cols.to(tl.int64)[:, None] * k + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = (k0 + offs_k < k_end)[None, :]
        w = tl.load(
            w_tile + k0, mask=col_ok[:, None] & k_ok, other=0.0, eviction_policy="evict_first"
        )
        if USE_DOT:
            x = _load_x(x_ptr, rows_read, offs_k, k0, k, x_stride, k_ok, GATED)
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            w32 = w.to(tl.float32)
            for m in tl.static_range(BLOCK_M):
                # Row m of x as [1, BLOCK_K]; a row of BLOCK_M beyond num_rows repeats the last.
                row_m = tl.zeros((1,), dtype=tl.int32) + tl.minimum(m, num_rows - 1)
                x_m = _load_x(x_ptr, row_m, offs_k, k0, k, x_stride, k_ok, GATED)
                part = tl.sum(w32 * x_m.to(tl.float32), axis=1)  # [BLOCK_N]
                acc = tl.where(rows[:, None] == m, acc + part[None, :], acc)
    tile_ok = (rows < num_rows)[:, None] & col_ok[None, :]
    out_at = rows[:, None] * n + cols[None, :]
    if SPLIT_K > 1:
        slice_size = num_rows * n
        tl.store(partials_ptr + pid_k * slice_size + out_at, acc, mask=tile_ok)
        tl.debug_barrier()  # every thread's partial is written before the count below
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the tile's last program: sum the slices in order
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(
                    partials_ptr + s * slice_size + out_at,
                    mask=tile_ok,
                    other=0.0,
                    cache_modifier=".cg",  # from L2, where the other programs wrote
                )
            _store_out(out_ptr + out_at, acc, bias_ptr, cols, col_ok, tile_ok, HAS_BIAS)
            tl.atomic_xchg(counters_ptr + tile, 0)
    else:
        _store_out(out_ptr + out_at, acc, bias_ptr, cols, col_ok, tile_ok, HAS_BIAS)


@triton.jit
def _store_out(out, acc, bias_ptr, cols, col_ok, tile_ok, HAS_BIAS: tl.constexpr):
    # The bias is added in float32, then the tile is rounded once to the output dtype.
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out, acc.to(out.dtype.element_ty), mask=tile_ok)


@functools.cache
def _tile_counters(device: torch.device) -> torch.Tensor:
    """The split-K arrival counters of one device. Made by the first (eager) call: the
    CUDA-graph runner warms up before it captures, so no capture allocates them."""
    return torch.zeros(MAX_TILES, dtype=torch.int32, device=device)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: SkinnyConfig | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias [N]) -> a fresh contiguous [M, N] in x's dtype;
    with gated=True x is [M, 2K] and the product is (silu(x[:, :K]) * x[:, K:]) @ weight^T.

    x and weight must be contiguous and of one 16-bit float dtype (bias too); `config`
    overrides pick_config (the benchmark's sweep passes candidates).
    """
    assert x.dim() == 2 and weight.dim() == 2, "x is [M, K], weight [N, K]"
    assert x.is_contiguous() and weight.is_contiguous(), "x and weight must be contiguous"
    assert x.dtype in (torch.bfloat16, torch.float16), "16-bit float inputs only"
    assert weight.dtype == x.dtype, "x and weight must share a dtype"
    num_rows, x_width = x.shape
    n, k = weight.shape
    expected_width = 2 * k if gated else k
    assert x_width == expected_width, (
        f"x is [{num_rows}, {x_width}] but weight is {list(weight.shape)}"
        + (" (gated: x holds gate and up, 2K wide)" if gated else "")
    )
    if bias is not None:
        assert bias.shape == (n,) and bias.dtype == x.dtype and bias.is_contiguous()
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    config = config or pick_config(num_rows, n, k)
    if config.use_dot:
        block_m = min(max(triton.next_power_of_2(num_rows), 16), max(config.block_m, 16))
    else:
        block_m = triton.next_power_of_2(num_rows)
    grid_n, grid_m = triton.cdiv(n, config.block_n), triton.cdiv(num_rows, block_m)
    # Slices of whole BLOCK_K steps; a split that would leave a slice empty is dropped.
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    split_k = triton.cdiv(k, k_per_split)
    if split_k > 1:
        assert grid_n * grid_m <= MAX_TILES, f"{grid_n * grid_m} output tiles; at most {MAX_TILES}"
        partials = torch.empty(split_k, num_rows, n, dtype=torch.float32, device=x.device)
        counters = _tile_counters(x.device)
    else:
        partials = counters = out  # not read
    _skinny_linear_kernel[(grid_n, grid_m, split_k)](
        x,
        weight,
        bias,
        out,
        partials,
        counters,
        num_rows,
        n,
        k,
        x_width,
        k_per_split,
        HAS_BIAS=bias is not None,
        GATED=gated,
        USE_DOT=config.use_dot,
        SPLIT_K=split_k,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
