"""One Llama-family decoder for Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k norm);
with mixture-of-experts MLPs from engine/model/moe.py, Qwen3-MoE and Mixtral.

Plain, device-agnostic torch over a flat varlen batch: every tensor is [T, ...] where T
is the number of new tokens in the step, across all sequences. Each layer writes its new
K/V into its paged KV pool in the same op that rotates q and k, then attends through the
backend, which reads K/V from the pool. Norms, rotary embedding + KV write and the
activation come from engine/kernels: Triton kernels on CUDA, the same math in plain torch
on the CPU.

The residual stream is carried beside the hidden states, vLLM-style: each layer returns
its MLP output and the stream *without* adding them, and the next norm does the add and
the norm in one fused op (one pass over memory on the GPU; the same numbers either way).

Parameter names follow Hugging Face, except the merged projections:
    self_attn.qkv_proj = [q_proj; k_proj; v_proj]    mlp.gate_up_proj = [gate_proj; up_proj]

Under tensor parallelism each rank builds its shard (engine/parallel/shard.py): its heads,
its part of the MLP and of the vocabulary; o_proj and down_proj outputs are summed across
ranks, the embedding too, and the logits gathered. At size 1 no collective runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.kernels import fused_add_rms_norm, rms_norm, rotary_and_store_kv, silu_and_mul
from engine.kernels.dispatch import use_triton
from engine.model.config import ModelConfig
from engine.model.rope import RotaryEmbedding
from engine.parallel.group import SINGLE_PROCESS, TensorParallel
from engine.parallel.shard import ModelShard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with a residual, (norm(residual + x), residual + x)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


# Up to this many rows (decode batches), CUDA bf16/fp16 projections take the skinny-GEMM
# Triton kernel (engine/kernels/triton_linear.py) instead of cuBLAS. Measured on the H200
# (benchmarks/gpu_kernels.py, benchmarks/RESULTS.md's git history): a decoder layer's four
# projections take 22.6 vs 31.2 us at 1 row and 21.4 vs 26.8 at 2; at 4 rows they are even,
# from 8 cuBLAS wins.
SKINNY_MAX_ROWS = 2

_HAS_ONEDNN = torch.backends.mkldnn.is_available()
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
_MKL_ROWS = range(2, 5)  # the row counts at which the CPU's linear() takes MKL


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), the way each device runs it fastest.

    On the CPU, oneDNN's matmul, but MKL's in the layout (weight @ x.T).T for 2 to 4 rows
    and for float16 (which oneDNN runs only where the CPU has AVX512-FP16).
    Measured on the CI machine, an AMD EPYC with AVX-512 (benchmarks/cpu_linear.py: a
    step's projections of the embedded default, weights from memory), oneDNN beats either
    MKL layout at 1 row (18 against 33 ms) and from 5 rows on (24 against 32 ms at 8 rows,
    41 against 68 at 32, 1.47 against 2.99 s at 2,048); MKL only at 2 to 4 (15-17 vs 20-22).

    On CUDA a decode batch of at most SKINNY_MAX_ROWS rows is a weight read, and the
    skinny-GEMM Triton kernel is built for exactly that (one pass over the weight, wide
    loads, every row of x per weight tile). Anything else (prefills, float32, strided x)
    goes to F.linear (cuBLAS).
    """
    if x.device.type == "cpu":
        if _HAS_ONEDNN and x.dtype in _ONEDNN_DTYPES and x.shape[0] not in _MKL_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
        out = (weight @ x.T).T  # a transposed view: what follows takes any strides
        return out if bias is None else out + bias
    if takes_skinny_kernel(x, weight, bias):
        from engine.kernels import triton_linear

        return triton_linear.skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def takes_skinny_kernel(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> bool:
    """Whether linear() on a CUDA tensor runs engine/kernels/triton_linear.py."""
    return (
        x.dim() == 2
        and x.shape[0] <= SKINNY_MAX_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and weight.dtype == x.dtype
        and (bias is None or bias.dtype == x.dtype)
        and x.is_contiguous()
        and weight.is_contiguous()
        and use_triton(x)
    )


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        backend: AttentionBackend,
        shard: ModelShard | None = None,  # None: the whole model
    ):
        super().__init__()
        shard = shard or ModelShard.whole(config)
        self.layer_index = layer_index
        self.backend = backend
        self.tp = shard.tp
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = shard.q_size
        self.kv_size = shard.kv_size
        self.scale = config.attention_scale
        # An fp8 KV pool's scales for this layer (engine/kv/fp8.py); start-up sets them.
        self.k_scale = self.v_scale = 1.0
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        # No bias (the config refuses one), so the ranks' partial sums add up to the output.
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:  # modules for their weights' names; rotary_and_store_kv applies them
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.project_qkv(hidden)
        if self.q_norm is None:
            norm = (None, None, 0.0)
        else:  # Qwen3: per-head RMSNorm first, in the same op
            norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        # Rotated k and v go straight into the pool; only q comes back.
        q = rotary_and_store_kv(
            q, k, v, cos, sin, kv_cache, meta.slot_mapping, *norm, self.k_scale, self.v_scale
        )
        out = self.backend.forward(
            q, kv_cache, meta, scale=self.scale, k_scale=self.k_scale, v_scale=self.v_scale
        )
        return self.tp.all_reduce(self.o_proj(out.reshape(num_tokens, self.q_size)))

    def project_qkv(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v: [T, heads, head_dim] views of the one merged projection."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.view(num_tokens, self.num_kv_heads, self.head_dim),
        )


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, shard: ModelShard | None = None):
        super().__init__()
        shard = shard or ModelShard.whole(config)
        self.tp = shard.tp
        inter = shard.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * inter, bias=False)
        # No bias (the config refuses one), so the ranks' partial sums add up to the output.
        self.down_proj = Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


# (config, layer index, this rank's shard) -> that layer's MLP: MoE models mix sparse and
# dense layers.
MlpFactory = Callable[[ModelConfig, int, ModelShard], nn.Module]


def dense_mlp(config: ModelConfig, layer_index: int, shard: ModelShard) -> nn.Module:
    return MLP(config, shard)


class VocabParallelEmbedding(nn.Embedding):
    """The embedding rows of shard.vocab. An id another rank holds reads zeros here, so the
    sum across ranks is each id's one row."""

    def __init__(self, shard: ModelShard, hidden_size: int):
        super().__init__(shard.vocab_rows, hidden_size)
        self.tp = shard.tp
        self.vocab = shard.vocab

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local_ids = input_ids - self.vocab.start
        elsewhere = (local_ids < 0) | (local_ids >= len(self.vocab))
        rows = super().forward(local_ids.masked_fill(elsewhere, 0))
        return self.tp.all_reduce(rows.masked_fill(elsewhere.unsqueeze(-1), 0.0))


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        backend: AttentionBackend,
        mlp: nn.Module,
        shard: ModelShard,
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index, backend, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        hidden: torch.Tensor,  # the previous layer's MLP output (the embeddings for layer 0)
        residual: torch.Tensor | None,  # the stream before it (None for layer 0)
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the stream before it): the next norm adds them."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        make_mlp: MlpFactory,
        shard: ModelShard,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(shard, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, backend, make_mlp(config, i, shard), shard)
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            config.rotary_dim,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        cos, sin = self.rotary_emb(positions)  # looked up once, shared by every layer
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, kv_cache, meta)
        return self.norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        make_mlp: MlpFactory = dense_mlp,  # engine/model/moe.py's layer_mlp for MoE models
        tp: TensorParallel = SINGLE_PROCESS,
    ):
        super().__init__()
        self.config = config
        self.shard = ModelShard.of(config, tp)
        self.model = self.build_model(config, attn_backend, make_mlp)
        # Tied: the LM head reads the embedding matrix; no separate parameter exists.
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(config.hidden_size, self.shard.vocab_rows, bias=False)
        )

    def build_model(
        self, config: ModelConfig, attn_backend: AttentionBackend, make_mlp: MlpFactory
    ) -> nn.Module:
        """The decoder under the LM head; a family with other layers builds its own."""
        return LlamaModel(config, attn_backend, make_mlp, self.shard)

    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: list[torch.Tensor],  # one per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, hidden]; call compute_logits on the rows you need."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, vocab] logits for N hidden rows, contiguous, in the model's dtype: the sampler
        and prompt_logprobs read them in float32 themselves, so no float32 copy is made."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        logits = linear(hidden, head.weight)
        if self.shard.tp.size > 1:  # each rank's vocabulary rows, side by side, unpadded
            logits = self.shard.tp.all_gather_last(logits)[:, : self.config.vocab_size]
        return logits.contiguous()
