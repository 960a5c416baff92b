"""Phi-3 (fused checkpoint projections, longrope, partial rotary) and YaRN on Qwen3 and
Llama against transformers, in float32, through the offline LLM: greedy tokens over 48 steps
for four prompts in one batch, and each prompt's last-position logits. And the Triton rotary
kernel (the CUDA path) on these variants' cos/sin tables, against the torch path.

The longrope model's original context is 32 positions, so every generation crosses it and
half the prompts start past it. Our table rotates a position below it with the short
factors and one from it on with the long ones (engine/model/rope.py): what transformers
computes generating one token a step from a shorter prompt. A longer prompt it rotates
with the long factors throughout in its first forward; we match transformers fed that
prompt in two forwards split at the original context, as its KV cache then holds it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from engine.attention.torch_backend import TorchPagedAttention
from engine.kernels.dispatch import triton_importable
from engine.kernels.rotary import rotary_and_store_kv_torch
from engine.llm import LLM
from engine.model.loader import load_model
from engine.model.rope import rope_cos_sin
from engine.sampling_params import SamplingParams
from tests.test_kernels import (
    INTERPRETED,
    TRITON_TARGETS,
    kv_pool,
    qkv_inputs,
    rerun_interpreter_cases,
    rotary_tolerance,
)
from tests.test_model_parity import PagedRunner, prompt_ids, rel_error
from tests.tiny_models import write_tiny_model

ORIGINAL_CONTEXT = 32
NEW_TOKENS = 48
TOLERANCE = 1e-4


def longrope(rotary_dim: int = 16) -> dict:
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.0 + 0.9 * i for i in range(half)],
    }


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT}
# DeepSeek's fields: its own beta range, and mscale over mscale_all_dim as the cos/sin factor.
YARN_MSCALE = {**YARN, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}

# name -> (arch, write_tiny_model keyword arguments, prompt lengths)
MODELS = {
    "phi3": ("phi3", {}, (5, 17, 30, 44)),
    "phi3-longrope-short-prompts": (
        "phi3",
        {
            "rope_scaling": longrope(),
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
            "tie_word_embeddings": True,  # Phi-4-mini ties its head
        },
        (6, 19, 25, 31),
    ),
    # Phi-4-mini's layout: rope over the first part of each head only.
    "phi3-partial-rotary-longrope": (
        "phi3",
        {
            "rope_scaling": longrope(rotary_dim=8),
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
            "partial_rotary_factor": 0.5,
        },
        (7, 16, 28, 31),
    ),
    "qwen3-yarn": ("qwen3", {"rope_scaling": YARN}, (5, 17, 30, 44)),
    "llama-yarn-mscale": ("llama", {"rope_scaling": YARN_MSCALE}, (9, 23, 38, 51)),
}


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """As in test_model_parity: tiny models run faster on one thread of a shared runner."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference_model(directory: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@torch.inference_mode()
def reference_greedy(reference, pieces: list[list[int]], new_tokens: int):
    """transformers' greedy continuation of the prompt fed as `pieces` (one forward each,
    then one per token) over its KV cache: (new token ids, the last prompt position's logits)."""
    past, logits = None, None
    for piece in pieces:
        out = reference(torch.tensor([piece]), cache=past, use_cache=True)
        past, logits = out.cache, out.logits[0, -1].float()
    prompt_logits, tokens = logits, []
    while len(tokens) < new_tokens:
        tokens.append(int(logits.argmax()))
        out = reference(torch.tensor([tokens[-1:]]), cache=past, use_cache=True)
        past, logits = out.cache, out.logits[0, -1].float()
    return tokens, prompt_logits


def check_against_reference(directory: Path, prompts: list[list[int]], split_at: int | None):
    """Our greedy tokens (four prompts in one batch through the offline LLM) and each
    prompt's last-position logits against transformers'."""
    llm = LLM(str(directory), dtype="float32", num_blocks=64, block_size=16)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, greedy)

    model, config = load_model(directory, torch.float32, "cpu", TorchPagedAttention())
    reference = reference_model(directory)
    for prompt, output in zip(prompts, outputs, strict=True):
        pieces = [prompt] if split_at is None else [prompt[:split_at], prompt[split_at:]]
        expected_tokens, expected_logits = reference_greedy(reference, pieces, NEW_TOKENS)
        assert output.outputs[0].token_ids == expected_tokens
        logits = PagedRunner(model, config).step([(0, prompt)])[0][-1]
        assert rel_error(logits, expected_logits) < TOLERANCE


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_and_logits_match_transformers(name: str, tmp_path: Path):
    arch, overrides, lengths = MODELS[name]
    directory = write_tiny_model(tmp_path, arch, **overrides)
    vocab_size = transformers.AutoConfig.from_pretrained(directory).vocab_size
    prompts = [prompt_ids(vocab_size, n, seed=n) for n in lengths]
    check_against_reference(directory, prompts, split_at=None)


def test_longrope_prompt_past_the_original_context(tmp_path: Path):
    overrides = {
        "rope_scaling": longrope(),
        "original_max_position_embeddings": ORIGINAL_CONTEXT,
    }
    directory = write_tiny_model(tmp_path, "phi3", **overrides)
    vocab_size = transformers.AutoConfig.from_pretrained(directory).vocab_size
    prompts = [prompt_ids(vocab_size, n, seed=n) for n in (33, 40, 47, 60)]
    check_against_reference(directory, prompts, split_at=ORIGINAL_CONTEXT)


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize(
    "scaling, rotary_dim",
    [
        ({**longrope(rotary_dim=48), "original_max_position_embeddings": 32, "factor": 16.0}, 48),
        (YARN, 64),
    ],
    ids=["longrope-partial", "yarn"],
)
def test_triton_rotary_on_the_scaled_tables(target: str, scaling: dict, rotary_dim: int) -> None:
    """The kernel reads the same cos/sin table as the torch path, scaled and partly unturned,
    at positions on both sides of longrope's switch."""
    from engine.kernels import triton_kernels

    device = "cuda" if target == "cuda" else "cpu"
    tokens, num_kv_heads, head_dim = 9, 2, 64
    q, k, v, _, _ = qkv_inputs(tokens, (4, num_kv_heads, head_dim), torch.float32, device)
    cos_table, sin_table = rope_cos_sin(head_dim, 128, 1e4, scaling, rotary_dim)
    positions = torch.tensor([0, 5, 30, 31, 32, 33, 64, 100, 127])
    cos, sin = cos_table[positions].to(device), sin_table[positions].to(device)
    cache, slots = kv_pool(tokens, num_kv_heads, head_dim, torch.float32, device)
    expected = cache.clone()
    no_norm = (None, None, 0.0)
    want = rotary_and_store_kv_torch(q, k, v, cos, sin, expected, slots, *no_norm)
    got = triton_kernels.rotary_and_store_kv(q, k, v, cos, sin, cache, slots, *no_norm)
    torch.testing.assert_close(got, want, **rotary_tolerance(torch.float32, target))
    torch.testing.assert_close(cache, expected, **rotary_tolerance(torch.float32, target))


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_triton_rotary_in_the_interpreter() -> None:
    rerun_interpreter_cases(__file__)
