"""CUDA graphs for decode steps: captured per batch-size bucket at start-up, replayed per step.

A decode step launches hundreds of small kernels, and on a slow host their launch time,
not the GPU, sets the pace. So once the KV pool exists, the whole model forward is
captured for each bucket size (largest first, every graph in one shared memory pool) over
static buffers (GraphBuffers). A step of n decodes is padded to the smallest bucket
b >= n (DecodeInputs.padded, batch_size_for), its uploaded inputs are copied into the
first b columns of the static buffer, attention is planned for b sequences (host code:
it runs before the replay, outside the graph, and copies the step's page table and KV
split into the buffers the captured decode kernels read) and the graph replays.

Rows n..b are padding: token 0 at position 0, KV written nowhere (slot -1), attending to
a one-token dummy page (block 0, whatever it holds); their outputs are dropped.
Steps with a prefill, or more decodes than the largest bucket, run eagerly (runner.py).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata
from engine.attention.flashinfer_backend import FlashInferAttention

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 512
_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
_BUCKETS += tuple(range(160, 257, 32)) + tuple(range(320, MAX_GRAPH_BATCH + 1, 64))
DUMMY_BLOCK = 0  # the page padding rows attend to
# Device memory the graphs hold beyond the KV pool, kept free when the pool is sized: the
# attention backend's workspace for each batch size (graph_workspace_bytes), and the shared
# pool, which holds the activations of the largest bucket's forward.
_POOL_BYTES = 256 * 2**20


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes to capture, ascending: the largest is max_num_seqs (up to 512) itself,
    so a full decode batch replays without padding."""
    cap = min(max_num_seqs, MAX_GRAPH_BATCH)
    return [b for b in _BUCKETS if b < cap] + [cap]


def graph_memory_reserve(batch_sizes: list[int], attn: FlashInferAttention) -> int:
    return attn.graph_workspace_bytes(batch_sizes) + _POOL_BYTES


@dataclass
class DecodeInputs:
    """A pure-decode step on the host: one row (one new token) per sequence."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]  # per sequence, the blocks holding its seq_len tokens

    def padded(self, batch_size: int) -> DecodeInputs:
        pad = batch_size - len(self.input_ids)
        assert pad >= 0, (batch_size, len(self.input_ids))
        return DecodeInputs(
            self.input_ids + [0] * pad,
            self.positions + [0] * pad,
            self.slot_mapping + [-1] * pad,  # write nowhere
            self.seq_lens + [1] * pad,  # attend to one token of the dummy page
            self.block_tables + [[DUMMY_BLOCK]] * pad,
        )


@dataclass
class GraphBuffers:
    """What every captured graph reads and writes (rows [0, its batch size)); a replay
    refills the inputs and page tables first."""

    token_inputs: torch.Tensor  # int64 [3, max_batch]: token ids, positions, KV slots
    # the step's page indices, filled by FlashInferAttention.plan_graph()
    kv_indices: torch.Tensor  # int32 [max_batch * max_blocks_per_seq]
    hidden: torch.Tensor  # [max_batch, hidden_size]: the model's output

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        max_blocks_per_seq: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> GraphBuffers:
        def zeros(size: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, device=device)

        return cls(
            token_inputs=torch.zeros(3, max_batch, dtype=torch.int64, device=device),
            kv_indices=zeros(max_batch * max_blocks_per_seq, torch.int32),
            hidden=torch.zeros(max_batch, hidden_size, dtype=dtype, device=device),
        )


class CudaGraphRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        attn: FlashInferAttention,
        kv_caches: list[torch.Tensor],
        block_size: int,
        batch_sizes: list[int],
        max_blocks_per_seq: int,
        hidden_size: int,
        dtype: torch.dtype,
    ):
        self.model = model
        self.attn = attn
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.batch_sizes = sorted(batch_sizes)
        self.device = kv_caches[0].device
        self.buffers = GraphBuffers.allocate(
            self.batch_sizes[-1], max_blocks_per_seq, hidden_size, dtype, self.device
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
        self,
        token_inputs: torch.Tensor,  # int64 [3, b] on the device: ids, positions, slots
        seq_lens: list[int],  # [b]
        block_tables: list[list[int]],  # [b]
    ) -> torch.Tensor:
        """Replay the graph of a step padded to a captured batch size b (DecodeInputs.padded);
        the hidden states [b, hidden], a view of the static output the next replay overwrites."""
        batch_size = len(seq_lens)
        self._stage(token_inputs, seq_lens, block_tables)
        self.graphs[batch_size].replay()
        return self.buffers.hidden[:batch_size]

    def _stage(
        self, token_inputs: torch.Tensor, seq_lens: list[int], block_tables: list[list[int]]
    ) -> None:
        """Copy a padded step's inputs into the static buffers and plan its attention."""
        self.buffers.token_inputs[:, : len(seq_lens)].copy_(token_inputs)
        self.attn.plan_graph(seq_lens, block_tables, self.block_size)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        b = self.buffers
        for size in reversed(self.batch_sizes):  # largest first: the others fit in its pool
            self.attn.add_graph_batch_size(size, b.kv_indices)
            padding = DecodeInputs([], [], [], [], []).padded(size)
            inputs = [padding.input_ids, padding.positions, padding.slot_mapping]
            self._stage(
                torch.tensor(inputs, device=self.device), padding.seq_lens, padding.block_tables
            )
            meta = self._capture_meta(size)
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

    def _capture_meta(self, size: int) -> AttentionMetadata:
        """The metadata a graph is captured with. Its kernels read only slot_mapping (a
        static buffer) and what plan_graph() staged; the other fields describe the all-padding
        batch of the capture and are not updated by a replay."""
        return AttentionMetadata(
            query_start_loc=torch.arange(size + 1, dtype=torch.int32, device=self.device),
            seq_lens=torch.ones(size, dtype=torch.int32, device=self.device),
            block_tables=None,
            slot_mapping=self.buffers.token_inputs[2, :size],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[1] * size,
            block_size=self.block_size,
            block_tables_cpu=[[DUMMY_BLOCK]] * size,
        )
