"""The host side of the GPU path, on the CPU: flashinfer's page tables built from a step's
rows of the persistent block table, the CUDA-graph buckets, and that the GPU modules
import without flashinfer. The GPU suite itself is tests/test_gpu.py."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.attention.flashinfer_backend import page_table, split_step, window_left
from engine.config import CacheConfig, EngineConfig
from engine.core.cuda_graphs import MAX_GRAPH_BATCH, graph_batch_sizes
from engine.errors import ValidationError
from engine.kernels.kv_cache import store_kv_torch
from tests.test_torch_attention import (
    HEADS,
    SCALE,
    dense_attention,
    expected_output,
    make_batch,
    random_cases,
)


def test_gpu_modules_import_without_flashinfer():
    code = (
        "import sys, engine.attention.cuda, engine.core.cuda_graphs, engine.core.engine; "
        "assert 'flashinfer' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def gathered(page_index: np.ndarray, block_table: list[list[int]], width: int) -> list[int]:
    """The block ids at page_index in the flat block table, rows padded to width."""
    flat = [b for row in block_table for b in row + [-1] * (width - len(row))]
    return [flat[i] for i in page_index]


def test_window_left_counts_the_keys_before_the_query():
    # flashinfer's query at p sees keys [p - window_left, p]; ours sees (p - W, p].
    assert window_left(None) == -1
    assert window_left(1) == 0  # itself alone
    assert window_left(1024) == 1023


def test_page_table_by_hand():
    # Block size 4: lengths 5, 4 and 1 take 2, 1 and 1 pages; their last pages hold 1, 4, 1.
    # They sit in slots 2, 0 and 1 of a block table 3 wide.
    rows = [[9, 0, 0], [3, 0, 0], [7, 2, 0]]
    table = page_table([5, 4, 1], [2, 0, 1], block_width=3, block_size=4)
    assert table.indptr.tolist() == [0, 2, 3, 4]
    assert gathered(table.page_index, rows, 3) == [7, 2, 9, 3]
    assert table.last_page_len.tolist() == [1, 4, 1]
    assert table.indptr.dtype == table.last_page_len.dtype == np.int32


def test_split_step_by_hand():
    # Two decodes, a prefill, a one-token prompt remainder after it, a chunk with a cached
    # prefix: the decode kernel takes the first two, the prefill kernel the rest.
    query_lens = [1, 1, 7, 1, 3]
    seq_lens = [9, 4, 7, 13, 11]
    tables = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10], [11, 12, 13]]
    slots = [4, 0, 3, 1, 2]  # any slots: each sequence reads its own row
    rows = [[]] * 5
    for slot, blocks in zip(slots, tables, strict=True):
        rows[slot] = blocks
    pages = split_step(query_lens, seq_lens, slots, block_width=5, block_size=4)
    assert pages.num_decodes == 2 and pages.num_prefills == 3
    assert gathered(pages.page_index, rows, 5) == list(range(1, 14))
    assert pages.decode_indptr.tolist() == [0, 3, 4]
    assert pages.decode_last_page_len.tolist() == [1, 4]
    assert pages.prefill_qo_indptr.tolist() == [0, 7, 8, 11]
    assert pages.prefill_indptr.tolist() == [0, 2, 6, 9]
    assert pages.prefill_last_page_len.tolist() == [3, 1, 3]

    only_decodes = split_step([1, 1], [3, 4], [0, 1], block_width=1, block_size=4)
    assert only_decodes.num_decodes == 2 and only_decodes.num_prefills == 0
    only_prefills = split_step([3, 1], [3, 4], [0, 1], block_width=1, block_size=4)
    assert only_prefills.num_decodes == 0 and only_prefills.prefill_qo_indptr.tolist() == [0, 3, 4]


def attend_as_flashinfer(q, kv_cache, qo_indptr, kv_indptr, kv_indices, last_page_len, scale):
    """flashinfer's documented semantics, in float64: request i's query rows
    qo_indptr[i]:qo_indptr[i + 1] attend to the tokens of its pages kv_indices[kv_indptr[i]:
    kv_indptr[i + 1]], in order, all of each page but the last, of which the first
    last_page_len[i]; causal with the queries at the end of the keys (bottom-right)."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    out = []
    for i in range(len(last_page_len)):
        pages = torch.as_tensor(kv_indices[kv_indptr[i] : kv_indptr[i + 1]], dtype=torch.long)
        length = (len(pages) - 1) * block_size + int(last_page_len[i])
        keys = kv_cache[pages, 0].reshape(-1, num_kv_heads, head_dim)[:length]
        values = kv_cache[pages, 1].reshape(-1, num_kv_heads, head_dim)[:length]
        out.append(dense_attention(q[qo_indptr[i] : qo_indptr[i + 1]], keys, values, scale))
    return torch.cat(out)


@pytest.mark.parametrize("num_q_heads,num_kv_heads", HEADS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("decodes_first", [True, False])
def test_split_step_describes_exactly_each_sequences_kv(
    seed, block_size, num_q_heads, num_kv_heads, decodes_first
):
    """Write a random step's new K/V, then attend the way flashinfer reads the page tables
    split_step builds: the result must be dense causal attention over each sequence."""
    cases = random_cases(random.Random(seed))
    if decodes_first:  # the scheduler's order; any other order must still be right
        cases.sort(key=lambda c: c.new != 1)
    batch = make_batch(cases, num_q_heads, num_kv_heads, block_size, torch.float32, seed)
    meta = batch.meta
    store_kv_torch(batch.k, batch.v, batch.kv_cache, meta.slot_mapping)
    width = meta.block_table.shape[1]
    pages = split_step(meta.query_lens, meta.seq_lens, meta.slots, width, block_size)
    indices = meta.block_table.view(-1)[torch.from_numpy(pages.page_index)].tolist()

    num_decode_pages = int(pages.decode_indptr[-1])
    parts = []
    if pages.num_decodes:
        parts.append(
            attend_as_flashinfer(
                batch.q[: pages.num_decodes],
                batch.kv_cache,
                list(range(pages.num_decodes + 1)),  # one query row each
                pages.decode_indptr,
                indices[:num_decode_pages],
                pages.decode_last_page_len,
                SCALE,
            )
        )
    if pages.num_prefills:
        parts.append(
            attend_as_flashinfer(
                batch.q[pages.num_decodes :],
                batch.kv_cache,
                pages.prefill_qo_indptr,
                pages.prefill_indptr,
                indices[num_decode_pages:],
                pages.prefill_last_page_len,
                SCALE,
            )
        )
    torch.testing.assert_close(
        torch.cat(parts), expected_output(batch, SCALE), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("max_num_seqs", [1, 3, 16, 100, 256, 512, 1000])
def test_graph_batch_sizes(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[0] == 1
    assert sizes[-1] == min(max_num_seqs, MAX_GRAPH_BATCH)
    # Padding a batch to its bucket at most doubles it (only among the smallest buckets).
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:]))


def test_gpu_settings_validate():
    assert CacheConfig().gpu_memory_utilization == 0.9
    assert CacheConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    for bad in (0.0, -0.5, 1.01):
        with pytest.raises(ValidationError, match="gpu_memory_utilization"):
            CacheConfig(gpu_memory_utilization=bad)
    assert EngineConfig().enforce_eager is False
    with pytest.raises(ValidationError, match="float32 is not served on CUDA") as err:
        EngineConfig(device="cuda:0", dtype="float32")
    assert err.value.field == "dtype"
    assert EngineConfig(device="cpu", dtype="float32").torch_dtype == torch.float32


def test_block_size_defaults_by_device():
    assert CacheConfig().block_size is None
    assert EngineConfig(device="cpu").block_size == 16
    assert EngineConfig(device="cuda").block_size == 64
    assert EngineConfig(device="cuda", cache=CacheConfig(block_size=16)).block_size == 16
    with pytest.raises(ValidationError, match="block_size"):
        CacheConfig(block_size=48)
