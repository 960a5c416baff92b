"""Tensor parallelism on several GPUs of one host: NCCL between the ranks, the all-reduces
inside the CUDA graphs. At N ranks the engine tracks one rank's: teacher-forced (prompt
logprobs over long random prompts) the greedy pick agrees on >= 99% of the decisive
positions and >= 95% of all, as bf16 tracks float32 in tests/test_gpu.py; its greedy
generations equal one rank's but for near-ties; and its CUDA-graph decode equals its own
eager one. Skipped without as many GPUs as ranks.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tests.test_gpu import (
    NEAR_TIE,
    assert_greedy_close,
    gpu_llm,
    greedy,
    random_prompts,
    write_gpu_model,
)

SIZES = [2, 4]

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """tests/test_gpu.py's Qwen3-shaped model: 4 query heads and 2 KV heads (at 4 ranks,
    each KV head held by two)."""
    return write_gpu_model(tmp_path_factory.mktemp("gpu-tp"), "qwen3")


def ranks(size: int):
    return pytest.param(
        size,
        marks=pytest.mark.skipif(
            not torch.cuda.is_available() or torch.cuda.device_count() < size,
            reason=f"needs {size} CUDA GPUs",
        ),
        id=f"tp{size}",
    )


def run(model_dir, prompts, params, graph_steps: list[int] | None = None, **settings):
    """The prompts' outputs from a fresh engine, closed (its workers gone) before
    returning; graph_steps gets how many steps replayed a CUDA graph."""
    llm: LLM = gpu_llm(model_dir, **settings)
    try:
        outputs = llm.generate(prompts, params)
        if graph_steps is not None:
            graph_steps.append(llm.engine.runner.num_graph_steps)
        return outputs
    finally:
        llm.engine.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def prompt_top2(outputs: list[RequestOutput]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt position's best token and its lead over the second (nats), all prompts
    one after another."""
    best, lead = [], []
    for output in outputs:
        for entry in output.prompt_logprobs[1:]:  # the first token has no prediction
            (first, first_lp), (_, second_lp) = entry.top[:2]
            best.append(first)
            lead.append(first_lp - second_lp)
    return torch.tensor(best), torch.tensor(lead)


@pytest.mark.parametrize("size", [ranks(s) for s in SIZES])
def test_n_ranks_track_one_rank_teacher_forced(model_dir, size):
    prompts = random_prompts(4, seed=21, lo=256, hi=256)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    want_best, want_lead = prompt_top2(run(model_dir, prompts, params))
    got_best, _ = prompt_top2(run(model_dir, prompts, params, tensor_parallel_size=size))
    decisive = want_lead >= NEAR_TIE
    agree = got_best == want_best
    print(
        f"TP={size} vs TP=1: top-1 agreement {agree.float().mean():.3f} overall, "
        f"{agree[decisive].float().mean():.3f} on {int(decisive.sum())} decisive positions"
    )
    assert agree[decisive].float().mean() >= 0.99
    assert agree.float().mean() >= 0.95


@pytest.mark.parametrize("size", [ranks(s) for s in SIZES])
def test_n_ranks_generate_what_one_does(model_dir, size):
    prompts = random_prompts(13, seed=4, lo=5, hi=70)
    params = [greedy(6 + 3 * i) for i in range(13)]
    want = run(model_dir, prompts, params, max_num_seqs=16)
    assert_greedy_close(
        run(model_dir, prompts, params, max_num_seqs=16, tensor_parallel_size=size), want
    )


@pytest.mark.parametrize("size", [ranks(s) for s in SIZES])
def test_cuda_graph_decode_at_n_ranks_matches_eager(model_dir, size):
    """The decode batch shrinks 13 -> 1 through the graphs' buckets, padded on most steps."""
    prompts = random_prompts(13, seed=4, lo=5, hi=70)
    params = [greedy(6 + 3 * i) for i in range(13)]
    settings = {"max_num_seqs": 16, "tensor_parallel_size": size}
    want = run(model_dir, prompts, params, enforce_eager=True, **settings)
    graph_steps: list[int] = []
    assert_greedy_close(run(model_dir, prompts, params, graph_steps, **settings), want)
    assert graph_steps[0] > 0
