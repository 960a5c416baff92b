"""Paged decode attention in Triton: every sequence's KV cut into chunks of one length.

One new token per sequence attends to all of that sequence's KV in the paged pool
([num_blocks, 2, block_size, num_kv_heads, head_dim], the engine's layout). The work is
split into items, each one chunk of `chunk_tokens` tokens (whole pages) of one sequence,
and the kernel runs one program per (item, KV head): it reads the chunk's pages once for
all the query heads of its group, with an online softmax. A sequence of one chunk writes
its output directly; the chunks of a longer one leave partial outputs and log-sum-exps
that a second kernel merges.

Why a chunk length picked per step: flashinfer's kernels give every (sequence, KV head)
one thread block at the batch sizes of a busy server, so their longest sequences run on
alone at the end of each layer's attention; equal-length chunks, several per streaming
multiprocessor, keep all of them streaming KV until the end (decode_split says how many).

The item arrays live on the device and every launch covers `capacity` items, so a step is
planned on the host (decode_split) and a CUDA graph replays the kernels unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from engine.kernels.triton_kernels import _pdl_options, _pdl_start


@dataclass
class DecodeSplit:
    """One step's items, on the host."""

    chunk_tokens: int
    item_seq: np.ndarray  # int32 [num_items]: the sequence of each item
    item_chunk: np.ndarray  # int32 [num_items]: its chunk index within the sequence
    item_indptr: np.ndarray  # int32 [B + 1]: sequence i's items are [indptr[i], indptr[i+1])


def decode_split(
    seq_lens: np.ndarray, target_items: int, page_size: int, min_chunk: int = 128
) -> DecodeSplit:
    """Chunks of whole pages, long enough that the step has at most target_items + B items
    (sum(ceil(len / chunk)) <= sum(len) / chunk + B), at least min_chunk tokens."""
    chunk = max(-(-int(seq_lens.sum()) // target_items), min_chunk)
    chunk = -(-chunk // page_size) * page_size
    counts = (np.maximum(seq_lens, 1) + chunk - 1) // chunk
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    item_seq = np.repeat(np.arange(len(seq_lens), dtype=np.int32), counts)
    item_chunk = np.arange(int(indptr[-1]), dtype=np.int32) - np.repeat(indptr[:-1], counts)
    return DecodeSplit(chunk, item_seq, item_chunk, indptr)


@triton.jit(do_not_specialize=["scale"])
def _decode_chunk_kernel(
    q_ptr,
    q_stride_tok,
    q_stride_head,
    kv_ptr,
    kv_stride_block,
    kv_stride_kv,
    kv_stride_tok,
    kv_stride_head,
    kv_indptr_ptr,
    kv_indices_ptr,
    seq_lens_ptr,
    item_seq_ptr,
    item_chunk_ptr,
    split_ptr,  # int32 [2]: number of items, chunk length in tokens
    out_ptr,  # [B, num_q_heads, HEAD_DIM], contiguous
    part_out_ptr,  # float32 [capacity, num_q_heads, HEAD_DIM]
    part_lse_ptr,  # float32 [capacity, num_q_heads], log2 units
    scale,
    GROUP: tl.constexpr,
    GROUP_ROWS: tl.constexpr,  # GROUP padded to a tensor-core tile
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # tokens per step of the loop, over one or more pages
    PDL: tl.constexpr,
):
    if PDL:  # wait for the K/V just written; let the merge launch only after this kernel
        gdc_wait()
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    if item >= tl.load(split_ptr):
        return
    chunk_tokens = tl.load(split_ptr + 1)
    seq = tl.load(item_seq_ptr + item)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = tl.load(item_chunk_ptr + item) * chunk_tokens
    end = tl.minimum(start + chunk_tokens, seq_len)
    first_block = tl.load(kv_indptr_ptr + seq)

    rows = tl.arange(0, GROUP_ROWS)
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    row_ok = rows < GROUP
    q = tl.load(
        q_ptr + seq * q_stride_tok + heads[:, None] * q_stride_head + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )

    offs = tl.arange(0, BLOCK_N)
    m = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
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
        k = tl.load(k_at, mask=tok_ok[:, None], other=0.0)
        v = tl.load(k_at + kv_stride_kv, mask=tok_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * (scale * 1.4426950408889634)  # log2 units
        s = tl.where(tok_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    acc = acc / denom[:, None]
    at = heads[:, None] * HEAD_DIM + dims[None, :]
    num_heads = tl.num_programs(1) * GROUP
    if (start == 0) & (end == seq_len):  # the whole sequence: the output itself
        whole = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + seq * num_heads * HEAD_DIM + at, whole, mask=row_ok[:, None])
    else:
        tl.store(part_out_ptr + item * num_heads * HEAD_DIM + at, acc, mask=row_ok[:, None])
        tl.store(part_lse_ptr + item * num_heads + heads, m + tl.log2(denom), mask=row_ok)


@triton.jit
def _merge_chunks_kernel(
    item_indptr_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_heads,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl_start(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(item_indptr_ptr + seq)
    last = tl.load(item_indptr_ptr + seq + 1)
    if last - first == 1:  # written whole by the chunk kernel
        return
    dims = tl.arange(0, HEAD_DIM)
    m = tl.full([], float("-inf"), tl.float32)
    weight = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for item in range(first, last):
        lse = tl.load(part_lse_ptr + item * num_heads + head)
        m_new = tl.maximum(m, lse)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(lse - m_new)
        part = tl.load(part_out_ptr + (item * num_heads + head) * HEAD_DIM + dims)
        acc = acc * alpha + part * beta
        weight = weight * alpha + beta
        m = m_new
    merged = (acc / weight).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + dims, merged)


@dataclass
class DecodeWorkspace:
    """The device buffers one decode batch size's kernels read: fixed addresses, so a CUDA
    graph can replay them with each step's split copied in."""

    capacity: int  # items per launch, each of num_kv_heads programs
    item_seq: torch.Tensor  # int32 [capacity]
    item_chunk: torch.Tensor  # int32 [capacity]
    item_indptr: torch.Tensor  # int32 [B + 1]
    split: torch.Tensor  # int32 [2]: number of items, chunk tokens
    part_out: torch.Tensor  # float32 [capacity, num_q_heads, head_dim]
    part_lse: torch.Tensor  # float32 [capacity, num_q_heads]

    @classmethod
    def allocate(
        cls, batch_size: int, capacity: int, num_q_heads: int, head_dim: int, device
    ) -> DecodeWorkspace:
        ints = functools.partial(torch.zeros, dtype=torch.int32, device=device)
        floats = functools.partial(torch.empty, dtype=torch.float32, device=device)
        return cls(
            capacity,
            ints(capacity),
            ints(capacity),
            ints(batch_size + 1),
            ints(2),
            floats(capacity, num_q_heads, head_dim),
            floats(capacity, num_q_heads),
        )

    def load(self, split: DecodeSplit) -> None:
        """Copy a step's split in (synchronously; the engine stages it in its upload)."""
        n = len(split.item_seq)
        assert n <= self.capacity, (n, self.capacity)
        self.item_seq[:n].copy_(torch.from_numpy(split.item_seq))
        self.item_chunk[:n].copy_(torch.from_numpy(split.item_chunk))
        self.item_indptr.copy_(torch.from_numpy(split.item_indptr))
        self.split.copy_(torch.tensor([n, split.chunk_tokens], dtype=torch.int32))


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_q_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    kv_indptr: torch.Tensor,  # int32 [B + 1]
    kv_indices: torch.Tensor,  # int32: block ids, sequence after sequence
    seq_lens: torch.Tensor,  # int32 [B]
    work: DecodeWorkspace,
    scale: float,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    batch, num_q_heads, head_dim = q.shape
    _, _, page, num_kv_heads, _ = kv_cache.shape
    group = num_q_heads // num_kv_heads
    assert q.stride(2) == 1 and kv_cache.stride(4) == 1
    if out is None:
        out = torch.empty(batch, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    assert out.is_contiguous() and out.shape == q.shape
    pdl = _pdl_options(q.device)
    _decode_chunk_kernel[(work.capacity, num_kv_heads)](
        q,
        q.stride(0),
        q.stride(1),
        kv_cache,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        kv_indptr,
        kv_indices,
        seq_lens,
        work.item_seq,
        work.item_chunk,
        work.split,
        out,
        work.part_out,
        work.part_lse,
        scale,
        GROUP=group,
        GROUP_ROWS=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        PAGE=page,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl,
    )
    _merge_chunks_kernel[(batch, num_q_heads)](
        work.item_indptr,
        out,
        work.part_out,
        work.part_lse,
        num_q_heads,
        HEAD_DIM=head_dim,
        num_warps=1,
        **pdl,
    )
    return out
