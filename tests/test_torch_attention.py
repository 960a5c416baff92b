"""TorchPagedAttention against dense attention computed from scratch (float64, explicit
softmax) on contiguous K/V, for random mixes of decodes, prefills and prefill chunks.
Each step first stores its new K/V the way the CPU model does (store_kv_torch), then
attends: the layer's CPU path, write included."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_backend import DECODE_GROUP_SIZE, TorchPagedAttention
from engine.kernels.kv_cache import store_kv_torch


@dataclass
class SeqCase:
    cached: int  # tokens already in the cache before this step
    new: int  # tokens this step adds (1 = decode)


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    full_k: list[torch.Tensor]  # per sequence, every position's K after the step
    full_v: list[torch.Tensor]


def make_batch(
    cases: list[SeqCase],
    num_q_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    head_dim: int = 16,
    num_blocks: int = 64,
) -> Batch:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(dtype)

    # Stale values everywhere: the backend must only ever read what the tables point at.
    kv_cache = randn(num_blocks, 2, block_size, num_kv_heads, head_dim)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables, full_k, full_v, slots = [], [], [], []
    for case in cases:
        length = case.cached + case.new
        table = [free.pop() for _ in range(math.ceil(length / block_size))]
        k, v = randn(length, num_kv_heads, head_dim), randn(length, num_kv_heads, head_dim)
        for pos in range(length):
            block, offset = table[pos // block_size], pos % block_size
            if pos < case.cached:  # the prefix is already in the cache
                kv_cache[block, 0, offset] = k[pos]
                kv_cache[block, 1, offset] = v[pos]
            else:
                slots.append(block * block_size + offset)
        tables.append(table)
        full_k.append(k)
        full_v.append(v)

    query_lens = [c.new for c in cases]
    seq_lens = [c.cached + c.new for c in cases]
    meta = AttentionMetadata.from_block_tables(
        query_lens, seq_lens, tables, torch.tensor(slots, dtype=torch.int64), block_size
    )
    new_k = torch.cat([k[c.cached :] for k, c in zip(full_k, cases, strict=True)])
    new_v = torch.cat([v[c.cached :] for v, c in zip(full_v, cases, strict=True)])
    q = randn(sum(query_lens), num_q_heads, head_dim)
    return Batch(q, new_k, new_v, kv_cache, meta, full_k, full_v)


def store_and_attend(batch: Batch, scale: float, window: int | None = None) -> torch.Tensor:
    """A layer's CPU path: the new rows' K/V into the pool, then the backend over the pool."""
    store_kv_torch(batch.k, batch.v, batch.kv_cache, batch.meta.slot_mapping)
    return TorchPagedAttention().forward(batch.q, batch.kv_cache, batch.meta, scale, window)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """q [n, Hq, D] are the last n positions of a sequence whose keys/values are k, v [L, Hkv, D];
    with a window, position p sees keys p - window + 1 to p."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # q head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    n, length = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    query_pos = torch.arange(length - n, length)[:, None]
    distance = query_pos - torch.arange(length)[None, :]
    hidden = (distance < 0) | (distance >= (length if window is None else window))
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def expected_output(batch: Batch, scale: float, window: int | None = None) -> torch.Tensor:
    outputs, start = [], 0
    for k, v, n in zip(batch.full_k, batch.full_v, batch.meta.query_lens.tolist(), strict=True):
        outputs.append(dense_attention(batch.q[start : start + n], k, v, scale, window))
        start += n
    return torch.cat(outputs)


def random_cases(rng: random.Random) -> list[SeqCase]:
    cases = []
    for _ in range(rng.randint(1, 6)):
        kind = rng.choice(["decode", "prefill", "chunk"])
        if kind == "decode":
            cases.append(SeqCase(cached=rng.randint(0, 50), new=1))
        elif kind == "prefill":
            cases.append(SeqCase(cached=0, new=rng.randint(1, 40)))
        else:
            cases.append(SeqCase(cached=rng.randint(1, 40), new=rng.randint(2, 20)))
    return cases


HEADS = [(4, 4), (8, 2), (6, 1)]  # (q heads, kv heads): MHA, GQA, MQA
SCALE = 0.25


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("seed", range(4))
def test_random_mixed_batches_fp32(seed, block_size, num_q_heads, num_kv_heads):
    cases = random_cases(random.Random(seed))
    batch = make_batch(cases, num_q_heads, num_kv_heads, block_size, torch.float32, seed)
    out = store_and_attend(batch, SCALE)
    assert out.shape == batch.q.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected_output(batch, SCALE), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("window", [1, 7, 16])
@pytest.mark.parametrize("seed", range(3))
def test_sliding_window_sees_only_the_last_window_keys(seed, window, num_q_heads, num_kv_heads):
    """Decodes, whole prompts and chunks, shorter and longer than the window, in one step."""
    cases = random_cases(random.Random(200 + seed)) + [SeqCase(0, 30), SeqCase(20, 1)]
    batch = make_batch(cases, num_q_heads, num_kv_heads, 5, torch.float32, seed)
    out = store_and_attend(batch, SCALE, window)
    expected = expected_output(batch, SCALE, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("seed", range(3))
def test_random_mixed_batches_bf16(seed, num_q_heads, num_kv_heads):
    cases = random_cases(random.Random(100 + seed))
    batch = make_batch(cases, num_q_heads, num_kv_heads, 16, torch.bfloat16, seed)
    out = store_and_attend(batch, SCALE)
    assert out.dtype == torch.bfloat16
    # The reference sees the same bf16 inputs; what remains is the bf16 rounding of the output.
    torch.testing.assert_close(out.double(), expected_output(batch, SCALE), rtol=2e-2, atol=2e-2)


def test_new_rows_are_written_to_their_slots():
    cases = [SeqCase(cached=3, new=1), SeqCase(cached=0, new=20), SeqCase(cached=17, new=6)]
    batch = make_batch(cases, 4, 2, 16, torch.float32, seed=7)
    store_and_attend(batch, SCALE)
    blocks = batch.meta.slot_mapping // 16
    offsets = batch.meta.slot_mapping % 16
    assert torch.equal(batch.kv_cache[blocks, 0, offsets], batch.k)
    assert torch.equal(batch.kv_cache[blocks, 1, offsets], batch.v)


def test_slot_minus_one_writes_nothing():
    cases = [SeqCase(cached=5, new=1), SeqCase(cached=0, new=9), SeqCase(cached=20, new=1)]
    batch = make_batch(cases, 4, 2, 16, torch.float32, seed=3)
    # Row 0 is padding: its k/v must go nowhere. Its own output is garbage by definition.
    real_slot = int(batch.meta.slot_mapping[0])
    batch.meta.slot_mapping[0] = -1
    before = batch.kv_cache.clone()
    out = store_and_attend(batch, SCALE)

    written = batch.meta.slot_mapping[1:]
    changed = (batch.kv_cache != before).any(dim=(1, 3, 4)).flatten().nonzero().flatten()
    assert set(changed.tolist()) <= set(written.tolist())
    block, offset = divmod(real_slot, 16)
    assert torch.equal(batch.kv_cache[block, :, offset], before[block, :, offset])
    # Every other row is exact.
    torch.testing.assert_close(
        out[1:].double(), expected_output(batch, SCALE)[1:], rtol=1e-5, atol=1e-5
    )


def test_non_finite_kv_never_reaches_the_pool_or_batch_mates():
    """Stale slots are masked, not cleared, so the pool must only ever hold finite values:
    a sequence whose new k/v overflow to inf or nan cannot poison its batch-mates."""
    cases = [SeqCase(cached=2, new=1), SeqCase(cached=30, new=1), SeqCase(cached=4, new=5)]
    batch = make_batch(cases, 8, 2, 16, torch.float32, seed=5)
    clean = expected_output(batch, SCALE)
    batch.k[0] = float("inf")  # sequence 0's only new row
    batch.v[0] = float("nan")
    out = store_and_attend(batch, SCALE)
    assert torch.isfinite(batch.kv_cache).all()
    # Sequences 1 and 2 (rows 1..) never see sequence 0's slots and stay exact.
    torch.testing.assert_close(out[1:].double(), clean[1:], rtol=1e-5, atol=1e-5)


def test_decodes_batch_in_groups_of_similar_length(monkeypatch):
    """Decodes are sorted by length and attended DECODE_GROUP_SIZE at a time, each group
    padded only to its own longest sequence; each prefill (or chunk) is its own call."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting_sdpa(*args, **kwargs):
        calls.append((args[0].shape[0], args[1].shape[-2]))  # (batch, key length)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting_sdpa)
    cases = [
        SeqCase(9, 1),
        SeqCase(0, 12),
        SeqCase(40, 1),
        SeqCase(3, 1),
        SeqCase(100, 1),
        SeqCase(8, 4),
        SeqCase(0, 1),
        SeqCase(20, 1),
    ]
    batch = make_batch(cases, 4, 2, 16, torch.float32, seed=11)
    out = store_and_attend(batch, SCALE)
    assert DECODE_GROUP_SIZE == 4
    # Decode lengths sorted: 1, 4, 10, 21 | 41, 101. Then the two prefills (12 and 12 keys).
    assert calls[:2] == [(4, 21), (2, 101)]
    assert len(calls) == 4
    torch.testing.assert_close(out.double(), expected_output(batch, SCALE), rtol=1e-5, atol=1e-5)
