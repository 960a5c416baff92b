"""The contract between the model and an attention backend.

A step runs one flat "varlen" batch: the new tokens of every scheduled sequence are
concatenated into T rows. Sequence i owns rows query_start_loc[i] : query_start_loc[i+1].
Its KV length after this step is seq_lens[i]; the new tokens sit at the end of that
length, so a query row at offset j of a sequence with q_len new tokens has absolute
position seq_len - q_len + j and may attend to keys [0, that position] (causal). A
sliding-window layer passes its window W: that row sees only keys (position - W, position],
W keys including its own, as transformers' sliding-window mask does.

KV pool, one tensor per layer, flashinfer's NHD paged layout:
    kv_cache[layer]: [num_blocks, 2, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)
Token t of sequence i lives in block block_table[slots[i], t // block_size] at offset
t % block_size: block_table is the persistent batch's (engine/core/batch.py), one row per
slot. slot_mapping[row] = block_id * block_size + offset is where a new row's K/V are
written; a slot of -1 means "write nowhere" (padding rows). The pool holds the model's
dtype, another 16-bit one, or fp8 (e4m3) with one scale for K and one for V per layer,
which the layer hands to forward() (engine/kv/fp8.py says what is stored and how it reads).

The model writes the new rows' K/V into the pool itself, in the same op that rotates q and
k (engine/kernels/rotary.py's rotary_and_store_kv), so a backend reads K and V only from
the pool. A step calls the backend's plan(meta) once, before the model runs, then
forward() once per layer, after that layer's K/V are written: per-step host work (page
tables, splits, masks) belongs in plan, and each backend keeps what it planned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """One step, as every backend gets it; each plans its own tables from it."""

    slots: np.ndarray  # int32 [B]: each sequence's row of block_table
    query_lens: np.ndarray  # int32 [B]
    seq_lens: np.ndarray  # int32 [B]
    query_start_loc: torch.Tensor  # int32 [B + 1] on the compute device
    seq_lens_device: torch.Tensor  # int32 [B] on the compute device
    block_table: torch.Tensor  # int32 [num_slots + 1, max_blocks] on the compute device
    slot_mapping: torch.Tensor  # int64 [T] on the compute device
    block_size: int
    graph: bool = False  # a decode step replayed in a CUDA graph (padded batch)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def from_block_tables(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        slot_mapping: torch.Tensor,
        block_size: int,
    ) -> AttentionMetadata:
        """A step over sequences given by their block lists, slot i holding sequence i."""
        device = slot_mapping.device
        width = max(1, max(map(len, block_tables)))
        table = torch.zeros(len(block_tables), width, dtype=torch.int32)
        for i, blocks in enumerate(block_tables):
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        q_lens = np.asarray(query_lens, dtype=np.int32)
        starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        return cls(
            slots=np.arange(len(seq_lens), dtype=np.int32),
            query_lens=q_lens,
            seq_lens=np.asarray(seq_lens, dtype=np.int32),
            query_start_loc=torch.from_numpy(starts).to(device),
            seq_lens_device=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=table.to(device),
            slot_mapping=slot_mapping,
            block_size=block_size,
        )


class AttentionBackend(Protocol):
    # Whether the backend runs decode steps inside CUDA graphs (prepare_graph first).
    supports_cuda_graphs: bool
    # Whether forward() takes a sliding window; models with sliding layers check at build.
    supports_sliding_window: bool

    def configure(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float | None = None,  # the softmax scale forward() gets; None: head_dim**-0.5
        windows: Sequence[int | None] = (None,),  # every window forward() gets; None: global
        kv_dtype: torch.dtype | None = None,  # the KV pool's dtype; None: dtype
    ) -> None:
        """Once, when the model's head shape and dtype are known (ModelConfig's
        attention_scale and attention_windows) and the pool's: a backend that plans ahead
        plans for exactly these."""
        ...

    def plan(self, meta: AttentionMetadata) -> None:
        """Once per step, before the forward: the host work every layer shares."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_q_heads, head_dim]
        kv_cache: torch.Tensor,  # this layer's [num_blocks, 2, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,  # this layer's sliding window; None = global
        k_scale: float = 1.0,  # an fp8 pool's: K reads as float(stored) * k_scale
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [T, num_q_heads, head_dim]
        """Attend causally over kv_cache, which already holds this step's new rows."""
        ...

    def graph_workspace_bytes(self, batch_sizes: Sequence[int]) -> int:
        """Device memory prepare_graph takes for these batch sizes."""
        ...

    def prepare_graph(self, batch_size: int) -> None:
        """Make graph steps of exactly batch_size sequences plannable, at fixed addresses."""
        ...


class EagerOnly:
    """For backends that run every step eagerly: no CUDA graphs."""

    supports_cuda_graphs = False

    def graph_workspace_bytes(self, batch_sizes: Sequence[int]) -> int:
        return 0

    def prepare_graph(self, batch_size: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not run in CUDA graphs")
