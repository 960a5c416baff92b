"""The CUDA attention backend: flashinfer for eager steps, Triton for CUDA-graph decode.

Each step's metadata says whether it replays a graph (AttentionMetadata.graph); plan()
hands the step to that backend and forward() runs whichever was planned.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.flashinfer_backend import FlashInferAttention
from engine.attention.triton_decode import TritonGraphDecode


class CudaAttention:
    supports_cuda_graphs = True
    supports_sliding_window = True

    def __init__(self, device: torch.device):
        self.eager = FlashInferAttention(device)
        self.graph_decode = TritonGraphDecode(device)
        self._planned: AttentionBackend = self.eager

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
        for backend in (self.eager, self.graph_decode):
            backend.configure(num_q_heads, num_kv_heads, head_dim, dtype, scale, windows, kv_dtype)

    def graph_workspace_bytes(self, batch_sizes: Sequence[int]) -> int:
        return self.graph_decode.graph_workspace_bytes(batch_sizes)

    def prepare_graph(self, batch_size: int) -> None:
        self.graph_decode.prepare_graph(batch_size)

    def plan(self, meta: AttentionMetadata) -> None:
        self._planned = self.graph_decode if meta.graph else self.eager
        self._planned.plan(meta)

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
        return self._planned.forward(q, kv_cache, meta, scale, window, k_scale, v_scale)
