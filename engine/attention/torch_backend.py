"""Paged attention in plain torch: the CPU backend and the reference for the others.

Layout and causal rule: engine/attention/base.py. One step may mix sequences that
decode (one new token) with sequences that prefill a prompt or a chunk of it:

- decodes are batched: their K and V are gathered with one indexed read each into padded
  [B, max_len, H, D] tensors and attended in one SDPA call under a key-padding mask;
- prefills run one at a time, each with a causal mask offset by its cached prefix.

GQA without repeating K/V: the G = Hq / Hkv query heads that share a KV head are folded
into the query-length axis, so SDPA sees Hkv heads of G * q_len query rows each.
Math runs in float32 whatever the cache dtype.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata

DECODE_GROUP_SIZE = 4


class TorchPagedAttention:
    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv_cache(k, v, kv_cache, meta.slot_mapping, meta.block_size)
        out = torch.zeros_like(q)  # rows past the last sequence (padding) stay zero
        starts = list(itertools.accumulate(meta.query_lens_cpu, initial=0))
        # Decodes attend in groups of similar length, each padded only to its own longest
        # sequence: a step that mixes short and long contexts then copies and attends far
        # less padding, for a few more (cheap) calls.
        decodes = [i for i, q_len in enumerate(meta.query_lens_cpu) if q_len == 1]
        decodes.sort(key=lambda i: meta.seq_lens_cpu[i])
        for first in range(0, len(decodes), DECODE_GROUP_SIZE):
            group = decodes[first : first + DECODE_GROUP_SIZE]
            rows = [starts[i] for i in group]
            out[rows] = self._decode(q[rows], kv_cache, meta, group, scale)
        for i, q_len in enumerate(meta.query_lens_cpu):
            if q_len > 1:
                start, end = starts[i], starts[i + 1]
                out[start:end] = self._prefill(q[start:end], kv_cache, meta, i, scale)
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [B, Hq, D], one row per decoding sequence
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        seqs: list[int],
        scale: float,
    ) -> torch.Tensor:
        seq_lens = [meta.seq_lens_cpu[i] for i in seqs]
        max_len = max(seq_lens)
        keys, values = gather_kv(kv_cache, meta.block_tables[seqs], max_len, meta.block_size)
        batch, num_q_heads, head_dim = q.shape
        num_kv_heads = keys.shape[2]
        group = num_q_heads // num_kv_heads

        # Past its own length a row holds stale KV of other sequences; the mask hides it.
        # That is safe because the pool only ever holds finite values (write_kv_cache).
        lens = torch.tensor(seq_lens, device=q.device)
        key_valid = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [B, L]
        out = F.scaled_dot_product_attention(
            q.float().reshape(batch, num_kv_heads, group, head_dim),
            keys.float().transpose(1, 2),  # [B, Hkv, L, D]
            values.float().transpose(1, 2),
            attn_mask=key_valid[:, None, None, :],
            scale=scale,
        )
        return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)

    def _prefill(
        self,
        q: torch.Tensor,  # [q_len, Hq, D], this sequence's new rows
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        seq: int,
        scale: float,
    ) -> torch.Tensor:
        q_len, num_q_heads, head_dim = q.shape
        seq_len = meta.seq_lens_cpu[seq]
        keys, values = gather_kv(
            kv_cache, meta.block_tables[seq : seq + 1], seq_len, meta.block_size
        )
        num_kv_heads = keys.shape[2]
        group = num_q_heads // num_kv_heads

        # Query row j sits at position seq_len - q_len + j and sees keys up to it.
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        causal = key_pos[None, :] <= query_pos[:, None]  # [q_len, L]
        causal = causal.repeat_interleave(group, dim=0)  # one row per (position, head in group)

        grouped_q = (
            q.float()
            .reshape(q_len, num_kv_heads, group, head_dim)
            .transpose(0, 1)
            .reshape(num_kv_heads, q_len * group, head_dim)
        )
        out = F.scaled_dot_product_attention(
            grouped_q,
            keys[0].float().transpose(0, 1),  # [Hkv, L, D]
            values[0].float().transpose(0, 1),
            attn_mask=causal,
            scale=scale,
        )
        out = out.view(num_kv_heads, q_len, group, head_dim).transpose(0, 1)
        return out.reshape(q_len, num_q_heads, head_dim).to(q.dtype)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_size: int,
) -> None:
    """Store each row's k/v at its slot; rows with slot -1 are padding and go nowhere.

    Non-finite values are clamped on the way in, so the pool only ever holds finite
    numbers: masked-out stale slots then contribute exactly 0 to other sequences'
    attention (a stale nan or inf would turn 0 * x into nan).
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache[blocks, 0, offsets] = torch.nan_to_num(k).to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = torch.nan_to_num(v).to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    length: int,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh copies of the keys and values of B sequences, each [B, length, Hkv, D], one
    indexed read each. Past a sequence's own length they hold whatever its blocks held."""
    num_blocks = -(-length // block_size)
    table = block_tables[:, :num_blocks].reshape(-1)
    batch = block_tables.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    # index_select copies whole blocks; on the CPU it is ~4x faster than advanced indexing.
    keys = torch.index_select(kv_cache[:, 0], 0, table)  # [B * num_blocks, block_size, Hkv, D]
    values = torch.index_select(kv_cache[:, 1], 0, table)
    shape = (batch, num_blocks * block_size, num_kv_heads, head_dim)
    return keys.view(shape)[:, :length], values.view(shape)[:, :length]
