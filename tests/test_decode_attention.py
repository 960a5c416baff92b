"""engine/kernels/decode_attention.py: the CUDA-graph decode's attention and its plan.

The plan (decode_split, DecodeWorkspace.host_plan) is host code, checked by hand and over
random batches: every sequence's KV covered once by chunks of one length, within the
workspace's capacity. The kernels must equal float32 attention over each sequence's pages
up to bf16 rounding, for sequences of one chunk (written directly) and of several
(merged), GQA groups of 1-8, a head dim that is no power of two, and any page size against
the loop's token step. They run on CUDA (marked gpu) and on the CPU under Triton's
interpreter (test_decode_attention_in_the_interpreter reruns the "interpreter" cases in a
subprocess, as tests/test_kernels.py does).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.kernels.dispatch import triton_importable
from tests.test_kernels import INTERPRETED, TRITON_TARGETS, rerun_interpreter_cases
from tests.test_triton_linear import interpreter_multiplies_bf16_values  # noqa: F401

pytestmark = pytest.mark.skipif(not triton_importable(), reason="triton is not installed")


def test_decode_split_by_hand():
    from engine.kernels.decode_attention import decode_split

    split = decode_split(np.array([300, 64, 1], dtype=np.int32), target_items=2, granule=64)
    # 365 tokens / 2 items = 183, in whole 64-token steps: 192
    assert split.chunk_tokens == 192
    assert split.item_seq.tolist() == [0, 0, 1, 2]
    assert split.item_chunk.tolist() == [0, 1, 0, 0]
    assert split.item_indptr.tolist() == [0, 2, 3, 4]
    # never below MIN_CHUNK_TOKENS, however many items are asked for
    assert decode_split(np.array([300], dtype=np.int32), 100, granule=64).chunk_tokens == 128


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_covers_each_sequence_once_within_capacity(seed):
    from engine.kernels.decode_attention import DecodeWorkspace

    rng = random.Random(seed)
    batch = rng.choice([1, 3, 63, 64, 200])
    work = DecodeWorkspace(
        batch, num_q_heads=4, head_dim=16, num_sms=rng.randint(1, 132), device="cpu"
    )
    lens = np.array([rng.randint(1, 5000) for _ in range(batch)], dtype=np.int32)
    indptr = np.zeros(batch + 1, dtype=np.int32)
    np.cumsum(-(-lens // 16), out=indptr[1:])
    work.plan.copy_(torch.from_numpy(work.host_plan(lens, indptr)))
    num_items, chunk = work.split.tolist()
    items = work.item_indptr.tolist()
    assert (
        work.kv_first_page.tolist() == indptr.tolist() and work.seq_lens.tolist() == lens.tolist()
    )
    assert num_items == items[-1] <= work.capacity and chunk % work.config.block_n == 0
    for i, n in enumerate(lens):
        mine = range(items[i], items[i + 1])
        assert [work.item_seq[j].item() for j in mine] == [i] * len(mine)
        assert [work.item_chunk[j].item() for j in mine] == list(range(len(mine)))
        assert (len(mine) - 1) * chunk < n <= len(mine) * chunk  # the last chunk ends it


@pytest.mark.parametrize("batch_size", [1, 63, 64, 512])
def test_nbytes_is_what_a_workspace_allocates(batch_size):
    # The KV pool is sized with nbytes kept free for every captured batch size.
    from engine.kernels.decode_attention import DecodeWorkspace

    work = DecodeWorkspace(batch_size, num_q_heads=16, head_dim=128, num_sms=132, device="cpu")
    buffers = (work.plan, work.part_out, work.part_lse)
    allocated = sum(t.numel() * t.element_size() for t in buffers)
    assert DecodeWorkspace.nbytes(batch_size, 16, 128, 132) == allocated


def dense_reference(q, kv_cache, tables, lens, scale):
    """float32 attention of each sequence's one query over its first lens[i] tokens."""
    _, _, _, kv_heads, head_dim = kv_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float32)
    for i, n in enumerate(lens):
        pages = kv_cache[tables[i]].float().cpu()  # [pages, 2, page, kv_heads, head_dim]
        k = pages[:, 0].reshape(-1, kv_heads, head_dim)[:n]
        v = pages[:, 1].reshape(-1, kv_heads, head_dim)[:n]
        for h in range(q.shape[1]):
            scores = (k[:, h // group] @ q[i, h].float().cpu()) * scale
            out[i, h] = torch.softmax(scores, 0) @ v[:, h // group]
    return out


# (query heads, KV heads, head dim, page size): Qwen3's group of 2, MHA, a group of 8,
# a group of 3 with a head dim of 48 (padded to 64), and pages shorter than a loop step.
SHAPES = [(4, 2, 32, 16), (2, 2, 16, 4), (8, 1, 16, 32), (3, 1, 48, 8)]


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_attention_equals_float32_attention(target, shape):
    from engine.kernels.decode_attention import DecodeWorkspace, paged_decode_attention

    heads, kv_heads, head_dim, page = shape
    device = "cuda" if target == "cuda" else "cpu"
    rng = random.Random(sum(shape))
    # 70 sequences take the 64-and-over configuration; up to 700 tokens, several chunks
    for batch, longest, num_sms in ((3, 20, 4), (5, 700, 8), (70, 300, 40)):
        if device == "cpu" and batch > 5:
            continue  # the interpreter runs programs one by one
        lens = [rng.randint(1, longest) for _ in range(batch)]
        pages = [-(-n // page) for n in lens]
        num_blocks = sum(pages) + 2
        order = rng.sample(range(num_blocks), num_blocks)
        tables = [order[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(batch)]
        kv_cache = torch.randn(num_blocks, 2, page, kv_heads, head_dim).to(torch.bfloat16)
        q = torch.randn(batch, heads, head_dim).to(torch.bfloat16)
        work = DecodeWorkspace(batch, heads, head_dim, num_sms, device)
        # As the engine runs it: each sequence's blocks are a row of a block table (its
        # slot's, in any order), which the kernel reads from slot * width on.
        width = max(pages) + 1
        slots = rng.sample(range(batch), batch)
        block_table = torch.zeros(batch, width, dtype=torch.int32)
        for slot, blocks in zip(slots, tables, strict=True):
            block_table[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        first_pages = np.array([*(s * width for s in slots), 0], dtype=np.int32)
        plan = work.host_plan(np.array(lens, dtype=np.int32), first_pages)
        work.plan.copy_(torch.from_numpy(plan))
        num_items = work.split[0].item()
        assert num_items > batch or longest == 20  # the long batches split sequences
        indices = block_table.view(-1).to(device)
        scale = head_dim**-0.5
        out = paged_decode_attention(q.to(device), kv_cache.to(device), indices, work, scale)
        expected = dense_reference(q, kv_cache, tables, lens, scale)
        torch.testing.assert_close(out.float().cpu(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_decode_attention_in_the_interpreter() -> None:
    rerun_interpreter_cases(__file__)
