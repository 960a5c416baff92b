"""CUDA graphs for decode steps: captured per batch-size bucket at start-up, replayed per step.

A decode step launches hundreds of small kernels, and on a slow host their launch time,
not the GPU, sets the pace. So once the KV pool exists, the whole model forward is
captured for each bucket size (largest first, every graph in one shared memory pool) over
static buffers (GraphBuffers). A step of n decodes is padded to the smallest bucket
b >= n (batch_size_for; the runner pads: a sequence computing a few tokens is that many
rows, each a decode of its own position), its slots and positions are copied into the
first b columns of the static buffer, attention is planned for b sequences (host code:
it runs before the replay, outside the graph, and copies the step's lengths and KV split
into the buffers the captured decode kernels read) and the graph replays. Inside the
graph, the input ids and KV slots are read from the persistent batch's tables, and the
decode kernels read block ids from its block table.

Rows n..b are padding: the padding slot of the persistent batch (token 0, KV written
nowhere, attending to one token of block 0); their outputs are dropped. Steps with a
longer piece of a prompt, or more rows than the largest bucket, run eagerly (runner.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.core.batch import DeviceBatch

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


def device_memory_taken(work: Callable[[], None], device: torch.device) -> int:
    """Device bytes work() took and still holds: the memory free before it less the memory
    free after, each read once torch's allocator has handed back the blocks it caches that
    no tensor uses. Else blocks cached before (the largest step's activations, profiled to
    size the KV pool) count as taken before and, once something empties the cache (a graph
    capture does), as given back: captured graphs seemed to take -3.91 GiB."""

    def free() -> int:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]

    before = free()
    work()
    return before - free()


@dataclass
class GraphBuffers:
    """What every captured graph reads and writes (columns [0, its batch size)); a replay
    refills the inputs first."""

    token_inputs: torch.Tensor  # int64 [2, max_batch]: each row's slot and position
    hidden: torch.Tensor  # [max_batch, hidden_size]: the model's output


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn: AttentionBackend,
        kv_caches: list[torch.Tensor],
        batch: DeviceBatch,
        block_size: int,
        batch_sizes: list[int],
        hidden_size: int,
        dtype: torch.dtype,
    ):
        assert attn.supports_cuda_graphs, f"{type(attn).__name__} does not run in CUDA graphs"
        self.model = model
        self.attn = attn
        self.kv_caches = kv_caches
        self.batch = batch
        self.block_size = block_size
        self.batch_sizes = sorted(batch_sizes)
        self.device = kv_caches[0].device
        largest = self.batch_sizes[-1]
        self.buffers = GraphBuffers(
            token_inputs=torch.zeros(2, largest, dtype=torch.int64, device=self.device),
            hidden=torch.zeros(largest, hidden_size, dtype=dtype, device=self.device),
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._metas: dict[int, AttentionMetadata] = {}  # as captured: its KV slots in the graph
        # What the graphs hold on the device: their pool, workspaces, the kernels they load.
        self.memory_bytes = device_memory_taken(self._capture_all, self.device)
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.2f GiB",
            len(self.graphs),
            self.batch_sizes,
            self.memory_bytes / 2**30,
        )

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def batch_size_for(self, num_seqs: int) -> int:
        """The captured batch size a step of num_seqs decodes replays at."""
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, num_seqs)]

    @torch.inference_mode()
    def run(
        self,
        token_inputs: torch.Tensor,  # int64 [2, b] on the device: each row's slot, position
        slots: np.ndarray,  # int32 [b]: the same slots, on the host, for the plan
        seq_lens: np.ndarray,  # int32 [b]
    ) -> torch.Tensor:
        """Replay the graph of a step padded to a captured batch size b: the hidden states
        [b, hidden], a view of the static output the next replay overwrites."""
        batch_size = len(slots)
        self.buffers.token_inputs[:, :batch_size].copy_(token_inputs)
        meta = dataclasses.replace(self._metas[batch_size], slots=slots, seq_lens=seq_lens)
        self.attn.plan(meta)
        self.graphs[batch_size].replay()
        return self.buffers.hidden[:batch_size]

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for size in reversed(self.batch_sizes):  # largest first: the others fit in its pool
            self.attn.prepare_graph(size)
            self.buffers.token_inputs[0, :size] = self.batch.padding_slot
            self.buffers.token_inputs[1, :size] = 0
            self.attn.plan(self._padding_meta(size))
            self._forward(size)  # warm-up: JIT compiles and autotunes outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._metas[size] = self._forward(size)
            pool = pool or graph.pool()
            self.graphs[size] = graph

    def _forward(self, size: int) -> AttentionMetadata:
        """The graph's work: inputs from the tables, then the model; returns the metadata
        the model ran with (its KV slots are this forward's)."""
        row_slots, positions = self.buffers.token_inputs[:, :size]
        input_ids, kv_slots = self.batch.inputs(row_slots, positions, self.block_size)
        meta = dataclasses.replace(self._padding_meta(size), slot_mapping=kv_slots)
        self.buffers.hidden[:size] = self.model(input_ids, positions, self.kv_caches, meta)
        return meta

    def _padding_meta(self, size: int) -> AttentionMetadata:
        """A step of `size` padding rows: what a graph is captured with. Its kernels read
        the KV slots, the block table and what plan() staged; a replay plans its own
        slots and lengths into the same buffers."""
        return AttentionMetadata(
            slots=np.full(size, self.batch.padding_slot, dtype=np.int32),
            query_lens=np.ones(size, dtype=np.int32),
            seq_lens=np.ones(size, dtype=np.int32),
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=self.device),
            seq_lens_device=torch.ones(size, dtype=torch.int32, device=self.device),
            block_table=self.batch.block_table,
            slot_mapping=torch.full((size,), -1, dtype=torch.int64, device=self.device),
            block_size=self.block_size,
            graph=True,
        )
