"""engine/kernels: the torch paths against references, the Triton kernels against the torch paths.

The torch paths (the CPU path) must equal Hugging Face's RMSNorm and rotary embedding
exactly and a row-by-row KV store bit for bit. The Triton kernels run against the torch paths on CUDA
(marked gpu) and, where triton is installed, on the CPU under Triton's interpreter: that
needs TRITON_INTERPRET=1 before triton is imported, so test_triton_kernels_in_the_interpreter
reruns this file's "interpreter" cases in a subprocess.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from engine.kernels import fused_add_rms_norm, rms_norm, rotary_and_store_kv, silu_and_mul
from engine.kernels.activation import silu_and_mul_torch
from engine.kernels.dispatch import triton_importable
from engine.kernels.kv_cache import store_kv_torch
from engine.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from engine.kernels.race import exponential_race_torch
from engine.kernels.rotary import rotary_and_store_kv_torch, rotary_qk_torch
from engine.kernels.step_inputs import step_inputs_torch
from engine.model.rope import RotaryEmbedding

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


# Where the Triton kernels run: on a GPU, or on the CPU under the interpreter (subprocess).
TRITON_TARGETS = [
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not (HAS_CUDA and triton_importable()), reason="needs CUDA"),
        ],
    ),
    pytest.param(
        "interpreter",
        marks=pytest.mark.skipif(
            not INTERPRETED, reason="run by test_triton_kernels_in_the_interpreter"
        ),
    ),
]
# The interpreter runs programs one at a time in numpy: keep its batches small.
TOKEN_COUNTS = {"cuda": [1, 7, 256, 2048], "interpreter": [1, 7, 33]}


def norm_input(layout: str, tokens: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """hidden: [T, 1024]; heads: Qwen3's q heads, a strided view into the merged qkv output;
    odd: a dim that is no power of two, transposed (the CPU linear's output layout)."""
    if layout == "hidden":
        return 3 * torch.randn(tokens, 1024, dtype=dtype, device=device)
    if layout == "heads":
        qkv = 3 * torch.randn(tokens, (16 + 2 * 8) * 128, dtype=dtype, device=device)
        return qkv[:, : 16 * 128].view(tokens, 16, 128)
    return 3 * torch.randn(96, tokens, dtype=dtype, device=device).T


def norm_weight(dim: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(dim, device=device)).to(dtype)


def gate_up_input(tokens: int, inter: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return 3 * torch.randn(tokens, 2 * inter, dtype=dtype, device=device)


def kv_pool(
    tokens: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool holding a sentinel (7.0) with room for twice the rows, and a slot mapping that
    scatters the rows over it with every third row padding (-1)."""
    block_size = 16
    num_blocks = max(8, 2 * -(-tokens // block_size))
    cache = torch.full(
        (num_blocks, 2, block_size, num_kv_heads, head_dim), 7.0, dtype=cache_dtype, device=device
    )
    slots = torch.randperm(num_blocks * block_size, device=device)[:tokens]
    slots[::3] = -1
    return cache, slots


def kv_inputs(
    tokens: int, dtype: torch.dtype, cache_dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """k (a strided view into a merged kv tensor), v, and kv_pool's pool and slot mapping."""
    heads, dim = 8, 128
    kv = torch.randn(tokens, 2 * heads * dim, dtype=dtype, device=device)
    k = kv[:, : heads * dim].view(tokens, heads, dim)
    v = kv[:, heads * dim :].reshape(tokens, heads, dim).contiguous()
    return k, v, *kv_pool(tokens, heads, dim, cache_dtype, device)


# (q heads, kv heads, head dim): Qwen3-0.6B's GQA, and SmolLM2's head counts (no powers of two).
ROTARY_SHAPES = [(16, 8, 128), (9, 3, 64)]
# (q dtype, pool dtype) pairs the fused rotary + KV store is checked with.
ROTARY_POOL_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.bfloat16),
    (torch.float16, torch.float32),
]


def qkv_inputs(
    tokens: int, heads: tuple[int, int, int], dtype: torch.dtype, device: str, layout: str = "qkv"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v, cos, sin as the model has them: q, k and v strided views into the merged qkv
    projection's output ("transposed": the CPU linear's layout), cos / sin of random positions."""
    num_heads, num_kv_heads, head_dim = heads
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if layout == "qkv":
        qkv = 3 * torch.randn(tokens, width, dtype=dtype, device=device)
    else:
        qkv = 3 * torch.randn(width, tokens, dtype=dtype, device=device).T
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1
    )
    q = q.view(tokens, num_heads, head_dim)
    k = k.view(tokens, num_kv_heads, head_dim)
    v = v.view(tokens, num_kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 1e6, None).to(device)
    cos, sin = rope(torch.randint(4096, (tokens,), device=device))
    return q, k, v, cos, sin


def race_inputs(
    rows: int, vocab: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits, temperature, is_greedy, seeds, counters of a batch mixing greedy (odd) and
    sampled rows, with greedy ties (first index wins), coarse logits and a filtered row."""
    logits = 3 * torch.randn(rows, vocab, device=device)
    logits[0, 100:] = float("-inf")  # sampled, filtered: only the first 100 may win
    logits[1, [7, vocab - 1]] = logits[1].max() + 1  # greedy, tied between 7 and the last
    logits[2:4] = torch.randint(0, 3, (2, vocab), device=device).float()  # many ties at the top
    logits[5] = 0.0  # greedy over a flat row: 0
    is_greedy = torch.arange(rows, device=device) % 2 == 1
    temperature = torch.tensor([0.3, 0.7, 1.0, 1.7], device=device).repeat(rows)[:rows]
    temperature = temperature.masked_fill(is_greedy, 1.0)  # as SamplingRows holds it
    seeds = torch.randint(-(2**62), 2**62, (rows,), device=device)
    counters = torch.randint(0, 1000, (rows,), device=device)
    return logits.to(dtype), temperature, is_greedy, seeds, counters


def tolerance(dtype: torch.dtype, target: str = "cuda") -> dict[str, float]:
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    if dtype == torch.float16:
        return {"rtol": 2e-3, "atol": 1e-3}
    # Triton 3.6's interpreter rounds float32 -> bfloat16 toward zero, the GPU to nearest:
    # another ulp (2^-8 relative) at most, for each of the kernel's two roundings.
    # On the GPU, two roundings of bf16 (ulp 2^-7 relative) can land 2 ulps apart: torch's own
    # bf16 default, 1.6e-2.
    return {"rtol": 2e-2 if target == "interpreter" else 1.6e-2, "atol": 1e-3}


def rotary_tolerance(dtype: torch.dtype, target: str = "cuda") -> dict[str, float]:
    """The kernel rounds where the torch path does, but a normed input one ulp off (its
    rsqrt, the interpreter's bf16 rounding) rotates into an output one ulp *of the input*
    off, however small the output: an absolute tolerance at the normed inputs' size (< 8)."""
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    eps = torch.finfo(dtype).eps
    return {"rtol": tolerance(dtype, target)["rtol"], "atol": 16 * eps}


def assert_pools_close(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, target: str = "cuda"
) -> None:
    """Pools written by the fused op from q/k/v of `dtype`: the same slots written (the
    others keep the sentinel 7.0), V exactly, rotated K as close as rotary_tolerance allows
    in the coarser of the rotation's and the pool's dtype (two values an fp16 ulp apart
    can round to bf16 a bf16 ulp apart)."""
    assert got.dtype == want.dtype
    untouched = (got == 7.0).all(dim=(-2, -1))  # [blocks, 2, block_size]
    assert torch.equal(untouched, (want == 7.0).all(dim=(-2, -1)))
    if target == "interpreter" and got.dtype == torch.bfloat16 != dtype:
        # The interpreter rounds to bf16 toward zero (see tolerance): V one ulp off.
        torch.testing.assert_close(got[:, 1], want[:, 1], **tolerance(got.dtype, target))
    else:
        assert torch.equal(got[:, 1], want[:, 1])
    coarser = max(dtype, got.dtype, key=lambda d: torch.finfo(d).eps)
    torch.testing.assert_close(got[:, 0], want[:, 0], **rotary_tolerance(coarser, target))


def store_kv_rows(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The reference: one row at a time, skipping slot -1."""
    block_size = kv_cache.shape[2]
    for row, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            kv_cache[slot // block_size, 0, slot % block_size] = k[row]
            kv_cache[slot // block_size, 1, slot % block_size] = v[row]


# --- the torch paths (what the CPU runs) ---------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["hidden", "heads", "odd"])
def test_rms_norm_equals_hugging_face(layout: str, dtype: torch.dtype) -> None:
    x = norm_input(layout, 9, dtype, "cpu")
    hf = LlamaRMSNorm(x.shape[-1], eps=EPS)
    hf.weight.data = norm_weight(x.shape[-1], dtype, "cpu")
    assert torch.equal(rms_norm(x, hf.weight.data, EPS), hf(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["hidden", "odd"])
def test_fused_add_rms_norm_equals_add_then_hugging_face(layout: str, dtype: torch.dtype) -> None:
    x = norm_input(layout, 9, dtype, "cpu")
    residual = norm_input(layout, 9, dtype, "cpu")
    x_before, residual_before = x.clone(), residual.clone()
    hf = LlamaRMSNorm(x.shape[-1], eps=EPS)
    hf.weight.data = norm_weight(x.shape[-1], dtype, "cpu")

    out, new_residual = fused_add_rms_norm(x, residual, hf.weight.data, EPS)
    assert torch.equal(new_residual, residual_before + x_before)
    assert torch.equal(out, hf(residual_before + x_before))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # not in place


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_float64(dtype: torch.dtype) -> None:
    weight = torch.randn(2 * 80, 64, dtype=dtype)
    hidden = torch.randn(9, 64, dtype=dtype)
    gate_up = (weight @ hidden.T).T  # transposed, as the CPU linear returns it for 2-4 rows
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = gate * torch.sigmoid(gate) * up
    out = silu_and_mul(gate_up)
    assert out.shape == (9, 80) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **tolerance(dtype))


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
)
def test_store_kv_torch_equals_row_by_row_and_skips_padding(
    dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    k, v, cache, slots = kv_inputs(10, dtype, cache_dtype, "cpu")
    expected = cache.clone()
    store_kv_rows(k, v, expected, slots)
    store_kv_torch(k, v, cache, slots)
    assert torch.equal(cache, expected)
    written = cache.shape[0] * cache.shape[2] - (cache == 7.0).all(dim=(1, 3, 4)).sum()
    assert written == 6  # rows 1, 2, 4, 5, 7, 8; 0, 3, 6 and 9 are padding


@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("heads", ROTARY_SHAPES)
def test_rotary_and_store_kv_equals_hugging_face(heads: tuple[int, int, int], normed: bool) -> None:
    """float32, where Hugging Face rotates in float32 too (in bf16 it rotates in bf16): q
    comes back rotated, the rotated k and v land in the pool row by row, padding nowhere."""
    num_heads, num_kv_heads, head_dim = heads
    q, k, v, cos, sin = qkv_inputs(9, heads, torch.float32, "cpu", layout="transposed")
    cache, slots = kv_pool(9, num_kv_heads, head_dim, torch.float32, "cpu")
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()
    q_hf, k_hf = LlamaRMSNorm(head_dim, eps=EPS), LlamaRMSNorm(head_dim, eps=EPS)
    q_hf.weight.data = norm_weight(head_dim, torch.float32, "cpu")
    k_hf.weight.data = norm_weight(head_dim, torch.float32, "cpu")
    weights = (q_hf.weight.data, k_hf.weight.data) if normed else (None, None)
    expected = cache.clone()

    got_q = rotary_and_store_kv(q, k, v, cos, sin, cache, slots, *weights, EPS)
    assert all(torch.equal(a, b) for a, b in [(q, q_before), (k, k_before), (v, v_before)])
    if normed:
        q, k = q_hf(q), k_hf(k)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos.repeat(1, 2), sin.repeat(1, 2))
    store_kv_rows(want_k, v, expected, slots)
    assert torch.equal(got_q, want_q) and torch.equal(cache, expected)


@pytest.mark.parametrize("dtype, cache_dtype", ROTARY_POOL_DTYPES)
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("heads", ROTARY_SHAPES)
def test_rotary_and_store_kv_equals_rotary_then_store(
    heads: tuple[int, int, int], normed: bool, dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """The CPU path in the model's dtypes: the same numbers as rotating, then storing the
    rotated k (cast to the pool's dtype) and v row by row."""
    q, k, v, cos, sin = qkv_inputs(10, heads, dtype, "cpu", layout="transposed")
    cache, slots = kv_pool(10, heads[1], heads[2], cache_dtype, "cpu")
    weights = [norm_weight(heads[2], dtype, "cpu") for _ in range(2)] if normed else []
    expected = cache.clone()

    got_q = rotary_and_store_kv(q, k, v, cos, sin, cache, slots, *(weights or [None, None]), EPS)
    want_q, want_k = rotary_qk_torch(q, k, cos, sin, *(weights or [None, None]), EPS)
    store_kv_rows(want_k.to(cache_dtype), v.to(cache_dtype), expected, slots)
    assert got_q.dtype == dtype and torch.equal(got_q, want_q)
    assert torch.equal(cache, expected)


# --- the Triton kernels against the torch paths ---------------------------------------


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["hidden", "heads", "odd"])
def test_triton_rms_norm(target: str, layout: str, dtype: torch.dtype) -> None:
    from engine.kernels import triton_kernels

    device = "cuda" if target == "cuda" else "cpu"
    for tokens in TOKEN_COUNTS[target]:
        x = norm_input(layout, tokens, dtype, device)
        weight = norm_weight(x.shape[-1], dtype, device)
        out = triton_kernels.rms_norm(x, weight, EPS)
        assert out.shape == x.shape and out.dtype == dtype
        torch.testing.assert_close(out, rms_norm_torch(x, weight, EPS), **tolerance(dtype, target))


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["hidden", "heads", "odd"])
def test_triton_fused_add_rms_norm(target: str, layout: str, dtype: torch.dtype) -> None:
    from engine.kernels import triton_kernels

    device = "cuda" if target == "cuda" else "cpu"
    for tokens in TOKEN_COUNTS[target]:
        x = norm_input(layout, tokens, dtype, device)
        residual = norm_input(layout, tokens, dtype, device)
        weight = norm_weight(x.shape[-1], dtype, device)
        out, new_residual = triton_kernels.fused_add_rms_norm(x, residual, weight, EPS)
        expected_residual = fused_add_rms_norm_torch(x, residual, weight, EPS)[1]
        if dtype == torch.bfloat16 and target == "interpreter":  # rounds toward zero, see above
            torch.testing.assert_close(new_residual, expected_residual, **tolerance(dtype, target))
        else:  # one rounding of the same sum: the stream must not drift from the torch path
            assert torch.equal(new_residual, expected_residual)
        expected = rms_norm_torch(new_residual, weight, EPS)
        torch.testing.assert_close(out, expected, **tolerance(dtype, target))


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [3072, 80])
def test_triton_silu_and_mul(target: str, inter: int, dtype: torch.dtype) -> None:
    from engine.kernels import triton_kernels

    device = "cuda" if target == "cuda" else "cpu"
    for tokens in TOKEN_COUNTS[target]:
        gate_up = gate_up_input(tokens, inter, dtype, device)
        out = triton_kernels.silu_and_mul(gate_up)
        assert out.shape == (tokens, inter) and out.dtype == dtype
        torch.testing.assert_close(out, silu_and_mul_torch(gate_up), **tolerance(dtype, target))


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("dtype, cache_dtype", ROTARY_POOL_DTYPES)
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("heads", ROTARY_SHAPES)
def test_triton_rotary_and_store_kv(
    target: str,
    heads: tuple[int, int, int],
    normed: bool,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
) -> None:
    from engine.kernels import triton_kernels

    device = "cuda" if target == "cuda" else "cpu"
    cases = [(tokens, "qkv") for tokens in TOKEN_COUNTS[target]] + [(5, "transposed")]
    for tokens, layout in cases:
        q, k, v, cos, sin = qkv_inputs(tokens, heads, dtype, device, layout)
        cache, slots = kv_pool(tokens, heads[1], heads[2], cache_dtype, device)
        weights = [norm_weight(heads[2], dtype, device) for _ in range(2)] if normed else []
        norm = (*(weights or [None, None]), EPS)
        expected = cache.clone()
        want = rotary_and_store_kv_torch(q, k, v, cos, sin, expected, slots, *norm)
        got = triton_kernels.rotary_and_store_kv(q, k, v, cos, sin, cache, slots, *norm)
        assert got.shape == want.shape and got.dtype == want.dtype == dtype
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, **rotary_tolerance(dtype, target))
        assert_pools_close(cache, expected, dtype, target)


def e4m3_grid_inputs(
    tokens: int, heads: tuple[int, int, int], dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, ...]:
    """q, k, v, cos, sin whose rotation leaves k alone (cos 1, sin 0) and whose k and v are
    e4m3 values, some past +-448: stored under power-of-two scales they need no rounding,
    so the kernel's store must equal the torch path's bit for bit."""
    q, k, v, cos, sin = qkv_inputs(tokens, heads, dtype, device)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].to(device)
    for x in (k, v):
        picks = torch.randint(len(grid), x.shape, device=device)
        x.copy_(grid[picks])
        x[1, 0, :4] = torch.tensor([1000.0, -1000.0, 449.0, -460.0])  # row 1 is stored: clamped
    return q, k, v, torch.ones_like(cos), torch.zeros_like(sin)


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_rotary_stores_an_fp8_pool_as_the_torch_path(target: str, dtype) -> None:
    """Each scale divides its own tensor, values are clamped to +-448 and the padding
    rows go nowhere. On e4m3 values the store is exact (Triton's interpreter rounds other
    values to fp8 wrongly, so rounding itself is checked on the GPU: to nearest, as torch,
    and at most one e4m3 step from it where float32 division differs)."""
    from engine.kernels import triton_kernels

    device = "cuda" if target == "cuda" else "cpu"
    heads = (9, 3, 64)
    for k_scale, v_scale in ((1.0, 1.0), (0.25, 4.0)):
        q, k, v, cos, sin = e4m3_grid_inputs(7, heads, dtype, device)
        k *= k_scale
        v *= v_scale
        cache, slots = kv_pool(7, heads[1], heads[2], torch.float8_e4m3fn, device)
        expected = cache.clone()
        args = (None, None, EPS, k_scale, v_scale)
        want = rotary_and_store_kv_torch(q, k, v, cos, sin, expected, slots, *args)
        got = triton_kernels.rotary_and_store_kv(q, k, v, cos, sin, cache, slots, *args)
        torch.testing.assert_close(got, want, **rotary_tolerance(dtype, target))
        assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
        block, offset = divmod(int(slots[1]), cache.shape[2])
        for kv in (0, 1):
            assert cache[block, kv, offset, 0, :4].float().tolist() == [448, -448, 448, -448]
    if target != "cuda":
        return
    q, k, v, cos, sin = qkv_inputs(256, heads, dtype, device)
    cache, slots = kv_pool(256, heads[1], heads[2], torch.float8_e4m3fn, device)
    expected = cache.clone()
    args = (None, None, EPS, 0.3, 1.7)
    rotary_and_store_kv_torch(q, k, v, cos, sin, expected, slots, *args)
    triton_kernels.rotary_and_store_kv(q, k, v, cos, sin, cache, slots, *args)
    differ = cache.view(torch.uint8) != expected.view(torch.uint8)
    assert differ.float().mean() < 1e-3
    torch.testing.assert_close(cache.float(), expected.float(), rtol=0.125, atol=2**-9)


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_exponential_race_picks_what_the_torch_race_picks(
    target: str, dtype: torch.dtype
) -> None:
    """Same noise bit for bit, raced in log space: the same winners as softmax(x) / E, and
    greedy rows' argmax with torch's tie rule, from logits in their own dtype, tempered in
    the kernel or already scaled (temperature None, the filtered path)."""
    from engine.kernels import triton_kernels

    device = "cuda" if target == "cuda" else "cpu"
    shapes = [(64, 151936), (256, 32000)] if target == "cuda" else [(8, 3001), (6, 100)]
    for rows, vocab in shapes:
        logits, temperature, is_greedy, seeds, counters = race_inputs(rows, vocab, dtype, device)
        for scale in (temperature, None):
            want = exponential_race_torch(logits, scale, is_greedy, seeds, counters)
            got = triton_kernels.exponential_race(logits, scale, is_greedy, seeds, counters)
            assert got.dtype == torch.int64 and torch.equal(got, want)
            assert got[0] < 100 and got[1] == 7 and got[5] == 0
            assert torch.equal(got[1::2], logits[1::2].argmax(dim=-1))


def random_bitmask(rows: int, vocab: int, device: str) -> torch.Tensor:
    """int32 [rows, ceil(vocab / 32)] token masks: row 0 allows one token (63, the sign bit
    of its word), row 1 (greedy) hides its argmax, the others allow about half."""
    allowed = torch.rand(rows, vocab) < 0.5
    allowed[0] = False
    allowed[0, 63] = True  # race_inputs' row 0 may only pick among its first 100
    allowed[1, 7] = allowed[1, vocab - 1] = False  # race_inputs' tied maximum of row 1
    padded = torch.zeros(rows, -(-vocab // 32) * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    weights = 2 ** torch.arange(32, dtype=torch.int64)
    words = (padded.view(rows, -1, 32) * weights).sum(-1)
    return words.to(torch.int32).to(device)  # two's complement: bit 31 is the sign bit


@pytest.mark.parametrize("target", TRITON_TARGETS)
def test_the_race_under_token_masks_picks_allowed_tokens_as_the_torch_race(target: str) -> None:
    """A token mask applied inside the Triton race: every pick is an allowed token (a row
    allowing one gets it, a greedy row whose argmax is masked takes the best allowed one),
    and the winners are the torch race's, split or not."""
    from engine.kernels import triton_kernels
    from engine.kernels.race import unpack_bitmask

    device = "cuda" if target == "cuda" else "cpu"
    for rows, vocab, blocks_per_split in [(8, 3001, None), (6, 600, 1)]:
        race = race_inputs(rows, vocab, torch.float32, device)
        allowed = random_bitmask(rows, vocab, device)
        want = exponential_race_torch(*race, allowed)
        if blocks_per_split is None:
            got = triton_kernels.exponential_race(*race, allowed)
        else:
            got = triton_kernels.split_exponential_race(*race, blocks_per_split, 64, allowed)
        assert torch.equal(got, want), (got, want)
        assert unpack_bitmask(allowed, vocab)[torch.arange(rows), got].all()
        assert got[0] == 63
        masked = race[0][1].masked_fill(~unpack_bitmask(allowed, vocab)[1], float("-inf"))
        assert got[1] == masked.argmax()


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
def test_the_race_splits_a_row_over_the_gpu_at_small_batch_only() -> None:
    """The split count: ~4 programs per SM of an H200 in all, from shapes alone; one block a
    program at most, no empty split, and no split at all once the rows fill the GPU."""
    import triton

    from engine.kernels.triton_kernels import race_blocks_per_split

    def num_splits(rows: int, vocab: int) -> tuple[int, int]:
        blocks_per_split = race_blocks_per_split(rows, vocab, 132, 2048)
        return triton.cdiv(triton.cdiv(vocab, 2048), blocks_per_split), blocks_per_split

    qwen3 = [num_splits(rows, 151936)[0] for rows in (1, 8, 64, 256, 528, 4096)]
    assert qwen3 == [75, 38, 8, 2, 1, 1]
    for rows in (1, 2, 3, 7, 100, 1000):
        for vocab in (1, 100, 2049, 151936, 262144, 10**6):
            splits, blocks_per_split = num_splits(rows, vocab)
            assert 1 <= splits <= 128
            assert (splits - 1) * blocks_per_split * 2048 < vocab  # the last split is not empty
            assert rows * splits <= max(rows, 4 * 132)


def tie_across(logits: torch.Tensor, row: int, columns: list[int]) -> int:
    """Ties row's maximum at columns (clamped to the vocab); returns the first of them."""
    columns = [min(c, logits.shape[1] - 1) for c in columns]
    logits[row, columns] = logits[row].max() + 1
    return min(columns)


# (blocks of 64 columns per split, dtype): 600 columns in 10 splits, or in 4 (the last: 24).
SPLIT_RACES = [(1, torch.float32), (3, torch.bfloat16)]


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("blocks_per_split, dtype", SPLIT_RACES)
def test_triton_exponential_race_reduces_split_rows_as_the_torch_race(
    target: str, blocks_per_split: int, dtype: torch.dtype
) -> None:
    """Rows raced in several slices of their vocab (the last one shorter), then reduced: the
    torch race's winners on sampled and greedy rows, in a batch of 12 rows and of 1, and
    ties across split boundaries going to the first index."""
    from engine.kernels import triton_kernels

    device = "cuda" if target == "cuda" else "cpu"
    block, vocab = 64, 600
    span = blocks_per_split * block  # one split's columns
    logits, temperature, is_greedy, seeds, counters = race_inputs(12, vocab, torch.float32, device)
    ties = {  # greedy rows: the last column of a split and the first of the next, ...
        7: tie_across(logits, 7, [span - 1, span]),
        9: tie_across(logits, 9, [2 * span, span, vocab - 1]),  # ... or of later splits only
        11: tie_across(logits, 11, [vocab - 1, vocab - 2]),  # within the last split
    }
    logits = logits.to(dtype)
    for scale in (temperature, None):
        for rows in (slice(0, 12), slice(0, 1), slice(7, 8)):  # 1 row: sampled, greedy
            race = (logits[rows], None if scale is None else scale[rows])
            race += (is_greedy[rows], seeds[rows], counters[rows])
            want = exponential_race_torch(*race)
            got = triton_kernels.split_exponential_race(*race, blocks_per_split, block)
            assert got.dtype == torch.int64 and torch.equal(got, want), (rows, got, want)
            if rows.stop == 12:
                assert all(got[row] == first for row, first in ties.items())
                assert torch.equal(got[1::2], logits[1::2].argmax(dim=-1))
    # The public launcher, one row of a vocab it splits in 5 (the last slice shorter).
    race = race_inputs(6, 10000, dtype, device)
    for row in (0, 1):  # sampled (filtered to its first 100 columns), greedy (tied)
        one = tuple(tensor[row : row + 1] for tensor in race)
        got = triton_kernels.exponential_race(*one)
        assert torch.equal(got, exponential_race_torch(*one))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and triton_importable()), reason="needs CUDA")
def test_the_ops_capture_in_a_cuda_graph() -> None:
    """A decode step's worth of the ops, captured once and replayed on new inputs; padding
    rows (slot -1) write nothing. The torch KV store syncs with the host and cannot be
    captured, so this also shows that CUDA tensors take the Triton path."""
    from engine.kernels.race import exponential_race

    tokens, dtype = 8, torch.bfloat16
    num_heads, num_kv_heads, head_dim = ROTARY_SHAPES[0]
    x, residual = (norm_input("hidden", tokens, dtype, "cuda") for _ in range(2))
    weight = norm_weight(1024, dtype, "cuda")
    gate_up = gate_up_input(tokens, 3072, dtype, "cuda")
    q, k, v, cos, sin = qkv_inputs(tokens, ROTARY_SHAPES[0], dtype, "cuda")
    cache, slots = kv_pool(tokens, num_kv_heads, head_dim, dtype, "cuda")
    head_weights = [norm_weight(head_dim, dtype, "cuda") for _ in range(2)]
    race = race_inputs(tokens, 151936, dtype, "cuda")

    def step() -> tuple[torch.Tensor, ...]:
        return (
            *fused_add_rms_norm(x, residual, weight, EPS),
            silu_and_mul(gate_up),
            rotary_and_store_kv(q, k, v, cos, sin, cache, slots, *head_weights, EPS),
            exponential_race(*race),
        )

    side = torch.cuda.Stream()  # warm up (compile) off the default stream, as torch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()

    for tensor in (x, residual, gate_up, q, k, v, race[0]):  # q, k, v: views of one qkv
        tensor.copy_(torch.randn_like(tensor))
    race[3].copy_(torch.randint_like(race[3], 2**40))  # new seeds
    slots.copy_(torch.randperm(cache.shape[0] * cache.shape[2], device="cuda")[:tokens])
    slots[1::2] = -1
    cache.fill_(7.0)
    expected_cache = cache.clone()
    expected_q = rotary_and_store_kv_torch(
        q, k, v, cos, sin, expected_cache, slots, *head_weights, EPS
    )
    graph.replay()
    torch.cuda.synchronize()

    assert_pools_close(cache, expected_cache, dtype)
    out, new_residual, act, q_out, token_ids = outputs
    expected, expected_residual = fused_add_rms_norm_torch(x, residual, weight, EPS)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    torch.testing.assert_close(act, silu_and_mul_torch(gate_up), **tolerance(dtype))
    torch.testing.assert_close(q_out, expected_q, **rotary_tolerance(dtype))
    assert torch.equal(token_ids, exponential_race_torch(*race))


def rerun_interpreter_cases(test_file: str) -> None:
    """Run a test file's "interpreter" cases in a subprocess with TRITON_INTERPRET=1 (it
    must be set before triton is imported), and require that some ran and all passed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    result = subprocess.run(
        [*command, "-k", "interpreter"], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\b\d+ passed", result.stdout), result.stdout  # ran, not all skipped


@pytest.mark.parametrize("target", TRITON_TARGETS)
def test_triton_step_inputs_read_the_tables_as_the_torch_path(target: str) -> None:
    from engine.kernels import triton_kernels

    device = "cuda" if target == "cuda" else "cpu"
    slots, token_width, block_width, block_size = 5, 40, 6, 8
    tokens = torch.randint(0, 1000, (slots + 1, token_width), dtype=torch.int32, device=device)
    blocks = torch.randint(0, 50, (slots + 1, block_width), dtype=torch.int32, device=device)
    blocks[slots] = 0  # the padding row
    for rows in TOKEN_COUNTS[target]:
        row_slots = torch.randint(0, slots + 1, (rows,), device=device)  # padding rows too
        positions = torch.randint(0, token_width, (rows,), device=device)
        want = step_inputs_torch(row_slots, positions, tokens, blocks, block_size, slots)
        got = triton_kernels.step_inputs(row_slots, positions, tokens, blocks, block_size, slots)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        assert (got[1][row_slots == slots] == -1).all()


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_triton_kernels_in_the_interpreter() -> None:
    rerun_interpreter_cases(__file__)


def e4m3_rows(rows: int, cols: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Rows of e4m3 values times a power of two each, one value of each row at +-448 times
    it: each row's scale is that power of two, every quotient an e4m3 value."""
    codes = torch.randint(0, 256, (rows, cols), dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3fn's NaNs
    values = codes.view(torch.float8_e4m3fn).float()
    values[:, 0] = 448.0 * torch.where(torch.rand(rows) < 0.5, -1.0, 1.0)
    powers = 2.0 ** torch.randint(-4, 5, (rows, 1)).float()
    return (values * powers).to(dtype).to(device)


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_quantize_rows_is_the_torch_path(target: str, dtype: torch.dtype) -> None:
    """On rows whose quotients are e4m3 values, exactly the torch path (Triton's interpreter
    rounds other values to fp8 wrongly); on the GPU, random rows too: the same scales, each
    value the torch path's or, where float32 division tipped a quotient over a rounding
    boundary, one e4m3 step from it."""
    from engine.kernels import triton_kernels
    from engine.kernels.fp8_linear import _MIN_AMAX, FP8, FP8_MAX, quantize_rows_torch

    device = "cuda" if target == "cuda" else "cpu"
    for rows in TOKEN_COUNTS[target]:
        for cols in (64, 1000, 4608):  # one block, a masked one, several blocks
            inputs = [e4m3_rows(rows, cols, dtype, device)]
            if target == "cuda":
                inputs.append((3 * torch.randn(rows, cols, device=device)).to(dtype))
            for exact, x in zip((True, False), inputs):
                x[-1] = 0  # an all-zero row: a finite scale, zeros
                got_q, got_scale = triton_kernels.quantize_rows(x, FP8, FP8_MAX, _MIN_AMAX)
                want_q, want_scale = quantize_rows_torch(x)
                assert got_q.dtype == FP8 and got_scale.shape == (rows, 1)
                torch.testing.assert_close(got_scale, want_scale, rtol=1e-6, atol=0)
                got, want = got_q.float(), want_q.float()
                if exact:
                    assert torch.equal(got, want)
                else:
                    torch.testing.assert_close(got, want, rtol=2**-3, atol=2**-9)
                    assert (got != want).float().mean() < 1e-3
                assert not got[-1].any()
