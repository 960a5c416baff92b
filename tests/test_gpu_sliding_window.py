"""Sliding-window attention on CUDA, and Gemma 3 on it: each CUDA attention path against
the torch backend's windowed attention, then a tiny Gemma 3 through the engine, with and
without CUDA graphs, and in bf16 against the float32 CPU model. Skipped without CUDA.

The kernels run Gemma's head widths (128 and 256) on pages of 16 and 64 tokens, over
sequences shorter than the window, at it and far past it; the model's window (32) is
short enough that its prompts outgrow it and its decodes cross it.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.flashinfer_backend import FlashInferAttention
from engine.attention.torch_backend import TorchPagedAttention
from engine.attention.triton_decode import TritonGraphDecode
from engine.kernels import rotary_and_store_kv
from engine.kernels.kv_cache import store_kv_torch
from engine.kernels.rotary import rotary_and_store_kv_torch
from engine.llm import LLM
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
from tests.test_kernels import assert_pools_close, kv_pool, qkv_inputs, rotary_tolerance
from tests.test_torch_attention import SeqCase, make_batch
from tests.tiny_models import TOKENIZER_VOCAB_SIZE, write_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WINDOW = 48  # for the kernels: between the shortest and the longest sequences below
MODEL_WINDOW = 32
S, F = "sliding_attention", "full_attention"


def on_cuda(meta: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(
        meta,
        query_start_loc=meta.query_start_loc.cuda(),
        seq_lens_device=meta.seq_lens_device.cuda(),
        block_table=meta.block_table.cuda(),
        slot_mapping=meta.slot_mapping.cuda(),
    )


# Decodes first (the scheduler's order): shorter than the window, at it, one past it, far
# past it; then a short prompt, a prompt past the window, and a chunk behind a cached prefix
# whose window starts inside the prefix.
STEP = [
    SeqCase(10, 1),
    SeqCase(WINDOW - 1, 1),
    SeqCase(WINDOW, 1),
    SeqCase(700, 1),
    SeqCase(0, 20),
    SeqCase(0, 200),
    SeqCase(150, 70),
]


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim", [128, 256])
def test_flashinfer_windowed_step_equals_the_torch_backend(
    head_dim, block_size, tensor_cores, monkeypatch
):
    """One eager step of decodes and prefills, planned once for both kinds of layer."""
    from engine.attention import flashinfer_backend

    if tensor_cores:
        monkeypatch.setattr(flashinfer_backend, "TENSOR_CORE_MIN_BATCH", 1)
    heads, kv_heads, scale = 16, 8, 0.0625  # Gemma-3-12B's heads; query_pre_attn_scalar 256
    num_blocks = sum(-(-(c.cached + c.new) // block_size) for c in STEP) + 8
    batch = make_batch(STEP, heads, kv_heads, block_size, torch.bfloat16, 7, head_dim, num_blocks)
    meta = on_cuda(batch.meta)
    q, kv_cache = batch.q.cuda(), batch.kv_cache.cuda()
    store_kv_torch(batch.k.cuda(), batch.v.cuda(), kv_cache, meta.slot_mapping)
    attn = FlashInferAttention(torch.device("cuda"))
    attn.configure(heads, kv_heads, head_dim, torch.bfloat16, scale, windows=(WINDOW, None))
    attn.plan(meta)
    reference = TorchPagedAttention()
    for window in (WINDOW, None, WINDOW):  # layers of either kind, in any order
        got = attn.forward(q, kv_cache, meta, scale, window)
        want = reference.forward(q, kv_cache, meta, scale, window)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def decode_meta(lens: list[int], tables: list[list[int]], block_size: int) -> AttentionMetadata:
    slot_mapping = torch.zeros(len(lens), dtype=torch.int64, device="cuda")
    return AttentionMetadata.from_block_tables(
        [1] * len(lens), lens, tables, slot_mapping, block_size
    )


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("batch_size", [3, 80])  # 80: the configuration from 64 sequences on
def test_graph_decode_replays_both_kinds_of_layer(batch_size, head_dim, block_size):
    """One graph, captured on one step's plan, runs a sliding and a global layer; replayed
    on other steps' plans, each equals the torch backend's attention for its window."""
    heads, kv_heads, scale = 16, 8, 0.0625
    num_blocks = 4096 // block_size * batch_size // 8 + batch_size
    gen = torch.Generator().manual_seed(head_dim + block_size)
    kv_cache = torch.randn(
        (num_blocks, 2, block_size, kv_heads, head_dim), generator=gen, dtype=torch.bfloat16
    ).cuda()
    q = torch.randn((batch_size, heads, head_dim), generator=gen, dtype=torch.bfloat16).cuda()
    attn = TritonGraphDecode(torch.device("cuda"))
    attn.configure(heads, kv_heads, head_dim, torch.bfloat16, scale, windows=(WINDOW, None))
    attn.prepare_graph(batch_size)
    max_pages = num_blocks // batch_size
    block_table = torch.zeros(batch_size + 1, max_pages, dtype=torch.int32, device="cuda")

    def graph_meta(lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
        block_table.zero_()
        for i, blocks in enumerate(tables):
            block_table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        meta = decode_meta(lens, tables, block_size)
        return dataclasses.replace(meta, block_table=block_table, graph=True)

    def both_layers(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return attn.forward(q, kv_cache, meta, scale, WINDOW), attn.forward(
            q, kv_cache, meta, scale
        )

    capture_meta = graph_meta([1] * batch_size, [[0]] * batch_size)
    attn.plan(capture_meta)
    both_layers(capture_meta)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = both_layers(capture_meta)
    rng = random.Random(batch_size)
    for longest in (WINDOW // 2, 3 * WINDOW, max_pages * block_size):
        lens = [rng.randint(1, longest) for _ in range(batch_size)]
        lens[0] = longest  # at least one past the window once longest is
        blocks = iter(rng.sample(range(num_blocks), num_blocks))
        tables = [[next(blocks) for _ in range(-(-n // block_size))] for n in lens]
        meta = graph_meta(lens, tables)
        attn.plan(meta)
        graph.replay()
        reference = TorchPagedAttention()
        for got, window in zip(replayed, (WINDOW, None), strict=True):
            want = reference.forward(q, kv_cache, meta, scale, window)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotary_and_store_kv_on_cuda_at_gemmas_head_width(dtype):
    """Gemma's q and k reach the fused rotary op already normed (its (1 + w) norm runs
    before), with head_dim 256 and either rope table."""
    heads = (16, 8, 256)
    for tokens in (1, 7, 300):
        q, k, v, cos, sin = qkv_inputs(tokens, heads, dtype, "cuda")
        cache, slots = kv_pool(tokens, heads[1], heads[2], dtype, "cuda")
        expected = cache.clone()
        got = rotary_and_store_kv(q, k, v, cos, sin, cache, slots)
        want = rotary_and_store_kv_torch(q, k, v, cos, sin, expected, slots)
        torch.testing.assert_close(got, want, **rotary_tolerance(dtype))
        assert_pools_close(cache, expected, dtype)


# ---- a tiny Gemma 3 on CUDA -------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    """A Gemma 3 flashinfer runs (head_dim 256, 2 query heads per KV head, a softmax scale
    that is not head_dim's), a global layer between sliding ones, re-initialised at unit
    gain as tests/test_gpu.py's model is, so bf16 rounding does not make it chaotic."""
    directory = write_tiny_model(
        tmp_path_factory.mktemp("gpu-gemma3"),
        "gemma3_text",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        layer_types=[S, S, F, S],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=256,
        query_pre_attn_scalar=64,
        sliding_window=MODEL_WINDOW,
        max_position_embeddings=1024,
    )
    return at_unit_gain(directory)


@pytest.mark.parametrize("block_size", [16, 64])
def test_gemma3_cuda_graph_decode_matches_eager(gemma3_dir, block_size):
    # Prompts shorter and longer than the window, and 40 to 48 tokens each: the short ones'
    # decodes cross it, the long ones' run past it.
    prompts = random_prompts(9, seed=31, lo=5, hi=90)
    params = [greedy(40 + i) for i in range(9)]
    eager = gpu_llm(gemma3_dir, max_num_seqs=16, enforce_eager=True, block_size=block_size)
    assert eager.engine.runner.graphs is None
    want = eager.generate(prompts, params)
    del eager
    llm = gpu_llm(gemma3_dir, max_num_seqs=16, block_size=block_size)
    assert llm.engine.runner.graphs is not None
    replayed = llm.engine.runner.num_graph_steps
    got = llm.generate(prompts, params)
    assert llm.engine.runner.num_graph_steps - replayed >= 30  # the decodes, in graphs
    assert_greedy_close(got, want)


def test_gemma3_fp16_engine_generates_what_the_float32_cpu_engine_does(gemma3_dir):
    prompts = random_prompts(6, seed=33, lo=5, hi=80)
    params = greedy(40)
    cpu = LLM(str(gemma3_dir), device="cpu", num_blocks=512, block_size=16)
    want = cpu.generate(prompts, params)
    del cpu
    assert_greedy_close(gpu_llm(gemma3_dir, dtype="float16").generate(prompts, params), want)


def test_gemma3_bf16_gpu_tracks_float32_cpu_teacher_forced(gemma3_dir):
    """tests/test_gpu.py's teacher-forced steps (prompts, chunks behind a prefix, decodes
    before and after a prefill), 256 positions each: far past the window."""
    tokens = random_prompts(2, seed=3, lo=256, hi=256)
    gpu = teacher_forced_logits(gemma3_dir, "cuda", torch.bfloat16, tokens)
    cpu = teacher_forced_logits(gemma3_dir, "cpu", torch.float32, tokens)
    assert_tracks_float32(gpu, cpu, "gemma3 bf16", vocab=TOKENIZER_VOCAB_SIZE)
