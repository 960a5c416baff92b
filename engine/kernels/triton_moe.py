"""The grouped GEMM of engine/kernels/fused_moe.py: out[pair] = A[pair // a_div] @ W[e]^T.

Rows arrive sorted by expert and padded per expert to BLOCK_M (fused_moe.pad_groups), so
a program owns BLOCK_M rows of one expert and BLOCK_N output columns: it reads that
expert's [BLOCK_N, K] weight tile in BLOCK_K steps and multiplies it into every valid row
with tl.dot, accumulating in float32. Padding rows (pair index == num_pairs) are masked
out of every load and store; a block past the last expert's rows (its expert == E)
returns at once, so the grid can be the worst case, fixed by T. Output rows are written
in pair order (token * k + slot), each exactly once. With a route, each row is multiplied
by its router weight in float32 before the one rounding to the output dtype.

The launcher never reads tensor values on the host, so it can be captured in a CUDA
graph; row counts are not specialized on. TRITON_INTERPRET=1 runs it on CPU tensors
(tests/test_fused_moe.py does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    pair_of_row_ptr,
    block_expert_ptr,
    route_ptr,
    num_pairs,
    num_experts,
    n,
    k,
    A_DIV: tl.constexpr,
    HAS_ROUTE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Axis 0 walks N so that neighbouring programs share the same rows of A (from L2).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    pairs = tl.load(pair_of_row_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs
    a_rows = tl.where(row_ok, pairs // A_DIV, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    offs_k = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + a_rows[:, None] * k + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_expert = w_ptr + expert.to(tl.int64) * n * k
    w_tile = w_expert + cols.to(tl.int64)[None, :] * k + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_ok = k0 + offs_k < k
        a = tl.load(a_tile + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_tile + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_ROUTE:
        acc *= tl.load(route_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * n + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def grouped_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    pair_of_row: torch.Tensor,
    block_expert: torch.Tensor,
    a_div: int,
    route: torch.Tensor | None,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """[num_pairs, N] in a's dtype: row p = a[p // a_div] @ weight[expert of p]^T (times
    route[p]). a [rows, K] and weight [E, N, K] contiguous; pair_of_row and block_expert
    from fused_moe.pad_groups with block_m; the block sizes are a fused_moe.MoeTiles."""
    assert a.is_contiguous() and weight.is_contiguous(), "a and weight must be contiguous"
    assert a.dtype == weight.dtype, "a and weight must share a dtype"
    num_experts, n, k = weight.shape
    assert a.shape[1] == k, f"a is {list(a.shape)} but weight is {list(weight.shape)}"
    num_pairs = a.shape[0] * a_div
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    if num_pairs == 0:
        return out
    grid = (triton.cdiv(n, block_n), block_expert.numel())
    _grouped_gemm_kernel[grid](
        a,
        weight,
        out,
        pair_of_row,
        block_expert,
        route,
        num_pairs,
        num_experts,
        n,
        k,
        A_DIV=a_div,
        HAS_ROUTE=route is not None,
        # float32 models multiply in float32, not tf32; 16-bit inputs ignore it.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
