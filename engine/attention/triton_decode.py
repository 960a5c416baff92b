"""The CUDA-graph decode backend: decode steps through the engine's Triton kernel.

engine/kernels/decode_attention.py splits every sequence's KV into chunks of one length,
where flashinfer's graph-mode decode cannot (benchmarks/RESULTS.md's git history). Each
captured batch size has a DecodeWorkspace at fixed addresses; plan() copies the step's
lengths and split into it before a replay. The kernel reads each sequence's block ids
straight from its row of the persistent block table (kv_indices is the whole table, flat;
a sequence's first page is at slot * block_width), so no page list is built or copied.
A model with sliding-window layers has one workspace per window value and batch size
(the kernel's module docstring says how a window is read); plan() fills each, and a
layer's forward() launches on its window's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from engine.attention.base import AttentionMetadata


class TritonGraphDecode:
    supports_cuda_graphs = True
    supports_sliding_window = True

    def __init__(self, device: torch.device):
        self.device = device
        self._work: dict = {}  # batch size -> {window: its DecodeWorkspace}
        self._step: dict = {}  # the workspaces planned for this step, by window
        self._kv_indices: torch.Tensor | None = None

    def configure(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float | None = None,
        windows: Sequence[int | None] = (None,),
        kv_dtype: torch.dtype | None = None,  # the kernel reads any pool's as it finds it
    ) -> None:
        self.num_q_heads, self.head_dim = num_q_heads, head_dim
        self.windows = tuple(dict.fromkeys(windows))

    def graph_workspace_bytes(self, batch_sizes: Sequence[int]) -> int:
        from engine.kernels.decode_attention import DecodeWorkspace

        sms = _num_sms(self.device)
        per_window = sum(
            DecodeWorkspace.nbytes(b, self.num_q_heads, self.head_dim, sms) for b in batch_sizes
        )
        return len(self.windows) * per_window

    def prepare_graph(self, batch_size: int) -> None:
        from engine.kernels.decode_attention import DecodeWorkspace

        sms = _num_sms(self.device)
        self._work[batch_size] = {
            window: DecodeWorkspace(
                batch_size, self.num_q_heads, self.head_dim, sms, self.device, window=window
            )
            for window in self.windows
        }

    def plan(self, meta: AttentionMetadata) -> None:
        """A decode step of a prepared batch size, padding rows included (a row per
        position: one sequence may have several)."""
        self._step = self._work[meta.num_seqs]
        width = meta.block_table.shape[1]
        first_pages = np.append(meta.slots.astype(np.int32) * width, 0).astype(np.int32)
        for work in self._step.values():
            plan = work.host_plan(meta.seq_lens, first_pages)
            # torch's pinned allocator keeps the buffer until its copy has run: no wait needed.
            work.plan.copy_(torch.from_numpy(plan).pin_memory(), non_blocking=True)
        self._kv_indices = meta.block_table.view(-1)

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        from engine.kernels.decode_attention import paged_decode_attention

        work = self._step[window]  # a workspace for each window configure() was given
        return paged_decode_attention(
            q, kv_cache, self._kv_indices, work, scale, k_scale=k_scale, v_scale=v_scale
        )


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
