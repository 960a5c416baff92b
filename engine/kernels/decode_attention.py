"""Paged decode attention in Triton: every sequence's KV cut into chunks of one length.

One new token per sequence attends to all of that sequence's KV in the paged pool
([num_blocks, 2, block_size, num_kv_heads, head_dim], the engine's layout). The work is
split into items, each one chunk of the same number of tokens of one sequence, and the
kernel runs one program per (KV head, item): it streams the chunk's K and V once for all
the query heads of its group (padded to a tensor-core tile), with an online softmax. A
sequence of one chunk writes its output directly; the chunks of a longer one leave
partial outputs and log-sum-exps that a second kernel merges.

Why: flashinfer's decode kernels give every (sequence, KV head) one thread block at the
batch sizes of a busy server, so each layer's attention ends with its longest sequences
running alone. Equal chunks, a couple per streaming multiprocessor and KV head, keep the
whole GPU streaming KV to the end. On the H200, at the offline workload's decode steps,
this kernel takes 158 / 162 / 122 / 78 / 44 us a layer against flashinfer's best
170 / 174 / 132 / 80 / 47 (benchmarks/RESULTS.md, "Decode attention on GPU").

The CUDA-graph decode runs it (engine/attention/triton_decode.py): a DecodeWorkspace
per captured batch size holds the step's plan at fixed device addresses, and every launch
covers the workspace's capacity of items, so a graph replays any step's split unchanged.

A sliding-window layer (window W) reads only each sequence's last min(seq_len, W) keys. Its
layers get a workspace of their own, whose plan splits those window lengths and gives each
sequence the position its window starts at (kv_starts): the kernel adds it to every
chunk's token positions, so both kinds of layer replay in one graph with no host work
between them.

An fp8 pool (engine/kv/fp8.py) is read as it is stored: each K and V tile is converted to
q's dtype (exact: every e4m3 value is a bfloat16 and a float16), the layer's K scale is
folded into the softmax scale (scores are linear in K) and its V scale multiplies the
output (which is linear in V), partial outputs included, so the merge is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from engine.kernels.triton_kernels import _pdl_options, _pdl_start

# Chunks never shorter than this many tokens: below it a program's start-up outweighs its
# reading.
MIN_CHUNK_TOKENS = 128
# The most elements of a K (or V) tile a loop step reads: 128 tokens of a 128-wide head.
MAX_TILE_ELEMENTS = 128 * 128


@dataclass(frozen=True)
class DecodeConfig:
    """How a batch size's decode runs (benchmarks/gpu_attention.py's sweep:
    benchmarks/results/h200-attention-triton-sweep-02abb42.json)."""

    items_per_sm: int  # chunks beyond one per sequence, per streaming multiprocessor
    block_n: int  # tokens per step of a program's loop
    num_stages: int  # Triton's software pipeline depth for that loop

    @staticmethod
    def for_batch(batch_size: int, head_dim: int) -> DecodeConfig:
        # From 64 sequences, 128-token steps and two chunks per SM were fastest at the
        # workload's busy steps (head_dim 128); below it one chunk per SM and 64-token
        # steps. A wider head takes shorter steps: each pipeline stage's K and V tiles stay
        # within those measured at 128 (3 stages of 128 x 128 fit the H100's shared memory;
        # head_dim 256 at 128 tokens would not).
        items_per_sm, block_n = (2, 128) if batch_size >= 64 else (1, 64)
        block_n = min(block_n, MAX_TILE_ELEMENTS // triton.next_power_of_2(head_dim))
        return DecodeConfig(items_per_sm=items_per_sm, block_n=block_n, num_stages=3)


@dataclass
class DecodeSplit:
    """One step's items, on the host."""

    chunk_tokens: int
    item_seq: np.ndarray  # int32 [num_items]: the sequence of each item
    item_chunk: np.ndarray  # int32 [num_items]: its chunk index within the sequence
    item_indptr: np.ndarray  # int32 [B + 1]: sequence i's items are [indptr[i], indptr[i+1])


def window_starts(seq_lens: np.ndarray, window: int | None) -> np.ndarray:
    """The first position each sequence's newest query sees: seq_len - window, or 0."""
    if window is None:
        return np.zeros_like(seq_lens)
    return np.maximum(seq_lens - window, 0).astype(seq_lens.dtype)


def decode_split(seq_lens: np.ndarray, target_items: int, granule: int) -> DecodeSplit:
    """Chunks of a multiple of granule tokens (at least MIN_CHUNK_TOKENS), long enough that
    the step has at most target_items + B items: sum(ceil(len / chunk)) <= sum(len) /
    chunk + B."""
    chunk = max(-(-int(seq_lens.sum()) // target_items), MIN_CHUNK_TOKENS)
    chunk = -(-chunk // granule) * granule
    counts = (np.maximum(seq_lens, 1) + chunk - 1) // chunk
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    item_seq = np.repeat(np.arange(len(seq_lens), dtype=np.int32), counts)
    item_chunk = np.arange(int(indptr[-1]), dtype=np.int32) - np.repeat(indptr[:-1], counts)
    return DecodeSplit(chunk, item_seq, item_chunk, indptr)


@triton.jit(do_not_specialize=["scale", "v_scale"])
def _decode_chunk_kernel(
    q_ptr,
    q_stride_tok,
    q_stride_head,
    kv_ptr,
    kv_stride_block,
    kv_stride_kv,
    kv_stride_tok,
    kv_stride_head,
    kv_first_page_ptr,
    kv_indices_ptr,
    seq_lens_ptr,
    kv_starts_ptr,  # int32 [B]: each sequence's first position read (its window's start)
    item_seq_ptr,
    item_chunk_ptr,
    split_ptr,  # int32 [2]: number of items, chunk length in tokens
    out_ptr,  # [B, num_q_heads, HEAD_DIM], contiguous
    part_out_ptr,  # float32 [capacity, num_q_heads, HEAD_DIM]
    part_lse_ptr,  # float32 [capacity, num_q_heads], log2 units
    scale,  # the softmax scale times the K scale
    v_scale,
    GROUP: tl.constexpr,
    GROUP_ROWS: tl.constexpr,  # GROUP padded to a tensor-core tile
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # the next power of two
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # tokens per step of the loop, over one or more pages
    PDL: tl.constexpr,
):
    # The plan was copied in before the step, so its chain of dependent loads runs while
    # the kernel before this one (which writes q and the new K/V) still finishes.
    # Heads are the grid's fastest axis: an item's programs start together and read the
    # same pages' token rows (a token's KV heads lie side by side), 1-4% faster than items
    # first at the workload's steps (benchmarks/RESULTS.md, "Decode attention on GPU").
    kv_head = tl.program_id(0)
    item = tl.program_id(1)
    if item >= tl.load(split_ptr):
        return
    chunk_tokens = tl.load(split_ptr + 1)
    seq = tl.load(item_seq_ptr + item)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start = tl.load(kv_starts_ptr + seq)
    start = kv_start + tl.load(item_chunk_ptr + item) * chunk_tokens
    end = tl.minimum(start + chunk_tokens, seq_len)
    first_block = tl.load(kv_first_page_ptr + seq)
    _pdl_start(PDL)  # wait for q and the K/V just written; let the merge start launching

    rows = tl.arange(0, GROUP_ROWS)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    row_ok = rows < GROUP
    q = tl.load(
        q_ptr + seq * q_stride_tok + heads[:, None] * q_stride_head + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )

    offs = tl.arange(0, BLOCK_N)
    m = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM_PAD], tl.float32)
    for first in range(start, end, BLOCK_N):
        toks = first + offs
        tok_ok = toks < end
        blocks = tl.load(kv_indices_ptr + first_block + toks // PAGE, mask=tok_ok, other=0)
        k_at = (
            kv_ptr
            + blocks.to(tl.int64)[:, None] * kv_stride_block
            + (toks % PAGE)[:, None] * kv_stride_tok
            + kv_head * kv_stride_head
            + dims[None, :]
        )
        kv_ok = tok_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_at, mask=kv_ok, other=0.0).to(q.dtype)
        v = tl.load(k_at + kv_stride_kv, mask=kv_ok, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * (scale * 1.4426950408889634)  # log2 units
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    acc = acc / denom[:, None] * v_scale
    at = heads[:, None] * HEAD_DIM + dims[None, :]
    ok = row_ok[:, None] & dim_ok[None, :]
    num_heads = tl.num_programs(0) * GROUP
    if (start == kv_start) & (end == seq_len):  # all it reads: the output itself
        whole = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + seq * num_heads * HEAD_DIM + at, whole, mask=ok)
    else:
        tl.store(part_out_ptr + item * num_heads * HEAD_DIM + at, acc, mask=ok)
        tl.store(part_lse_ptr + item * num_heads + heads, m + tl.log2(denom), mask=row_ok)


@triton.jit
def _merge_chunks_kernel(
    item_indptr_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_heads,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    # The plan is the host's, read while the chunk kernel still runs. Every program waits
    # for that kernel, even one with nothing to merge: a kernel after this one may rely on
    # this one's end to mean the chunk kernel's too.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(item_indptr_ptr + seq)
    last = tl.load(item_indptr_ptr + seq + 1)
    if PDL:
        gdc_wait()
    if last - first == 1:  # written whole by the chunk kernel
        return
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    m = tl.full([], float("-inf"), tl.float32)
    weight = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for item in range(first, last):
        lse = tl.load(part_lse_ptr + item * num_heads + head)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(lse - m_new)
        part = tl.load(
            part_out_ptr + (item * num_heads + head) * HEAD_DIM + dims, mask=dim_ok, other=0.0
        )
        acc = acc * alpha + part * beta
        weight = weight * alpha + beta
        m = m_new
    merged = (acc / weight).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + dims, merged, mask=dim_ok)


class DecodeWorkspace:
    """One decode batch size's device buffers, at fixed addresses for its CUDA graph.

    `plan` (int32) holds a step's whole plan, which host_plan() lays out for one
    copy: where each sequence's first page id is in kv_indices [B + 1] (a CSR indptr, or
    slot * block_width for rows of a block table), the sequence lengths [B], the position
    each starts reading at [B] (0, or where its window starts), each sequence's items
    [B + 1], the item count and chunk length [2], then each item's sequence and chunk index
    [capacity each]. The float buffers take the partial results of split sequences."""

    def __init__(
        self,
        batch_size: int,
        num_q_heads: int,
        head_dim: int,
        num_sms: int,
        device,
        config: DecodeConfig | None = None,  # DecodeConfig.for_batch's unless given
        window: int | None = None,  # the layers' sliding window; None: every key
    ) -> None:
        self.batch_size = batch_size
        self.window = window
        self.config = config or DecodeConfig.for_batch(batch_size, head_dim)
        self.target_items = self.config.items_per_sm * num_sms
        self.capacity = capacity = batch_size + self.target_items
        self._at = np.cumsum([0, *self._plan_sizes(batch_size, capacity)])
        self.plan = torch.zeros(int(self._at[-1]), dtype=torch.int32, device=device)
        (
            self.kv_first_page,
            self.seq_lens,
            self.kv_starts,
            self.item_indptr,
            self.split,
            self.item_seq,
            self.item_chunk,
        ) = (self.plan[start:end] for start, end in zip(self._at[:-1], self._at[1:]))
        self.part_out = torch.empty(capacity, num_q_heads, head_dim, device=device)
        self.part_lse = torch.empty(capacity, num_q_heads, device=device)

    @staticmethod
    def _plan_sizes(batch_size: int, capacity: int) -> list[int]:
        """The lengths of `plan`'s parts, in the docstring's order."""
        b = batch_size
        return [b + 1, b, b, b + 1, 2, capacity, capacity]

    @classmethod
    def nbytes(cls, batch_size: int, num_q_heads: int, head_dim: int, num_sms: int) -> int:
        """Device memory a workspace of DecodeConfig.for_batch's configuration takes."""
        capacity = batch_size + DecodeConfig.for_batch(batch_size, head_dim).items_per_sm * num_sms
        plan = sum(cls._plan_sizes(batch_size, capacity))
        return 4 * (plan + capacity * num_q_heads * (head_dim + 1))  # + part_out, part_lse

    def host_plan(self, seq_lens: np.ndarray, first_pages: np.ndarray) -> np.ndarray:
        """The step's `plan`, for sequences of seq_lens tokens whose page ids start at
        kv_indices[first_pages[i]] (the last entry is unread)."""
        assert len(seq_lens) == self.batch_size, (len(seq_lens), self.batch_size)
        starts = window_starts(seq_lens, self.window)
        split = decode_split(seq_lens - starts, self.target_items, self.config.block_n)
        num_items = len(split.item_seq)
        assert num_items <= self.capacity, (num_items, self.capacity)
        plan = np.zeros(int(self._at[-1]), dtype=np.int32)
        at = self._at
        plan[at[0] : at[1]] = first_pages
        plan[at[1] : at[2]] = seq_lens
        plan[at[2] : at[3]] = starts
        plan[at[3] : at[4]] = split.item_indptr
        plan[at[4] : at[5]] = (num_items, split.chunk_tokens)
        plan[at[5] : at[5] + num_items] = split.item_seq
        plan[at[6] : at[6] + num_items] = split.item_chunk
        return plan


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_q_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    kv_indices: torch.Tensor,  # int32: block ids, sequence after sequence
    work: DecodeWorkspace,  # its plan loaded for these B sequences
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,  # an fp8 pool's scales (engine/kv/fp8.py)
    v_scale: float = 1.0,
) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    _, _, page, num_kv_heads, _ = kv_cache.shape
    assert batch == work.batch_size, (batch, work.batch_size)
    assert q.stride(2) == 1 and kv_cache.stride(4) == 1
    if out is None:
        out = torch.empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    assert out.is_contiguous() and out.shape == q.shape
    group = num_q_heads // num_kv_heads
    head_dim_pad = triton.next_power_of_2(head_dim)
    pdl = _pdl_options(q.device)
    _decode_chunk_kernel[(num_kv_heads, work.capacity)](
        q,
        q.stride(0),
        q.stride(1),
        kv_cache,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        work.kv_first_page,
        kv_indices,
        work.seq_lens,
        work.kv_starts,
        work.item_seq,
        work.item_chunk,
        work.split,
        out,
        work.part_out,
        work.part_lse,
        scale * k_scale,
        v_scale,
        GROUP=group,
        GROUP_ROWS=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE=page,
        BLOCK_N=work.config.block_n,
        num_warps=4,
        num_stages=work.config.num_stages,
        **pdl,
    )
    _merge_chunks_kernel[(batch, num_q_heads)](
        work.item_indptr,
        out,
        work.part_out,
        work.part_lse,
        num_q_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        num_warps=1,
        **pdl,
    )
    return out
