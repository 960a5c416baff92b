"""The contract between the model and an attention backend.

A step runs one flat "varlen" batch: the new tokens of every scheduled sequence are
concatenated into T rows. Sequence i owns rows query_start_loc[i] : query_start_loc[i+1].
Its KV length after this step is seq_lens[i]; the new tokens sit at the end of that
length, so a query row at offset j of a sequence with q_len new tokens has absolute
position seq_len - q_len + j and may attend to keys [0, that position] (causal).

KV pool, one tensor per layer, flashinfer's NHD paged layout:
    kv_cache[layer]: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)
Token t of sequence i lives in block block_tables[i][t // block_size] at offset
t % block_size. slot_mapping[row] = block_id * block_size + offset is where a new row's
K/V are written; a slot of -1 means "write nowhere" (padding rows).

The model writes the new rows' K/V into the pool itself, in the same op that rotates q and
k (engine/kernels/rotary.py's rotary_and_store_kv), so a backend reads K and V only from
the pool. A step calls the backend's plan(meta) once, before the model runs, then
forward() once per layer with the same meta, after that layer's K/V are written:
per-step host work (page tables, masks) belongs in plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B + 1] on the compute device
    seq_lens: torch.Tensor  # int32 [B] on the compute device
    # int32 [B, max_blocks_per_seq] on the compute device, padded with 0. The torch backend
    # reads it; on CUDA it is None and flashinfer plans from block_tables_cpu instead.
    block_tables: torch.Tensor | None
    slot_mapping: torch.Tensor  # int64 [T]
    # Host copies, for backends that loop or plan on the CPU.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    # Sequence i's blocks that hold its first seq_lens_cpu[i] tokens, no padding.
    block_tables_cpu: list[list[int]] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return all(q == 1 for q in self.query_lens_cpu)


class AttentionBackend(Protocol):
    def plan(self, meta: AttentionMetadata) -> None:
        """Once per step, before the forward: the host work every layer shares."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        kv_cache: torch.Tensor,  # this layer's [num_blocks, 2, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_q_heads, head_dim]
        """Attend causally over kv_cache, which already holds this step's new rows."""
        ...
