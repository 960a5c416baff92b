"""The shape of a Llama-family decoder, read from a Hugging Face config.json (or a GGUF).

One frozen dataclass covers Llama, Mistral, Qwen2, Qwen3 and Phi-3 (SmolLM is Llama): they
differ only in qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3), rope settings, tied
embeddings and how the checkpoint names the projections (Phi-3: engine/model/phi3.py).
Qwen3-MoE (Qwen3's attention) and Mixtral (Mistral's) add mixture-of-experts MLPs: `moe`.
Gemma 3 (text) keeps its own layer shape in engine/model/gemma3.py: `gemma3`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError
from engine.model import phi3
from engine.model.fp8 import Fp8Checkpoint
from engine.model.gemma3_config import GEMMA3_ARCHITECTURE, Gemma3Config
from engine.model.moe_config import MoeConfig
from engine.model.rope import check_rope_scaling

# HF `architectures[0]` -> what the checkpoint needs beyond a plain Llama.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    phi3.ARCHITECTURE,
    GEMMA3_ARCHITECTURE,
)
# For config.json files that name only a model_type.
_ARCHITECTURE_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": phi3.ARCHITECTURE,
    "gemma3_text": GEMMA3_ARCHITECTURE,
}
# Architectures with Qwen3's per-head q/k RMSNorm; with Mistral's sliding window.
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", GEMMA3_ARCHITECTURE)
_MISTRAL_WINDOW = ("MistralForCausalLM", "MixtralForCausalLM", phi3.ARCHITECTURE)


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None = plain rope; else has "rope_type" and its params
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on the q, k and v projections (Qwen2)
    qk_norm: bool  # RMSNorm over each q and k head before rope (Qwen3)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoeConfig | None = None  # mixture-of-experts layers (engine/model/moe.py)
    partial_rotary_factor: float = 1.0  # rope over the first part of each head only (Phi-4-mini)
    gemma3: Gemma3Config | None = None  # Gemma 3's layers (engine/model/gemma3.py)
    fp8: Fp8Checkpoint | None = None  # fp8 weights in the checkpoint (engine/model/fp8.py)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        """The softmax scale every layer attends with."""
        if self.gemma3 is not None:
            return self.gemma3.query_pre_attn_scalar**-0.5
        return self.head_dim**-0.5

    @property
    def attention_windows(self) -> tuple[int | None, ...]:
        """The distinct sliding windows of the model's layers, None for global ones."""
        if self.gemma3 is None:
            return (None,)
        return tuple(dict.fromkeys(self.gemma3.layer_windows))

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        """Read a parsed config.json. Raises ModelLoadError for anything we cannot run exactly."""
        try:
            return cls._from_hf_config(d)
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing the key {e.args[0]!r}") from None

    @classmethod
    def _from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        architectures = d.get("architectures") or []
        if architectures:
            architecture = architectures[0]
        else:
            architecture = _ARCHITECTURE_OF_MODEL_TYPE.get(d.get("model_type", ""))
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {architecture!r} in config.json; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        gemma3 = Gemma3Config.from_hf_config(d, architecture)  # checks its own activation
        hidden_act = d.get("hidden_act", "silu")
        if gemma3 is None and hidden_act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {hidden_act!r}; only 'silu' is supported")
        if d.get("mlp_bias"):
            raise ModelLoadError("mlp_bias=true is not supported")

        # Qwen2 always has qkv bias; Llama/Qwen3 `attention_bias` also adds an o_proj bias,
        # which no supported checkpoint uses, so we refuse it rather than load it wrong.
        if architecture == "Qwen2ForCausalLM":
            attention_bias = True
        elif d.get("attention_bias"):
            raise ModelLoadError(f"attention_bias=true is not supported for {architecture}")
        else:
            attention_bias = False

        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        if gemma3 is None:
            rope_theta, rope_scaling, partial_rotary_factor = _read_rope(d, architecture)
        else:  # the global layers' rope; the local layers' is in gemma3
            rope_theta, rope_scaling = gemma3.global_rope_theta, gemma3.global_rope_scaling
            partial_rotary_factor = 1.0
        rotary_dim = int(head_dim * partial_rotary_factor)
        # Only Phi-3's attention rotates part of a head; an odd part has no rotate-half.
        if rotary_dim != head_dim and (architecture != phi3.ARCHITECTURE or rotary_dim % 2):
            raise ModelLoadError(
                f"unsupported partial_rotary_factor {partial_rotary_factor} for {architecture}"
            )
        check_rope_scaling(rope_scaling, rotary_dim)
        return cls(
            architecture=architecture,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_context_length(d, architecture),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=attention_bias,
            qk_norm=architecture in _QK_NORM,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=as_token_ids(d.get("eos_token_id")),
            moe=MoeConfig.from_hf_config(d, architecture),
            partial_rotary_factor=partial_rotary_factor,
            gemma3=gemma3,
            fp8=Fp8Checkpoint.from_hf_config(d),
        )


def as_token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    """config.json writes eos_token_id as an int, a list, or null."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)


def _read_rope(d: dict[str, Any], architecture: str) -> tuple[float, dict[str, Any] | None, float]:
    """(theta, scaling, partial_rotary_factor) from either layout: transformers < 5 writes
    `rope_theta` and `rope_scaling`; transformers >= 5 one `rope_parameters` dict with all."""
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or d.get("rope_theta", 10000.0)
    partial = params.pop("partial_rotary_factor", None) or d.get("partial_rotary_factor") or 1.0
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type in (None, "default"):
        return float(theta), None, float(partial)
    params["rope_type"] = rope_type
    params.pop("type", None)
    if architecture == phi3.ARCHITECTURE:
        params = phi3.phi3_rope(params, d)
    if params["rope_type"] in ("longrope", "yarn") and params.get("factor") is None:
        # transformers' default: how far max_position_embeddings stretches the original context
        original = params.get("original_max_position_embeddings") or d["max_position_embeddings"]
        params["factor"] = d["max_position_embeddings"] / original
    return float(theta), params, float(partial)


def _context_length(d: dict[str, Any], architecture: str) -> int:
    """The longest context we serve exactly.

    We run full causal attention. A sliding window (Mistral v0.1, Qwen with
    use_sliding_window) only changes the result once a sequence outgrows the window,
    so we cap the context at the window instead of implementing windowed attention.
    """
    max_positions = d.get("max_position_embeddings", 2048)
    window = d.get("sliding_window")
    # Mistral, Mixtral and Phi-3 (transformers applies a set sliding_window to them) or
    # Qwen's switch.
    uses_window = architecture in _MISTRAL_WINDOW or d.get("use_sliding_window", False)
    if uses_window and window:
        return min(max_positions, window)
    return max_positions
