"""Tiny random-weight Hugging Face model directories for tests (a helper, not a test file).

write_tiny_model(dir, "llama" | "mistral" | "qwen2" | "qwen3" | "qwen3_moe" | "mixtral" |
"phi3" | "gemma3_text", **config_overrides) writes config.json + safetensors (optionally
sharded) with a real byte-level BPE tokenizer, trained here on a small multilingual corpus,
and a ChatML chat template.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import gguf
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB_SIZE = 400

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A paged cache keeps every token's keys.",
    "Hello, world! How are you today? I am fine, thank you, and you?",
    "Once upon a time there was a small model that served tokens very quickly.",
    "Le renard brun rapide saute par-dessus le chien paresseux. Où est la gare ?",
    "Der schnelle braune Fuchs springt über den faulen Hund. Grüße aus München!",
    "El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca?",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "敏捷的棕色狐狸跳过了懒狗。你好，世界！",
    "素早い茶色の狐がのろまな犬を飛び越える。こんにちは世界。",
    "빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요 세계!",
    "Emoji too: 🙂🚀🎉 and numbers 0123456789, symbols #$%&*()[]{}<>.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5",
]

_CONFIG_CLASSES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
    "phi3": "Phi3Config",
    "gemma3_text": "Gemma3TextConfig",
}


@functools.lru_cache(maxsize=1)
def tiny_tokenizer_json() -> str:
    """A byte-level BPE trained on the corpus above, serialized (cached per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return tokenizer.to_str()


def write_tiny_model(directory: Path, arch: str, shards: int = 1, **overrides: Any) -> Path:
    """Write a tiny model of `arch` into `directory`; overrides go to the transformers config."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer_json = tiny_tokenizer_json()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    eos_id = tokenizer.token_to_id("<|im_end|>")
    pad_id = tokenizer.token_to_id("<|endoftext|>")

    settings: dict[str, Any] = dict(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    settings.update(overrides)
    config = getattr(transformers, _CONFIG_CLASSES[arch])(**settings)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Default init is tiny (std 0.02): widen it so the logits spread and parity is meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # RMSNorm weights: keep near 1
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    if shards > 1:
        total_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
        model.save_pretrained(directory, max_shard_size=total_bytes // shards + 1)
    else:
        model.save_pretrained(directory)

    (directory / "tokenizer.json").write_text(tokenizer_json)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": settings["max_position_embeddings"],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return directory


# Hugging Face architecture -> GGUF `general.architecture` (llama.cpp writes Mistral as llama).
_GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def write_tiny_gguf(
    hf_dir: Path, gguf_path: Path, extra_tensors: dict[str, Any] | None = None
) -> Path:
    """Convert a write_tiny_model directory to an all-F32 GGUF the way llama.cpp does:
    GGUF tensor names, llama's q/k rows permuted for llama.cpp's rope, metadata keys."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    arch = _GGUF_ARCH[config["architectures"][0]]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    rope = config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(gguf_path, arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    vocab = json.loads((hf_dir / "tokenizer.json").read_text())["model"]["vocab"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(sorted(vocab, key=vocab.get))
    writer.add_eos_token_id(config["eos_token_id"])

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    for hf_name, weights in sorted(tensors.items()):
        base, suffix = hf_name.rsplit(".", 1)
        if arch == "llama" and base.endswith("q_proj"):
            weights = _llama_cpp_permute(weights, heads)
        elif arch == "llama" and base.endswith("k_proj"):
            weights = _llama_cpp_permute(weights, kv_heads)
        writer.add_tensor(f"{name_map.get_name(base)}.{suffix}", weights.astype(np.float32))
    for name, weights in (extra_tensors or {}).items():
        writer.add_tensor(name, weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf_path


def _llama_cpp_permute(weights: Any, num_heads: int) -> Any:
    """convert_hf_to_gguf.py's permute: each head's two rope halves become interleaved rows."""
    half = weights.shape[0] // num_heads // 2
    return (
        weights.reshape(num_heads, 2, half, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def build_tiny_sentencepiece_gguf(path: Path) -> Path:
    """A tiny GGUF describing a SentencePiece-style vocabulary: <unk>/<s>/</s>, 256 byte tokens,
    pieces learned in-process, one user-defined token; scores but no merges."""
    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "hello world, hello there",
        "tokenizers are fun to build",
        "numbers 12345 and 678",
    ] * 20
    learner = BackendTokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    learner.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    )
    learned = sorted(learner.get_vocab().items(), key=lambda item: item[1])
    pieces = [token for token, _ in learned if token not in ("<unk>", "<s>", "</s>")]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["<|user|>"]
    token_types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4]
    scores = [0.0] * 259 + [-float(rank) for rank in range(len(pieces))] + [0.0]

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}<|user|>{{ m['content'] }}</s>{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
