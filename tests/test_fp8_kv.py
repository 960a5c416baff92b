"""The fp8 (e4m3) KV pool on the CPU: what a store keeps, how the torch backend reads it,
what the setting checks, the capacity it buys, a checkpoint's scales, and what it costs a
model's greedy picks. The Triton store and decode kernels are checked against these paths
in tests/test_kernels.py and tests/test_decode_attention.py (the interpreter, and CUDA);
flashinfer and CUDA graphs in tests/test_gpu_fp8_kv.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import TorchPagedAttention
from engine.config import CacheConfig, EngineConfig
from engine.errors import ValidationError
from engine.kernels.kv_cache import store_kv_torch
from engine.kv.fp8 import FP8_DTYPE, FP8_MAX, dequantize, quantize
from engine.kv.pool import kv_bytes_per_block, kv_cache_dtype
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.test_engine import random_prompts
from tests.test_gpu import assert_tracks_float32, teacher_forced_logits, write_gpu_model
from tests.test_kernels import kv_pool, store_kv_rows
from tests.tiny_models import write_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.mark.parametrize("scale", [1.0, 0.125, 0.037, 3.0])
def test_the_round_trip_is_within_e4m3_precision_and_clamps(scale):
    x = torch.randn(4096, dtype=torch.float64) * 50 * scale
    x[:4] = torch.tensor([1e4, -1e4, 449.0, -460.0]) * scale
    stored = quantize(x, scale)
    assert stored.dtype == FP8_DTYPE
    back = dequantize(stored, scale)
    assert back.dtype == torch.float32
    assert back[:4].tolist() == pytest.approx([FP8_MAX * scale * s for s in (1, -1, 1, -1)])
    inside = x[4:].abs() <= FP8_MAX * scale
    error = (back[4:] - x[4:]).abs()[inside]
    # Half a step of 3 mantissa bits relative (normals), half of 2^-9 absolute (subnormals).
    bound = torch.maximum(x[4:].abs()[inside] * 2**-4, torch.full_like(error, 2**-10 * scale))
    assert (error <= bound * (1 + 1e-6)).all()
    # Values already on the grid come back exactly; the default scale reads unscaled.
    assert torch.equal(dequantize(quantize(back, scale), scale), back)
    assert torch.equal(dequantize(stored, 1.0), stored.float())


def test_store_kv_torch_quantizes_each_tensor_by_its_scale_and_skips_padding():
    k = torch.randn(10, 3, 16) * 40
    v = torch.randn(10, 3, 16) * 40
    k[1, 0, 0], v[2, 1, 1] = float("inf"), float("nan")  # stored finite: clamped, zero
    cache, slots = kv_pool(10, 3, 16, FP8_DTYPE, "cpu")
    expected = cache.clone()
    store_kv_rows(
        quantize(torch.nan_to_num(k), 0.5), quantize(torch.nan_to_num(v), 4.0), expected, slots
    )
    store_kv_torch(k, v, cache, slots, k_scale=0.5, v_scale=4.0)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert cache.float().isfinite().all()
    assert dequantize(cache[:, 0], 0.5).abs().max() == FP8_MAX * 0.5


def a_step(device: str = "cpu", block_size: int = 8) -> tuple[AttentionMetadata, int]:
    """Decodes (first, as the scheduler puts them), a whole prompt and a chunk behind a
    cached prefix, over scattered blocks: the metadata and the number of blocks it spans."""
    query_lens, seq_lens = [1, 1, 1, 13, 6], [5, 40, 230, 13, 130]
    tables, next_block = [], 0
    for n in seq_lens:
        count = -(-n // block_size)
        tables.append([2 * (next_block + i) + 1 for i in range(count)])  # every other block
        next_block += count
    slots = torch.zeros(sum(query_lens), dtype=torch.int64, device=device)
    meta = AttentionMetadata.from_block_tables(query_lens, seq_lens, tables, slots, block_size)
    return meta, 2 * next_block + 1


@pytest.mark.parametrize("window", [None, 7])
def test_the_torch_backend_reads_fp8_as_float32_over_kv_rounded_through_e4m3(window):
    """The same attention as a float32 pool holding the dequantized K and V: an fp8 pool
    changes what is stored, never how it is attended."""
    meta, num_blocks = a_step()
    k_scale, v_scale = 0.05, 3.0
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(num_blocks, 2, 8, 2, 32, generator=gen) * 4
    fp8 = torch.stack([quantize(kv[:, 0], k_scale), quantize(kv[:, 1], v_scale)], 1)
    rounded = torch.stack([dequantize(fp8[:, 0], k_scale), dequantize(fp8[:, 1], v_scale)], 1)
    q = torch.randn(int(meta.query_lens.sum()), 6, 32, generator=gen)
    scale = 32**-0.5
    got = TorchPagedAttention().forward(q, fp8, meta, scale, window, k_scale, v_scale)
    want = TorchPagedAttention().forward(q, rounded, meta, scale, window)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    unscaled = TorchPagedAttention().forward(q, fp8, meta, scale, window)
    assert not torch.allclose(got, unscaled, atol=1e-2)


def test_a_bad_kv_cache_dtype_is_refused_by_name():
    with pytest.raises(ValidationError) as err:
        CacheConfig(kv_cache_dtype="fp8")
    assert err.value.field == "kv_cache_dtype"


@pytest.mark.parametrize(
    ("dtype", "kv", "pool"),
    [
        ("float32", "auto", torch.float32),
        ("float32", "fp8_e4m3", FP8_DTYPE),
        ("float32", "bfloat16", torch.bfloat16),  # the torch backend reads it in float32
        ("bfloat16", "float16", torch.float16),
    ],
)
def test_the_cpu_runs_any_pool_under_any_model_dtype(dtype, kv, pool):
    config = EngineConfig(device="cpu", dtype=dtype, cache=CacheConfig(kv_cache_dtype=kv))
    assert kv_cache_dtype(config) == pool


@pytest.mark.parametrize(
    ("dtype", "kv", "capability", "pool"),
    [
        ("auto", "fp8_e4m3", (9, 0), FP8_DTYPE),
        ("auto", "fp8_e4m3", (8, 9), FP8_DTYPE),
        ("auto", "fp8_e4m3", (8, 0), None),  # A100: no e4m3
        ("auto", "bfloat16", (9, 0), torch.bfloat16),
        ("float16", "bfloat16", (9, 0), None),  # a 16-bit pool holds q's dtype there
        ("float16", "float16", (9, 0), torch.float16),
    ],
)
def test_cuda_combinations_that_cannot_run_fail_naming_the_setting(
    monkeypatch, dtype, kv, capability, pool
):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    config = EngineConfig(device="cuda", dtype=dtype, cache=CacheConfig(kv_cache_dtype=kv))
    if pool is not None:
        assert kv_cache_dtype(config) == pool
        return
    with pytest.raises(ValidationError) as err:
        kv_cache_dtype(config)
    assert err.value.field == "kv_cache_dtype"
    assert "\n" not in str(err.value)


def test_the_same_memory_holds_twice_the_blocks_of_a_16_bit_pool(tiny_llama):
    engines = {
        kv: LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory_gib=0.01, kv_cache_dtype=kv)
        for kv in ("auto", "bfloat16", "fp8_e4m3")
    }
    blocks = {kv: llm.engine.info.kv_num_blocks for kv, llm in engines.items()}
    assert blocks["auto"] == blocks["bfloat16"]
    assert blocks["fp8_e4m3"] == 2 * blocks["bfloat16"]
    fp8 = engines["fp8_e4m3"].engine
    assert fp8.runner.kv_caches[0].dtype == FP8_DTYPE
    block_bytes = kv_bytes_per_block(fp8.model_config, fp8.info.kv_block_size, FP8_DTYPE)
    assert block_bytes * blocks["fp8_e4m3"] <= 0.01 * 2**30
    # And it serves: a greedy run on the fp8 pool ends with every block back.
    llm = engines["fp8_e4m3"]
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert len(out.outputs[0].token_ids) == 8
    assert llm.engine.block_manager.num_used_blocks == 0


def test_the_setting_reaches_the_engine_from_a_flag_and_the_environment():
    from tests.test_settings import resolve

    flag = resolve(["--kv-cache-dtype", "FP8_E4M3"]).engine_config()
    env = resolve([], {"PAGEDSERVE_KV_CACHE_DTYPE": "bfloat16"}).engine_config()
    assert flag.cache.kv_cache_dtype == "fp8_e4m3"
    assert env.cache.kv_cache_dtype == "bfloat16"
    assert resolve([]).engine_config().cache.kv_cache_dtype == "auto"


def with_kv_scales(directory, scales: dict[int, tuple[float, float]]):
    """The checkpoint with self_attn.k_scale / v_scale tensors for the given layers, as
    published fp8 checkpoints carry them (0-d float32)."""
    path = directory / "model.safetensors"
    weights = load_file(path)
    for layer, (k_scale, v_scale) in scales.items():
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale)
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scale)
    save_file(weights, path, metadata={"format": "pt"})
    return directory


def test_a_checkpoints_kv_scales_reach_every_layer(tmp_path):
    directory = with_kv_scales(write_tiny_model(tmp_path, "llama"), {0: (0.5, 2.0)})
    attention = [layer.self_attn for layer in LLM(str(directory)).engine.runner.model.model.layers]
    assert [(a.k_scale, a.v_scale) for a in attention] == [(1.0, 1.0)] * len(attention)
    llm = LLM(str(directory), kv_cache_dtype="fp8_e4m3")
    attention = [layer.self_attn for layer in llm.engine.runner.model.model.layers]
    assert (attention[0].k_scale, attention[0].v_scale) == (0.5, 2.0)
    assert all((a.k_scale, a.v_scale) == (1.0, 1.0) for a in attention[1:])
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_fp8_kv_tracks_float32_kv_teacher_forced(tmp_path):
    """The GPU tests' model and method (tests/test_gpu.py) on the CPU: float32 throughout
    but for K and V, which go through e4m3 (scale 1) on their way into the pool."""
    directory = write_gpu_model(tmp_path, "qwen3")
    tokens = random_prompts(2, 400, seed=3, lo=256, hi=256)
    fp8 = teacher_forced_logits(directory, "cpu", torch.float32, tokens, kv_dtype=FP8_DTYPE)
    full = teacher_forced_logits(directory, "cpu", torch.float32, tokens)
    assert_tracks_float32(fp8, full, "fp8 KV", vocab=400)
