"""Mixture-of-experts MLPs for Qwen3-MoE and Mixtral: a router and stacked SwiGLU experts.

A sparse layer replaces the dense MLP of a Llama-family decoder layer (engine/model/llama.py
takes each layer's MLP from `layer_mlp`). The router scores every token against every expert
(softmax over experts, then top-k, renormalised where the model does so); each expert is a
SwiGLU MLP whose weights are stacked at load into [num_experts, ...] tensors:
    experts.gate_up_proj [E, 2 * moe_intermediate, hidden] = [gate_proj; up_proj] per expert
    experts.down_proj    [E, hidden, moe_intermediate]

Under tensor parallelism every rank holds every expert with its share of the expert's
intermediate rows (engine/parallel/shard.py) and the router whole: each rank routes alike
and the experts' partial outputs are summed by the block's one all-reduce, as a dense MLP's.

`Experts.forward` takes one of two paths. On the CPU, the reference path: for each expert some
token chose, gather those tokens, run the expert, scatter-add its output times the router
weight; it reads the chosen experts back to the host. On CUDA, the fused path
(engine/kernels/fused_moe.py): the (token, slot) pairs sorted by expert on the device and
every expert run by one grouped GEMM, a Triton kernel or torch._grouped_mm as
FUSED_BY_TOKENS says, with no host sync, so decode steps are captured in CUDA graphs.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from engine.kernels import silu_and_mul
from engine.kernels.dispatch import triton_importable, use_triton
from engine.kernels.fused_moe import grouped_mm_experts, grouped_mm_fits, triton_experts
from engine.model.config import ModelConfig
from engine.model.llama import MLP, linear
from engine.model.moe_config import MoeConfig
from engine.parallel.shard import ModelShard

# Checkpoint rows of one expert's projection: (expert, rows) inside our stacked parameter.
ExpertRows = tuple[int, slice]

# Hugging Face names of one expert's projections, per architecture: gate, up, down.
_EXPERT_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
}
_MOE_PARAM = re.compile(
    r"(model\.layers\.\d+\.)mlp\.(gate\.weight|experts\.(gate_up_proj|down_proj))"
)

# The fused implementation on CUDA by token count: the first whose bound is >= T. Measured
# on the H100 (benchmarks/gpu_moe.py, benchmarks/RESULTS.md): up to 256 tokens the Triton
# kernel is the faster in CUDA graphs at Qwen3-30B-A3B's layer (539 against 590 us at 256)
# and Mixtral's but at 64 and 256; from 1,024 torch._grouped_mm is 2-3x faster at Mixtral's
# (its prefill tiles do not suit the Triton kernel), 6-12% slower at Qwen3's.
FUSED_BY_TOKENS: tuple[tuple[float, str], ...] = ((256, "triton"), (math.inf, "grouped_mm"))


class Router(nn.Module):
    """Top-k experts per token and their weights."""

    def __init__(self, config: ModelConfig, moe: MoeConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size))
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.float32_weights = moe.float32_weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]): softmax in float32 first, as transformers
        does, so that the top-k choice does not depend on the dtype's rounding. On CUDA
        one Triton kernel after the logits' GEMM (engine/kernels/triton_moe.py)."""
        logits = linear(x, self.weight)
        if use_triton(logits):
            from engine.kernels import triton_moe

            weights, experts = triton_moe.top_k_softmax(logits, self.top_k, self.norm_topk_prob)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(x.dtype)), experts


class Experts(nn.Module):
    def __init__(self, config: ModelConfig, moe: MoeConfig, shard: ModelShard | None = None):
        super().__init__()
        size = config.hidden_size
        # A shard's part of each expert's rows; all of them where no shard is given.
        inter = moe.moe_intermediate_size if shard is None else shard.expert_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * inter, size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, size, inter))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        if x.is_cuda:
            return self.fused(x.contiguous(), weights, experts)
        return self.reference(x, weights, experts)

    def fused(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """All experts as one grouped computation, chosen by FUSED_BY_TOKENS; the other
        where the chosen one cannot run (no triton; a layout _grouped_mm does not take)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        want = next(impl for bound, impl in FUSED_BY_TOKENS if x.shape[0] <= bound)
        fits = grouped_mm_fits(x, gate_up, down)
        if triton_importable() and (want == "triton" or not fits):
            return triton_experts(x, weights, experts, gate_up, down)
        if fits:
            return grouped_mm_experts(x, weights, experts, gate_up, down)
        return self.reference(x, weights, experts)

    def reference(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        """Each chosen expert runs once over the tokens that chose it."""
        out = torch.zeros_like(x)
        for expert in experts.unique().tolist():  # a host sync: the slow path on CUDA
            tokens, slot = (experts == expert).nonzero(as_tuple=True)
            hidden = silu_and_mul(linear(x[tokens], self.gate_up_proj[expert]))
            hidden = linear(hidden, self.down_proj[expert])
            out.index_add_(0, tokens, (hidden * weights[tokens, slot, None]).to(x.dtype))
        return out


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, moe: MoeConfig, shard: ModelShard | None = None):
        super().__init__()
        shard = shard or ModelShard.whole(config)
        self.tp = shard.tp
        self.gate = Router(config, moe)  # "gate" is the router's name in both checkpoints
        self.experts = Experts(config, moe, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        return self.tp.all_reduce(self.experts(x, weights, experts))


def layer_mlp(config: ModelConfig, layer_index: int, shard: ModelShard) -> nn.Module:
    """A decoder layer's MLP (the shard's part of it): sparse where the config says so,
    else the dense one."""
    if config.moe is not None and config.moe.is_sparse_layer(layer_index):
        return SparseMoeBlock(config, config.moe, shard)
    return MLP(config, shard)


def moe_checkpoint_pieces(
    param: str, config: ModelConfig, shard: ModelShard
) -> dict[str, tuple[str, ExpertRows | None]] | None:
    """Checkpoint names feeding one MoE parameter (None for a parameter that is not MoE).

    Each expert's gate/up/down projection (the shard's part of it) is copied into its slot
    of the stacked tensor; Mixtral names the block `block_sparse_moe` and the projections
    w1 (gate), w3 (up), w2.
    """
    match = _MOE_PARAM.fullmatch(param)
    if config.moe is None or match is None:
        return None
    prefix, tail, stacked = match.groups()
    block, gate, up, down = _EXPERT_NAMES[config.architecture]
    if stacked is None:  # the router
        return {f"{prefix}{block}.{tail}": (param, None)}
    inter = shard.expert_intermediate_size
    parts = ((gate, slice(0, inter)), (up, slice(inter, 2 * inter)))
    if stacked == "down_proj":
        parts = ((down, slice(None)),)
    return {
        f"{prefix}{block}.experts.{expert}.{name}.weight": (param, (expert, rows))
        for expert in range(config.moe.num_experts)
        for name, rows in parts
    }
