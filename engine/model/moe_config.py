"""The mixture-of-experts part of a model's config, read from a Hugging Face config.json.

Qwen3-MoE: `num_experts` experts of `moe_intermediate_size`, top `num_experts_per_tok`,
renormalised only with `norm_topk_prob`; layer i is sparse unless it is in `mlp_only_layers`
or (i + 1) is not a multiple of `decoder_sparse_step` (those keep the dense MLP of
`intermediate_size`). Mixtral: `num_local_experts` experts of `intermediate_size` in every
layer, top `num_experts_per_tok`, always renormalised.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k router weights to sum to 1
    # Mixtral weighs expert outputs in float32; Qwen3-MoE first rounds weights to the dtype.
    float32_weights: bool
    decoder_sparse_step: int = 1  # every this-many-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # dense regardless of the step

    def is_sparse_layer(self, layer_index: int) -> bool:
        return (
            layer_index not in self.mlp_only_layers
            and (layer_index + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], architecture: str) -> MoeConfig | None:
        """None for a dense architecture, or a Qwen3-MoE config with no experts."""
        if architecture == "MixtralForCausalLM":
            moe = cls(
                num_experts=d["num_local_experts"],
                num_experts_per_tok=d["num_experts_per_tok"],
                moe_intermediate_size=d["intermediate_size"],
                norm_topk_prob=True,
                float32_weights=True,
            )
        elif architecture == "Qwen3MoeForCausalLM":
            # Qwen's checkpoints write num_experts; transformers >= 5 saves num_local_experts.
            num_experts = d["num_experts"] if "num_experts" in d else d["num_local_experts"]
            if not num_experts:  # transformers then builds every layer dense
                return None
            moe = cls(
                num_experts=num_experts,
                num_experts_per_tok=d["num_experts_per_tok"],
                moe_intermediate_size=d["moe_intermediate_size"],
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                float32_weights=False,
                decoder_sparse_step=d.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            )
        else:
            return None
        moe.check()
        return moe

    def check(self) -> None:
        """One line naming the first field whose value we cannot run."""
        if self.num_experts < 1:
            _unsupported("num_experts", self.num_experts)
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            _unsupported("num_experts_per_tok", self.num_experts_per_tok, "1..num_experts")
        if self.moe_intermediate_size < 1:
            _unsupported("moe_intermediate_size", self.moe_intermediate_size)
        if self.decoder_sparse_step < 1:
            _unsupported("decoder_sparse_step", self.decoder_sparse_step, ">= 1")


def _unsupported(key: str, value: Any, expected: str = ">= 1") -> None:
    raise ModelLoadError(f"unsupported MoE config value {key}={value!r} (expected {expected})")
