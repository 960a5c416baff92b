"""The Triton kernels of a sparse layer on CUDA: the router's top-k softmax, the rows'
layout by expert, then the grouped GEMM out[pair] = A[pair // a_div] @ W[e]^T
(engine/kernels/fused_moe.py).

`top_k_softmax` takes the router's logits to each token's k (weight, expert) pairs in one
kernel, where torch takes a softmax, a top-k, a sum, a division and a cast.

`align_rows` lays the T*k (token, slot) pairs out by expert, each expert's rows padded to
BLOCK_M, in three launches where torch would take a sort and a score of small kernels (at
decode, where every layer does this, the launches cost more than the work):
- `_expert_counts_kernel`: each chunk of CHUNK pairs counts its pairs per expert;
- their running sums over the chunks (torch.cumsum): all chunks' give each expert's
  padded start, the chunks' before a program's where its pairs go within an expert;
- `_align_kernel`: each program places its chunk's pairs (in pair order within an
  expert: after a pair's chunk's earlier pairs of the same expert), marks its chunk of
  rows that no pair takes as padding, and gives each block of BLOCK_M rows its expert (E
  past the last expert's rows).
Each row is written once, by one program; the result is what a stable sort by expert and
the padding give (tests/test_fused_moe.py holds that torch statement).

The grouped GEMM: rows arrive sorted by expert and padded per expert to BLOCK_M, so
a program owns BLOCK_M rows of one expert and BLOCK_N output columns: it reads that
expert's [BLOCK_N, K] weight tile in BLOCK_K steps and multiplies it into every valid row
with tl.dot, accumulating in float32. Padding rows (pair index == num_pairs) are masked
out of every load and store; a block past the last expert's rows (its expert == E)
returns at once, so the grid can be the worst case, fixed by T. Output rows are written
in pair order (token * k + slot), each exactly once. With a route, each row is multiplied
by its router weight in float32 before the one rounding to the output dtype.

The launchers never read tensor values on the host, so they can be captured in a CUDA
graph; pair counts are not specialized on. TRITON_INTERPRET=1 runs them on CPU tensors
(tests/test_fused_moe.py does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _top_k_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    # One token: the softmax of its router logits in float32, and its K largest, largest
    # first (the lowest expert id among equal logits), chosen on the logits themselves.
    token = tl.program_id(0)
    lanes = tl.arange(0, E_PAD)
    is_expert = lanes < num_experts
    logits = tl.load(logits_ptr + token * stride + lanes, mask=is_expert, other=float("-inf"))
    logits = logits.to(tl.float32)
    top = tl.max(logits, 0)
    denom = tl.sum(tl.where(is_expert, tl.exp(logits - top), 0.0), 0)
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], dtype=tl.float32)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    left = logits
    for slot in tl.static_range(K):
        best = tl.max(left, 0)
        # In range even if a NaN logit matched nothing: the layout trusts these ids.
        chosen = tl.minimum(tl.min(tl.where(left == best, lanes, E_PAD), 0), num_experts - 1)
        weights = tl.where(slots == slot, tl.exp(best - top) / denom, weights)
        ids = tl.where(slots == slot, chosen, ids)
        left = tl.where(lanes == chosen, float("-inf"), left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(weights_ptr + token * K + slots, weights, mask=slots < K)
    tl.store(ids_ptr + token * K + slots, ids, mask=slots < K)


def top_k_softmax(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice from its logits [T, E] in one kernel: (float32 weights [T, k],
    int32 expert ids [T, k]), the k largest of the float32 softmax, largest first,
    divided by their sum where `renormalize`."""
    num_tokens, num_experts = logits.shape
    assert logits.stride(1) == 1 and top_k <= num_experts
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    _top_k_softmax_kernel[(num_tokens,)](
        logits,
        weights,
        ids,
        num_experts,
        logits.stride(0),
        K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        E_PAD=triton.next_power_of_2(num_experts),
        RENORMALIZE=renormalize,
    )
    return weights, ids


# Pairs (and rows) a program of the alignment kernels takes at once.
ALIGN_CHUNK = 128


@triton.jit(do_not_specialize=["num_pairs"])
def _expert_counts_kernel(
    experts_ptr, counts_ptr, num_pairs, num_experts, E_PAD: tl.constexpr, CHUNK: tl.constexpr
):
    # counts[chunk, e]: the pairs of this chunk that chose expert e.
    chunk = tl.program_id(0)
    pairs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(experts_ptr + pairs, mask=pairs < num_pairs, other=-1)
    lanes = tl.arange(0, E_PAD)
    counts = tl.sum((ids[:, None] == lanes[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + chunk * num_experts + lanes, counts, mask=lanes < num_experts)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "num_rows"])
def _align_kernel(
    experts_ptr,
    counts_ptr,
    running_ptr,  # [chunks, E]: counts summed over the chunks up to and including each
    pair_of_row_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    num_chunks,
    num_rows,
    BLOCK_M: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    lanes = tl.arange(0, E_PAD)
    is_expert = lanes < num_experts
    totals = tl.load(running_ptr + (num_chunks - 1) * num_experts + lanes, mask=is_expert, other=0)
    # A program past the pairs has only rows to mark: it reads no chunk's counts.
    own = lanes < tl.where(pid < num_chunks, num_experts, 0)
    before = tl.load(running_ptr + pid * num_experts + lanes, mask=own, other=0) - tl.load(
        counts_ptr + pid * num_experts + lanes, mask=own, other=0
    )
    padded = (totals + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded

    # This program's chunk of pairs, each to its expert's start, after the pairs of that
    # expert in earlier chunks, and after those of its own chunk with a smaller index.
    offs = tl.arange(0, CHUNK)
    pairs = pid * CHUNK + offs
    ids = tl.load(experts_ptr + pairs, mask=pairs < num_pairs, other=-1)
    chose = ids[:, None] == lanes[None, :]  # [CHUNK, E_PAD]
    first_free = tl.sum(tl.where(chose, (starts + before)[None, :], 0), axis=1)
    same_before = (ids[:, None] == ids[None, :]) & (offs[None, :] < offs[:, None])
    rank = tl.sum(same_before.to(tl.int32), axis=1)
    tl.store(pair_of_row_ptr + first_free + rank, pairs, mask=pairs < num_pairs)

    # This program's chunk of rows: those past their expert's pairs are padding; each
    # block's expert is the number of experts whose padded rows end at or before it.
    rows = pid * CHUNK + offs
    ended = (ends[None, :] <= rows[:, None]) & is_expert[None, :]
    expert = tl.sum(ended.to(tl.int32), axis=1)
    at = expert[:, None] == lanes[None, :]
    taken = tl.sum(tl.where(at, (starts + totals)[None, :], 0), axis=1)
    padding = (rows >= taken) | (expert >= num_experts)
    tl.store(pair_of_row_ptr + rows, num_pairs, mask=padding & (rows < num_rows))
    blocks = pid * (CHUNK // BLOCK_M) + tl.arange(0, CHUNK // BLOCK_M)
    block_ended = (ends[None, :] <= (blocks * BLOCK_M)[:, None]) & is_expert[None, :]
    block_expert = tl.sum(block_ended.to(tl.int32), axis=1)
    tl.store(block_expert_ptr + blocks, block_expert, mask=blocks * BLOCK_M < num_rows)


def align_rows(
    experts: torch.Tensor, num_experts: int, block_m: int, num_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair index of each of num_rows rows [num_rows], num_pairs for padding; expert of
    each block of block_m rows [num_rows / block_m], num_experts past the last expert's
    rows) for the router's choice `experts` [T, k]. num_rows: fused_moe.padded_size."""
    assert experts.is_contiguous() and ALIGN_CHUNK % block_m == 0 and num_rows % block_m == 0
    num_pairs = experts.numel()
    device = experts.device
    pair_of_row = torch.empty(num_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_rows // block_m, dtype=torch.int32, device=device)
    if num_pairs == 0:
        return pair_of_row, block_expert
    num_chunks = triton.cdiv(num_pairs, ALIGN_CHUNK)
    counts = torch.empty(num_chunks, num_experts, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(num_experts)
    _expert_counts_kernel[(num_chunks,)](
        experts, counts, num_pairs, num_experts, E_PAD=e_pad, CHUNK=ALIGN_CHUNK, num_warps=8
    )
    grid = (max(num_chunks, triton.cdiv(num_rows, ALIGN_CHUNK)),)
    _align_kernel[grid](
        experts,
        counts,
        counts.cumsum(0, dtype=torch.int32),
        pair_of_row,
        block_expert,
        num_pairs,
        num_experts,
        num_chunks,
        num_rows,
        BLOCK_M=block_m,
        E_PAD=e_pad,
        CHUNK=ALIGN_CHUNK,
        num_warps=8,  # [CHUNK, E_PAD] comparisons: fewer of them a thread
    )
    return pair_of_row, block_expert


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
    GATED: tl.constexpr,  # W is [E, 2n, K], gate rows then up rows; out silu(gate) * up
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
    w_expert = w_ptr + expert.to(tl.int64) * (2 * n if GATED else n) * k
    w_tile = w_expert + cols.to(tl.int64)[None, :] * k + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GATED only
    for k0 in range(0, k, BLOCK_K):
        k_ok = k0 + offs_k < k
        a = tl.load(a_tile + k0, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        w = tl.load(w_tile + k0, mask=w_ok, other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_tile + n * k + k0, mask=w_ok, other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
    if GATED:  # rounded where silu_and_mul would see them: gate, up and silu(gate)
        dtype = out_ptr.dtype.element_ty
        gate = acc.to(dtype).to(tl.float32)
        act = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
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
    gated: bool = False,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    num_stages: int,
) -> torch.Tensor:
    """[num_pairs, N] in a's dtype: row p = a[p // a_div] @ weight[expert of p]^T (times
    route[p]). a [rows, K] and weight [E, N, K] contiguous; pair_of_row and block_expert
    from align_rows with block_m; the block sizes are a fused_moe.MoeTiles.

    gated: weight is gate_up [E, 2I, K] and the result [num_pairs, I] is silu_and_mul of
    that product, in the GEMM's epilogue (no [num_pairs, 2I] written and read back); a
    program then reads block_n / 2 gate rows and as many up rows, the weight bytes of an
    ungated one."""
    assert a.is_contiguous() and weight.is_contiguous(), "a and weight must be contiguous"
    assert a.dtype == weight.dtype, "a and weight must share a dtype"
    num_experts, n, k = weight.shape
    assert a.shape[1] == k, f"a is {list(a.shape)} but weight is {list(weight.shape)}"
    if gated:
        n, block_n = n // 2, block_n // 2
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
        GATED=gated,
        # float32 models multiply in float32, not tf32; 16-bit inputs ignore it.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
