"""What one rank holds of a dense Llama-family model under tensor parallelism.

Megatron's split: q/k/v and gate/up by output rows (column-parallel), o_proj and down_proj
by input columns (row-parallel, their partial outputs summed by an all-reduce), the
embedding and the LM head by vocabulary rows. A mixture of experts' experts are split as
the dense MLP, each by its own intermediate size: every rank holds every expert, so one
grouped computation per rank runs as many rows as the others, and the router is held
whole. Norms are held whole by every rank. At size 1 the shard is the whole model. A
checkpoint that fuses projections (Phi-3's qkv_proj and gate_up_proj) is read as each
part's rows of the shard, in the parts' order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import ModelLoadError
from engine.parallel.group import SINGLE_PROCESS, TensorParallel

if TYPE_CHECKING:  # engine.model imports this module
    from engine.model.config import ModelConfig

# A fused checkpoint tensor -> the projections whose rows it stacks, in order.
FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class ModelShard:
    tp: TensorParallel
    head_dim: int
    heads: range  # the checkpoint's query heads held here
    kv_heads: tuple[int, ...]  # the checkpoint's KV head behind each local one, in order
    intermediate: range  # rows of gate_proj and up_proj, columns of down_proj
    expert_intermediate: range  # the same of each expert (empty for a dense model)
    vocab: range  # rows of the embedding and LM head read from the checkpoint
    vocab_rows: int  # their rows here: ceil(vocab / size) on every rank, the tail zero
    # The whole model's rows of each column-parallel projection: where a fused part starts.
    model_rows: tuple[tuple[str, int], ...]

    @classmethod
    def whole(cls, config: ModelConfig) -> ModelShard:
        return cls.of(config, SINGLE_PROCESS)

    @classmethod
    def of(cls, config: ModelConfig, tp: TensorParallel) -> ModelShard:
        heads, kv_heads, size, rank = config.num_heads, config.num_kv_heads, tp.size, tp.rank
        expert_intermediate = 0 if config.moe is None else config.moe.moe_intermediate_size
        if heads % size:
            raise ModelLoadError(
                f"num_attention_heads ({heads}) must be a multiple of tensor_parallel_size ({size})"
            )
        # A rank's query heads need their KV heads beside them, each read by as many query
        # heads (the attention kernels' GQA). Where size divides the KV heads each rank
        # holds its share; where the KV heads divide size, one, shared by size / kv_heads
        # ranks. Any other count would leave uneven groups (6 query heads and 3 KV heads at
        # size 2: rank 0's heads 0 and 1 read KV head 0, head 2 KV head 1), so each KV head
        # is repeated until there are lcm(kv_heads, size), every rank holding lcm / size of
        # them: exact, at the cost of the repeats' KV memory, where vLLM refuses the model.
        repeated = math.lcm(kv_heads, size)
        per_rank = repeated // size
        local = range(rank * per_rank, (rank + 1) * per_rank)
        vocab_rows = -(-config.vocab_size // size)
        first_row = min(rank * vocab_rows, config.vocab_size)
        return cls(
            tp=tp,
            head_dim=config.head_dim,
            heads=_part(heads, tp),
            kv_heads=tuple(head * kv_heads // repeated for head in local),
            # Any split of an MLP sums to the same, so an uneven intermediate size is fine.
            intermediate=_part(config.intermediate_size, tp),
            expert_intermediate=_part(expert_intermediate, tp),
            vocab=range(first_row, min(first_row + vocab_rows, config.vocab_size)),
            vocab_rows=vocab_rows,
            model_rows=(
                ("q_proj", heads * config.head_dim),
                ("k_proj", kv_heads * config.head_dim),
                ("v_proj", kv_heads * config.head_dim),
                ("gate_proj", config.intermediate_size),
                ("up_proj", config.intermediate_size),
            ),
        )

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def intermediate_size(self) -> int:
        return len(self.intermediate)

    @property
    def expert_intermediate_size(self) -> int:
        return len(self.expert_intermediate)

    def checkpoint_index(self, name: str) -> tuple[int, Sequence[int]] | None:
        """(dim, indices along it) of the checkpoint tensor `name` that this rank holds,
        in order; None for all of it. The indices are a range except for repeated KV heads
        and fused projections."""
        if self.tp.size == 1:
            return None
        module = name.rpartition(".")[0].rpartition(".")[2]
        if ".experts." in name:  # Mixtral names gate, up and down w1, w3 and w2
            return (1 if module in ("down_proj", "w2") else 0), self.expert_intermediate
        # Column-parallel layers take output rows (dim 0), row-parallel ones input columns.
        if module in FUSED_PARTS:
            rows: list[int] = []
            model_rows, start = dict(self.model_rows), 0
            for part in FUSED_PARTS[module]:
                rows.extend(start + row for row in self._output_rows(part))
                start += model_rows[part]
            return 0, tuple(rows)
        if module in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            return 0, self._output_rows(module)
        if module == "o_proj":
            return 1, self._head_rows(self.heads)
        if module == "down_proj":
            return 1, self.intermediate
        if module in ("embed_tokens", "lm_head"):
            return 0, self.vocab
        return None  # norms, the router

    def _output_rows(self, module: str) -> Sequence[int]:
        """The rows of a column-parallel projection held here."""
        if module == "q_proj":
            return self._head_rows(self.heads)
        if module in ("k_proj", "v_proj"):
            first, last = self.kv_heads[0], self.kv_heads[-1]
            if len(self.kv_heads) == last + 1 - first:  # no repeats
                return self._head_rows(range(first, last + 1))
            return tuple(row for h in self.kv_heads for row in self._head_rows(range(h, h + 1)))
        return self.intermediate  # gate_proj, up_proj

    def _head_rows(self, heads: range) -> range:
        return range(heads.start * self.head_dim, heads.stop * self.head_dim)


def _part(total: int, tp: TensorParallel) -> range:
    """This rank's part of `total` rows, split as evenly as can be."""
    return range(tp.rank * total // tp.size, (tp.rank + 1) * total // tp.size)
