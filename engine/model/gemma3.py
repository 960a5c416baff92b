"""Gemma 3 (text only) on the Llama decoder's pieces (engine/model/llama.py).

What differs from Llama, each as transformers' Gemma3ForCausalLM computes it:
- RMSNorm scales by (1 + weight), in float32, before rounding to the dtype;
- q and k are RMSNormed per head (Gemma's norm) before rope; the softmax scale is
  query_pre_attn_scalar ** -0.5;
- sliding-window layers (rope base rope_local_base_freq) interleave with global layers
  (rope_theta and its scaling); the attention backend applies each layer's window;
- four norms per layer: each sublayer's output is normed before it joins the residual;
- the MLP is GeGLU (tanh-approximated GELU); embeddings are scaled by sqrt(hidden_size)
  rounded to the embedding dtype; the final logits are soft-capped where the config asks.

Parameter names follow Hugging Face, with llama.py's merged qkv_proj and gate_up_proj.
Under tensor parallelism the shard is Llama's: the norms are per token or per head, the
sliding windows per layer, so every rank runs them as they are; the embedding is scaled
after the ranks' rows are summed, and the logits soft-capped after they are gathered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.errors import ModelLoadError
from engine.kernels import rotary_and_store_kv
from engine.model.config import ModelConfig
from engine.model.gemma3_config import Gemma3Config
from engine.model.llama import (
    MLP,
    Attention,
    LlamaForCausalLM,
    MlpFactory,
    VocabParallelEmbedding,
)
from engine.model.rope import RotaryEmbedding
from engine.parallel.group import SINGLE_PROCESS, TensorParallel
from engine.parallel.shard import ModelShard


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))  # stored as an offset from 1
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(Attention):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        backend: AttentionBackend,
        window: int | None,
        shard: ModelShard,
    ):
        super().__init__(config, layer_index, backend, shard)
        self.window = window
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project_qkv(hidden)
        q, k = self.q_norm(q), self.k_norm(k)  # Gemma's norm: not the one rotary fuses
        q = rotary_and_store_kv(
            q,
            k,
            v,
            cos,
            sin,
            kv_cache,
            meta.slot_mapping,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        out = self.backend.forward(
            q,
            kv_cache,
            meta,
            scale=self.scale,
            window=self.window,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return self.tp.all_reduce(self.o_proj(out.reshape(hidden.shape[0], self.q_size)))


class GeGLU(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up))


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        backend: AttentionBackend,
        window: int | None,
        shard: ModelShard,
    ):
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = window is not None
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Gemma3Attention(config, layer_index, backend, window, shard)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = GeGLU(config, shard)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3Model(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        gemma: Gemma3Config,
        backend: AttentionBackend,
        shard: ModelShard,
    ):
        super().__init__()
        self.embed_scale = config.hidden_size**0.5
        self.embed_tokens = VocabParallelEmbedding(shard, config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, i, backend, window, shard)
            for i, window in enumerate(gemma.layer_windows)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.rotary_emb_local = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, gemma.local_rope_theta, None
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # transformers multiplies by a float32 sqrt(hidden_size) rounded to the weights' dtype.
        hidden = hidden * torch.tensor(self.embed_scale).to(hidden.dtype).item()
        global_rope, local_rope = self.rotary_emb(positions), self.rotary_emb_local(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = local_rope if layer.is_sliding else global_rope
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(
        self,
        config: ModelConfig,
        attn_backend: AttentionBackend,
        tp: TensorParallel = SINGLE_PROCESS,
    ):
        assert config.gemma3 is not None, "a Gemma 3 config"
        if not attn_backend.supports_sliding_window:
            raise ModelLoadError(
                f"Gemma 3 needs sliding-window attention, which "
                f"{type(attn_backend).__name__} does not support"
            )
        super().__init__(config, attn_backend, tp=tp)
        self.softcap = config.gemma3.final_logit_softcapping

    def build_model(
        self, config: ModelConfig, attn_backend: AttentionBackend, make_mlp: MlpFactory
    ) -> nn.Module:
        return Gemma3Model(config, config.gemma3, attn_backend, self.shard)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Llama's logits, soft-capped where the config asks."""
        logits = super().compute_logits(hidden)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap
