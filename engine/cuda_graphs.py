"""CUDA graphs for decode steps: captured per batch-size bucket at start-up, replayed per step.

A decode step launches hundreds of small kernels, and on a slow host their launch time,
not the GPU, sets the pace. So once the KV pool exists, the whole model forward is
captured for each bucket size (largest first, every graph in one shared memory pool) over
static buffers (GraphBuffers). A step of n decodes is padded to the smallest bucket
b >= n (batch_size_for; the runner pads), its input ids, positions and KV slots are
copied into the first b columns of the static buffer, attention is planned for b
sequences (host code: it runs before the replay, outside the graph, and copies the step's
lengths and KV split into the buffers the captured decode kernels read) and the graph
replays. The decode kernels read block ids from the persistent block table itself.

Rows n..b are padding: the padding slot of the persistent batch (token 0, KV written
nowhere, attending to one token of block 0); their outputs are dropped. Steps with a
prefill, or more decodes than the largest bucket, run eagerly (runner.py).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionMetadata

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512
_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
_BUCKETS += tuple(range(160, 257, 32)) + tuple(range(320, MAX_GRAPH_BATCH + 1, 64))
# Device memory the graphs hold beyond the KV pool, kept free when the pool is sized: the
# attention backend's workspace for each batch size (graph_workspace_bytes), and the shared
# pool, which holds the activations of the largest bucket's forward.
_POOL_BYTES = 256 * 2**20


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture, ascending: the largest is max_num_seqs (up to 512) itself,
    so a full decode batch replays without padding."""
    cap = min(max_num_seqs, MAX_GRAPH_BATCH)
    return [b for b in _BUCKETS if b < cap] + [cap]


def graph_memory_reserve(batch_sizes: list[int], attn: AttentionBackend) -> int:
    return attn.graph_workspace_bytes(batch_sizes) + _POOL_BYTES


@dataclass
class GraphBuffers:
    """What every captured graph reads and writes (columns [0, its batch size)); a replay
    refills the inputs first."""

    token_inputs: torch.Tensor  # int64 [3, max_batch]: token ids, positions, KV slots
    hidden: torch.Tensor  # [max_batch, hidden_size]: the model's output


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        kv_caches: list[torch.Tensor],
        block_table: torch.Tensor,  # the persistent batch's; its last row is the padding slot
        block_size: int,
        batch_sizes: list[int],
        hidden_size: int,
        dtype: torch.dtype,
    ):
        assert attn.supports_cuda_graphs, f"{type(attn).__name__} does not run in CUDA graphs"
        self.model = model
        self.attn = attn
        self.kv_caches = kv_caches
        self.block_table = block_table
        self.block_size = block_size
        self.batch_sizes = sorted(batch_sizes)
        self.device = kv_caches[0].device
        largest = self.batch_sizes[-1]
        self.buffers = GraphBuffers(
            token_inputs=torch.zeros(3, largest, dtype=torch.int64, device=self.device),
            hidden=torch.zeros(largest, hidden_size, dtype=dtype, device=self.device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def batch_size_for(self, num_seqs: int) -> int:
        """The captured batch size a step of num_seqs decodes replays at."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Replay the graph of a step padded to a captured batch size b: the hidden states
        [b, hidden], a view of the static output the next replay overwrites."""
        batch_size = meta.num_seqs
        inputs = self.buffers.token_inputs[:, :batch_size]
        inputs[0].copy_(input_ids)
        inputs[1].copy_(positions)
        inputs[2].copy_(meta.slot_mapping)
        self.attn.plan(meta)
        self.graphs[batch_size].replay()
        return self.buffers.hidden[:batch_size]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        for size in reversed(self.batch_sizes):  # largest first: the others fit in its pool
            self.attn.prepare_graph(size)
            meta = self._padding_meta(size)
            self.buffers.token_inputs[:, :size] = 0
            self.buffers.token_inputs[2, :size] = -1  # write nowhere
            self.attn.plan(meta)
            self._forward(size, meta)  # warm-up: JIT compiles and autotunes outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size, meta)
            pool = pool or graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.2f GiB",
            len(self.graphs),
            self.batch_sizes,
            used / 2**30,
        )

    def _forward(self, size: int, meta: AttentionMetadata) -> None:
        input_ids, positions = self.buffers.token_inputs[:2, :size]
        self.buffers.hidden[:size] = self.model(input_ids, positions, self.kv_caches, meta)

    def _padding_meta(self, size: int) -> AttentionMetadata:
        """A step of `size` padding rows, what a graph is captured with. Its kernels read
        only slot_mapping (a static buffer), the block table and what plan() staged."""
        padding_slot = self.block_table.shape[0] - 1
        return AttentionMetadata(
            slots=np.full(size, padding_slot, dtype=np.int32),
            query_lens=np.ones(size, dtype=np.int32),
            seq_lens=np.ones(size, dtype=np.int32),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=self.device),
            seq_lens_device=torch.ones(size, dtype=torch.int32, device=self.device),
            block_table=self.block_table,
            slot_mapping=self.buffers.token_inputs[2, :size],
            block_size=self.block_size,
            graph=True,
        )
