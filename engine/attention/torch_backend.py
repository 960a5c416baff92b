"""Paged attention in plain torch: the CPU backend and the reference for the others.

Layout and causal rule: engine/attention/base.py; the new rows' K/V are already in the
pool (engine/kernels/kv_cache.py's store_kv_torch wrote them). One step may mix sequences
that decode (one new token) with sequences that prefill a prompt or a chunk of it:

- decodes are batched: their K and V are gathered with one indexed read each into padded
  [B, max_len, H, D] tensors and attended in one SDPA call under a key-padding mask;
- prefills run one at a time, each with a causal mask offset by its cached prefix.

GQA without repeating K/V: the G = Hq / Hkv query heads that share a KV head are folded
into the query-length axis, so SDPA sees Hkv heads of G * q_len query rows each.
Math runs in float32 whatever the cache dtype.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata, EagerOnly

DECODE_GROUP_SIZE = 4


@dataclass
class DecodeGroup:
    """Decoding sequences attended together, padded to the longest of them."""

    rows: torch.Tensor  # int64 [G]: their query rows in the flat batch
    block_table: torch.Tensor  # int64 [G * num_blocks]: their blocks, row after row
    num_blocks: int  # per sequence, enough for max_len
    max_len: int
    key_valid: torch.Tensor  # bool [G, 1, 1, max_len]: False past a sequence's own length


@dataclass
class StepPlan:
    """What every layer of one step shares: computed on the first layer, reused by the rest."""

    decode_groups: list[DecodeGroup]
    prefills: list[tuple[int, int, int]]  # (sequence, first row, end row)


class TorchPagedAttention(EagerOnly):
    def __init__(self) -> None:
        self._plan: StepPlan | None = None
        self._planned_for: AttentionMetadata | None = None

    def configure(
        self, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        pass  # it reads the head shape off its inputs

    def plan(self, meta: AttentionMetadata) -> None:
        self._plan, self._planned_for = plan_step(meta), meta

    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if self._planned_for is not meta:  # a caller that drives the model without plan()
            self.plan(meta)
        plan = self._plan
        out = torch.zeros_like(q)  # rows past the last sequence (padding) stay zero
        for group in plan.decode_groups:
            out[group.rows] = self._decode(q[group.rows], kv_cache, group, scale)
        for seq, start, end in plan.prefills:
            out[start:end] = self._prefill(q[start:end], kv_cache, meta, seq, scale)
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [G, Hq, D], one row per decoding sequence
        kv_cache: torch.Tensor,
        group: DecodeGroup,
        scale: float,
    ) -> torch.Tensor:
        keys, values = gather_blocks(kv_cache, group.block_table, group.rows.numel(), group.max_len)
        batch, num_q_heads, head_dim = q.shape
        num_kv_heads = keys.shape[2]
        heads_per_kv = num_q_heads // num_kv_heads
        # Past its own length a row holds stale KV of other sequences; the mask hides it.
        # That is safe because the pool only ever holds finite values (store_kv_torch).
        out = F.scaled_dot_product_attention(
            q.float().reshape(batch, num_kv_heads, heads_per_kv, head_dim),
            keys.float().transpose(1, 2),  # [G, Hkv, L, D]
            values.float().transpose(1, 2),
            attn_mask=group.key_valid,
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
        seq_len = int(meta.seq_lens[seq])
        num_blocks = -(-seq_len // meta.block_size)
        table = meta.block_table[int(meta.slots[seq]), :num_blocks].long()
        keys, values = gather_blocks(kv_cache, table, 1, seq_len)
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


def plan_step(meta: AttentionMetadata) -> StepPlan:
    device = meta.slot_mapping.device
    query_lens, seq_lens = meta.query_lens.tolist(), meta.seq_lens.tolist()
    slots = torch.as_tensor(meta.slots, dtype=torch.int64, device=device)
    starts = list(itertools.accumulate(query_lens, initial=0))

    # Decodes attend in groups of similar length, each padded only to its own longest
    # sequence: a step that mixes short and long contexts then copies and attends far
    # less padding, for a few more (cheap) calls.
    decodes = [i for i, q_len in enumerate(query_lens) if q_len == 1]
    decodes.sort(key=lambda i: seq_lens[i])
    groups = []
    for first in range(0, len(decodes), DECODE_GROUP_SIZE):
        seqs = decodes[first : first + DECODE_GROUP_SIZE]
        lens = [seq_lens[i] for i in seqs]
        max_len = max(lens)
        num_blocks = -(-max_len // meta.block_size)
        positions = torch.arange(max_len, device=device)
        key_valid = positions[None, :] < torch.tensor(lens, device=device)[:, None]
        groups.append(
            DecodeGroup(
                rows=torch.tensor([starts[i] for i in seqs], device=device),
                block_table=meta.block_table[slots[seqs], :num_blocks].reshape(-1).long(),
                num_blocks=num_blocks,
                max_len=max_len,
                key_valid=key_valid[:, None, None, :],
            )
        )
    prefills = [(i, starts[i], starts[i + 1]) for i, q_len in enumerate(query_lens) if q_len > 1]
    return StepPlan(decode_groups=groups, prefills=prefills)


def gather_blocks(
    kv_cache: torch.Tensor, block_table: torch.Tensor, batch: int, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh copies of the keys and values of `batch` sequences whose blocks are listed row
    after row in the flat `block_table`, each [batch, length, Hkv, D]. Past a sequence's own
    length they hold whatever its blocks held."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    # index_select copies whole blocks; on the CPU it is ~4x faster than advanced indexing.
    keys = torch.index_select(kv_cache[:, 0], 0, block_table)  # [batch * blocks, bs, Hkv, D]
    values = torch.index_select(kv_cache[:, 1], 0, block_table)
    shape = (batch, -1, num_kv_heads, head_dim)
    return keys.view(shape)[:, :length], values.view(shape)[:, :length]
