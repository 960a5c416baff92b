"""Read a llama.cpp GGUF file as a ModelConfig plus float32 tensors in Hugging Face naming.

Every tensor is dequantized with the `gguf` package (F32, F16, BF16, Q4_1, Q8_0, K-quants...)
and reshaped to its Hugging Face shape: GGUF lists dimensions fastest-first, the reverse of
torch. For the llama architecture, llama.cpp's converter interleaves the two rope halves
of every q and k head; we undo that so the rows match Hugging Face's rotate_half layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from engine.errors import ModelLoadError
from engine.model.config import ModelConfig

# general.architecture -> (our architecture name, qkv bias, q/k norm). Mistral GGUFs say "llama".
_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", False, False),
    "qwen2": ("Qwen2ForCausalLM", True, False),
    "qwen3": ("Qwen3ForCausalLM", False, True),
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def gguf_model_config(reader: GGUFReader) -> ModelConfig:
    """The model's shape from the GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}"
        )
    if _field(reader, f"{arch}.expert_count", 0):  # llama.cpp writes Mixtral as "llama"
        raise ModelLoadError(
            "GGUF mixture-of-experts models are not supported; load the safetensors checkpoint"
        )
    architecture, attention_bias, qk_norm = _ARCHITECTURES[arch]
    hidden_size = _field(reader, f"{arch}.embedding_length")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    vocab_size = _field(reader, f"{arch}.vocab_size", None)
    if vocab_size is None:  # most converters write only the token list
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelLoadError(f"GGUF metadata has neither {arch}.vocab_size nor a token list")
        vocab_size = len(tokens.data)
    eos_ids = [
        _field(reader, f"tokenizer.ggml.{key}_token_id", None) for key in ("eos", "eot", "eom")
    ]
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab_size),
        hidden_size=int(hidden_size),
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=int(num_heads),
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden_size // num_heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        attention_bias=attention_bias,
        qk_norm=qk_norm,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids if i is not None)),
    )


def gguf_tensors(reader: GGUFReader, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 tensor) for every tensor, dequantized one at a time."""
    unpermute = _field(reader, "general.architecture") == "llama"
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        weights = dequantize(tensor.data, tensor.tensor_type)
        weights = weights.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if unpermute and name.endswith(("q_proj.weight", "q_proj.bias")):
            weights = _unpermute_rope_rows(weights, config.num_heads)
        elif unpermute and name.endswith(("k_proj.weight", "k_proj.bias")):
            weights = _unpermute_rope_rows(weights, config.num_kv_heads)
        if not weights.flags.writeable:  # F32 tensors come back as views of the mapped file
            weights = weights.copy()
        yield name, torch.from_numpy(weights)


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name == "rope_freqs.weight":
        raise ModelLoadError(
            "GGUF tensor rope_freqs.weight (per-frequency rope factors, e.g. Llama 3.1 "
            "scaling) is not supported"
        )
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_TENSORS and suffix == "weight":
        return f"{_GLOBAL_TENSORS[base]}.weight"
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSORS:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSORS[kind]}.{suffix}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")


def _unpermute_rope_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp stores each head's rows as interleaved pairs (x0, x_half, x1, x_half+1, ...);
    put the first half of every pair back in front, as rotate_half expects."""
    half = weights.shape[0] // num_heads // 2
    rows = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return rows.swapaxes(1, 2).reshape(weights.shape)


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    rope_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if rope_type == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": rope_type}
    factor = _field(reader, f"{arch}.rope.scaling.factor", None)
    if factor is not None:
        scaling["factor"] = float(factor)
    return scaling


_MISSING = object()


def _field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ModelLoadError(f"GGUF metadata has no {key!r}")
        return default
    value = field.contents()
    return value.item() if isinstance(value, np.generic) else value
