"""Each model family beyond the Llama layout on the GPU: bf16 on CUDA tracks the float32
CPU path (itself matched to transformers by the parity tests), and CUDA-graph decode
generates what eager decode does (tests/test_gpu_moe.py's for the MoE families).

Tiny random models at unit gain (tests/test_gpu.py's at_unit_gain) with head_dim 128, a
head size flashinfer builds kernels for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from tests.test_gpu import (
    assert_greedy_close,
    assert_tracks_float32,
    at_unit_gain,
    gpu_llm,
    greedy,
    random_prompts,
    release_gpu_memory,  # noqa: F401 (autouse: each test's engines go before the next)
    teacher_forced_logits,
)
from tests.tiny_models import TOKENIZER_VOCAB_SIZE, write_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# A mixture of experts picks its top k experts by router logit; where the k-th and the next
# are closer than this in some layer, bf16 rounding alone may swap them and move the output
# far (measured on the CPU: the bf16 engine's misses on decisive positions all sat at such
# ties; beyond 0.05 it agreed everywhere).
ROUTER_NEAR_TIE = 0.05
HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=128)
# name -> (model_type, write_tiny_model keyword arguments)
FAMILIES = {
    # Phi-3's fused qkv / gate_up checkpoint, longrope past a 64-token original context.
    "phi3-longrope": (
        "phi3",
        dict(
            hidden_size=512,
            intermediate_size=512,
            num_hidden_layers=3,
            max_position_embeddings=1024,
            original_max_position_embeddings=64,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(64)],
                "long_factor": [1.0 + 0.5 * i for i in range(64)],
            },
            **HEADS,
        ),
    ),
    "qwen3-moe": (
        "qwen3_moe",
        dict(
            hidden_size=256,
            num_hidden_layers=3,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=128,
            norm_topk_prob=True,
            max_position_embeddings=1024,
            **HEADS,
        ),
    ),
    "mixtral": (
        "mixtral",
        dict(
            hidden_size=512,
            intermediate_size=256,
            num_hidden_layers=3,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=1024,
            **HEADS,
        ),
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory) -> Path:
    model_type, overrides = FAMILIES[request.param]
    directory = write_tiny_model(tmp_path_factory.mktemp(request.param), model_type, **overrides)
    return at_unit_gain(directory)


def test_bf16_gpu_tracks_float32_cpu_teacher_forced(family_dir):
    tokens = random_prompts(2, seed=5, lo=200, hi=200)
    gpu = teacher_forced_logits(family_dir, "cuda", torch.bfloat16, tokens)
    cpu = teacher_forced_logits(family_dir, "cpu", torch.float32, tokens)
    assert_tracks_float32(
        gpu, cpu, family_dir.name, TOKENIZER_VOCAB_SIZE, settled_routing(family_dir, tokens)
    )


def settled_routing(model_dir: Path, tokens: list[list[int]]) -> list[torch.Tensor] | None:
    """Per sequence, the positions where transformers' float32 routers (every layer's) put
    ROUTER_NEAR_TIE or more between the last expert they chose and the next; None for a
    dense model."""
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    top_k = getattr(reference.config, "num_experts_per_tok", None)
    if top_k is None:
        return None
    settled = []
    with torch.no_grad():
        for sequence in tokens:
            routers = reference(torch.tensor([sequence]), output_router_logits=True).router_logits
            ranked = torch.stack(routers).sort(dim=-1, descending=True).values  # [L, T, E]
            gap = ranked[..., top_k - 1] - ranked[..., top_k]
            settled.append(gap.min(dim=0).values >= ROUTER_NEAR_TIE)
    return settled


# The MoE families' graph decode is tests/test_gpu_moe.py's, with each fused implementation.
@pytest.mark.parametrize("family_dir", ["phi3-longrope"], indirect=True)
def test_cuda_graph_decode_matches_eager(family_dir):
    prompts = random_prompts(9, seed=6, lo=5, hi=90)
    params = [greedy(8 + 4 * i) for i in range(9)]
    eager = gpu_llm(family_dir, max_num_seqs=16, enforce_eager=True)
    want = eager.generate(prompts, params)
    del eager
    llm = gpu_llm(family_dir, max_num_seqs=16)
    assert llm.engine.runner.graphs is not None
    replayed = llm.engine.runner.num_graph_steps
    assert_greedy_close(llm.generate(prompts, params), want)
    assert llm.engine.runner.num_graph_steps - replayed >= 8 + 4 * 8 - 1
