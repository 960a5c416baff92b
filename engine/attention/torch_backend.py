"""Paged attention in plain torch: the CPU backend and the reference for the others.

Layout and causal rule: engine/attention/base.py; the new rows' K/V are already in the
pool (engine/kernels/kv_cache.py's store_kv_torch wrote them). One step may mix sequences
that decode (one new token) with sequences that prefill a prompt or a chunk of it:

- decodes are batched: their K and V are gathered with one indexed read each into padded
  [B, max_len, H, D] tensors and attended in one SDPA call under a key-padding mask;
- prefills run one at a time: a whole prompt under SDPA's own causal rule, a chunk after
  a cached prefix under a causal mask offset by that prefix.

GQA without repeating K/V: SDPA's enable_gqa for a whole prompt; elsewhere the G = Hq / Hkv
query heads that share a KV head are folded into the query-length axis, so SDPA sees Hkv
heads of G * q_len query rows each. Every call passes 4-D inputs: on the CPU only those
take the flash kernel, 3-D ones the much slower math path. Math runs in float32 whatever
the cache dtype: an fp8 pool's K and V are read as float32 times the layer's scales
(engine/kv/fp8.py's dequantize), the semantics the CUDA kernels implement and are tested
against.

A sliding-window layer narrows the same masks to its window (AttentionPlan.for_window);
it still reads each sequence's whole KV, which is exact (keeping every block is too).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata, EagerOnly
from engine.kv.fp8 import dequantize

DECODE_GROUP_SIZE = 4


@dataclass
class DecodeGroup:
    """Decoding sequences attended together, padded to the longest of them."""

    rows: torch.Tensor  # int64 [G]: their query rows in the flat batch
    block_table: torch.Tensor  # int64 [G * num_blocks]: their blocks, row after row
    max_len: int
    key_valid: torch.Tensor  # bool [G, 1, 1, max_len]: False past a sequence's own length

    def windowed(self, window: int) -> DecodeGroup:
        """The same group where each query sees only its last `window` keys."""
        if self.max_len <= window:
            return self
        lens = self.key_valid.sum(dim=-1, keepdim=True)  # [G, 1, 1, 1]
        positions = torch.arange(self.max_len, device=lens.device)
        return dataclasses.replace(self, key_valid=self.key_valid & (positions >= lens - window))


@dataclass
class Prefill:
    """One sequence's prompt, or a chunk of it, attended on its own."""

    start: int  # its rows in the flat batch
    end: int
    block_table: torch.Tensor  # int64 [num_blocks]: its blocks
    seq_len: int
    causal: torch.Tensor | None  # bool [q_len, seq_len] after a cached prefix; else None

    def windowed(self, window: int) -> Prefill:
        """The same rows where each query sees only keys (position - window, position]."""
        if self.seq_len <= window:  # every key is inside every query's window
            return self
        device, first = self.block_table.device, self.seq_len - (self.end - self.start)
        query_pos = torch.arange(first, self.seq_len, device=device)
        distance = query_pos[:, None] - torch.arange(self.seq_len, device=device)[None, :]
        return dataclasses.replace(self, causal=(distance >= 0) & (distance < window))


@dataclass
class AttentionPlan:
    """A step's attention work, which every layer shares: decodes in groups, prefills one
    by one; computed on the first layer, reused by the rest."""

    decode_groups: list[DecodeGroup]
    prefills: list[Prefill]
    _windowed: dict[int, AttentionPlan] = field(default_factory=dict)

    def for_window(self, window: int | None) -> AttentionPlan:
        """This step under a sliding window (None: as planned); its masks built once."""
        if window is None:
            return self
        if window not in self._windowed:
            self._windowed[window] = AttentionPlan(
                [group.windowed(window) for group in self.decode_groups],
                [prefill.windowed(window) for prefill in self.prefills],
            )
        return self._windowed[window]


class TorchPagedAttention(EagerOnly):
    supports_sliding_window = True

    def __init__(self) -> None:
        self._plan: AttentionPlan | None = None
        self._planned_for: AttentionMetadata | None = None

    def configure(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float | None = None,
        windows: Sequence[int | None] = (None,),
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        pass  # it reads the head shape, scales, window and pool off each forward's inputs

    def plan(self, meta: AttentionMetadata) -> None:
        self._plan, self._planned_for = plan_attention(meta), meta

    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        if self._planned_for is not meta:  # a caller that drives the model without plan()
            self.plan(meta)
        plan = self._plan.for_window(window)
        out = torch.zeros_like(q)  # rows past the last sequence (padding) stay zero
        for group in plan.decode_groups:
            keys, values = gather_blocks(
                kv_cache, group.block_table, group.rows.numel(), group.max_len, k_scale, v_scale
            )
            out[group.rows] = self._decode(q[group.rows], keys, values, group, scale)
        for prefill in plan.prefills:
            keys, values = gather_blocks(
                kv_cache, prefill.block_table, 1, prefill.seq_len, k_scale, v_scale
            )
            out[prefill.start : prefill.end] = self._prefill(
                q[prefill.start : prefill.end], keys, values, prefill, scale
            )
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [G, Hq, D], one row per decoding sequence
        keys: torch.Tensor,  # float32 [G, max_len, Hkv, D]
        values: torch.Tensor,
        group: DecodeGroup,
        scale: float,
    ) -> torch.Tensor:
        batch, num_q_heads, head_dim = q.shape
        num_kv_heads = keys.shape[2]
        heads_per_kv = num_q_heads // num_kv_heads
        # Past its own length a row holds stale KV of other sequences; the mask hides it.
        # That is safe because the pool only ever holds finite values (store_kv_torch).
        out = F.scaled_dot_product_attention(
            q.float().reshape(batch, num_kv_heads, heads_per_kv, head_dim),
            keys.transpose(1, 2),  # [G, Hkv, L, D]
            values.transpose(1, 2),
            attn_mask=group.key_valid,
            scale=scale,
        )
        return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)

    def _prefill(
        self,
        q: torch.Tensor,  # [q_len, Hq, D], this sequence's new rows
        keys: torch.Tensor,  # float32 [1, seq_len, Hkv, D]
        values: torch.Tensor,
        prefill: Prefill,
        scale: float,
    ) -> torch.Tensor:
        q_len, num_q_heads, head_dim = q.shape
        keys = keys.transpose(1, 2)  # [1, Hkv, L, D]
        values = values.transpose(1, 2)
        num_kv_heads = keys.shape[1]

        if prefill.causal is None:  # the whole prompt: SDPA's causal rule is ours
            out = F.scaled_dot_product_attention(
                q.float().transpose(0, 1)[None],  # [1, Hq, q_len, D]
                keys,
                values,
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )
            return out[0].transpose(0, 1).to(q.dtype)

        # After a cached prefix the causal rule is offset, so it takes a mask; with a mask
        # folding the group into the rows is faster than enable_gqa.
        group = num_q_heads // num_kv_heads
        grouped_q = (
            q.float()
            .reshape(q_len, num_kv_heads, group, head_dim)
            .transpose(0, 1)
            .reshape(1, num_kv_heads, q_len * group, head_dim)
        )
        out = F.scaled_dot_product_attention(
            grouped_q,
            keys,
            values,
            # one mask row per (position, head in group)
            attn_mask=prefill.causal.repeat_interleave(group, dim=0),
            scale=scale,
        )
        out = out.view(num_kv_heads, q_len, group, head_dim).transpose(0, 1)
        return out.reshape(q_len, num_q_heads, head_dim).to(q.dtype)


def plan_attention(meta: AttentionMetadata) -> AttentionPlan:
    device = meta.slot_mapping.device
    query_lens, seq_lens = meta.query_lens.tolist(), meta.seq_lens.tolist()
    slots = torch.as_tensor(meta.slots, dtype=torch.int64, device=device)
    starts = list(itertools.accumulate(query_lens, initial=0))

    def block_table(seqs: list[int], length: int) -> torch.Tensor:
        num_blocks = -(-length // meta.block_size)
        return meta.block_table[slots[seqs], :num_blocks].reshape(-1).long()

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
        positions = torch.arange(max_len, device=device)
        key_valid = positions[None, :] < torch.tensor(lens, device=device)[:, None]
        groups.append(
            DecodeGroup(
                rows=torch.tensor([starts[i] for i in seqs], device=device),
                block_table=block_table(seqs, max_len),
                max_len=max_len,
                key_valid=key_valid[:, None, None, :],
            )
        )

    prefills = []
    for i, q_len in enumerate(query_lens):
        if q_len == 1:
            continue
        seq_len = seq_lens[i]
        causal = None
        if q_len < seq_len:
            # Query row j sits at position seq_len - q_len + j and sees keys up to it.
            query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            causal = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
        prefills.append(
            Prefill(starts[i], starts[i + 1], block_table([i], seq_len), seq_len, causal)
        )
    return AttentionPlan(decode_groups=groups, prefills=prefills)


def gather_blocks(
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    batch: int,
    length: int,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of `batch` sequences whose blocks are listed row after row in the
    flat `block_table`, each float32 [batch, length, Hkv, D] (an fp8 pool's times its
    scales). Past a sequence's own length they hold whatever its blocks held."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    # index_select copies whole blocks; on the CPU it is ~4x faster than advanced indexing.
    keys = torch.index_select(kv_cache[:, 0], 0, block_table)  # [batch * blocks, bs, Hkv, D]
    values = torch.index_select(kv_cache[:, 1], 0, block_table)
    shape = (batch, -1, num_kv_heads, head_dim)
    keys, values = keys.view(shape)[:, :length], values.view(shape)[:, :length]
    return dequantize(keys, k_scale), dequantize(values, v_scale)
