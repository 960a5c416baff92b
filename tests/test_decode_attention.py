"""engine/kernels/decode_attention.py: the CUDA-graph decode's attention and its plan.

The plan (decode_split, DecodeWorkspace.host_plan) is host code, checked by hand and over
random batches: every sequence's KV covered once by chunks of one length, within the
workspace's capacity. The kernels must equal float32 attention over each sequence's pages
up to bf16 rounding, for sequences of one chunk (written directly) and of several
(merged), GQA groups of 1-8, a head dim that is no power of two, and any page size against
the loop's token step; with a sliding window, the torch backend's windowed attention. They
run on CUDA (marked gpu) and on the CPU under Triton's interpreter
(test_decode_attention_in_the_interpreter reruns the "interpreter" cases in a subprocess,
as tests/test_kernels.py does).
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


def test_windowed_plan_by_hand():
    # A window of 200: sequences of 5 and 200 tokens read all of theirs; one of 700 reads
    # 500..699, and the split is of the window lengths (405 tokens / 2 items: 256 each).
    from engine.kernels.decode_attention import DecodeWorkspace

    work = DecodeWorkspace(3, num_q_heads=4, head_dim=16, num_sms=2, device="cpu", window=200)
    lens = np.array([5, 700, 200], dtype=np.int32)
    work.plan.copy_(torch.from_numpy(work.host_plan(lens, np.zeros(4, dtype=np.int32))))
    assert work.seq_lens.tolist() == [5, 700, 200]
    assert work.kv_starts.tolist() == [0, 500, 0]
    assert work.split.tolist() == [3, 256]
    assert work.item_indptr.tolist() == [0, 1, 2, 3]
    # Without a window the same step reads every key: 905 tokens, 2 items, 512-token chunks.
    whole = DecodeWorkspace(3, num_q_heads=4, head_dim=16, num_sms=2, device="cpu")
    whole.plan.copy_(torch.from_numpy(whole.host_plan(lens, np.zeros(4, dtype=np.int32))))
    assert whole.kv_starts.tolist() == [0, 0, 0]
    assert whole.split.tolist() == [4, 512]


@pytest.mark.parametrize(
    ("head_dim", "batch_size", "block_n"),
    [(64, 64, 128), (128, 64, 128), (128, 8, 64), (256, 64, 64), (256, 8, 64)],
)
def test_a_wide_head_takes_tiles_of_the_measured_size(head_dim, batch_size, block_n):
    from engine.kernels.decode_attention import MAX_TILE_ELEMENTS, DecodeConfig

    config = DecodeConfig.for_batch(batch_size, head_dim)
    assert config.block_n == block_n
    assert config.block_n * head_dim <= MAX_TILE_ELEMENTS


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_covers_each_sequence_once_within_capacity(seed):
    """With or without a window: each sequence's items cover the keys it reads, from its
    window's start to its end."""
    from engine.kernels.decode_attention import DecodeWorkspace

    rng = random.Random(seed)
    batch = rng.choice([1, 3, 63, 64, 200])
    window = rng.choice([None, 1, 100, 1024])
    work = DecodeWorkspace(
        batch, num_q_heads=4, head_dim=16, num_sms=rng.randint(1, 132), device="cpu", window=window
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
        start = work.kv_starts[i].item()
        read = n if window is None else min(n, window)
        assert start == n - read
        mine = range(items[i], items[i + 1])
        assert [work.item_seq[j].item() for j in mine] == [i] * len(mine)
        assert [work.item_chunk[j].item() for j in mine] == list(range(len(mine)))
        assert (len(mine) - 1) * chunk < read <= len(mine) * chunk  # the last chunk ends it


@pytest.mark.parametrize("batch_size", [1, 63, 64, 512])
def test_nbytes_is_what_a_workspace_allocates(batch_size):
    # The KV pool is sized with nbytes kept free for every captured batch size.
    from engine.kernels.decode_attention import DecodeWorkspace

    work = DecodeWorkspace(batch_size, num_q_heads=16, head_dim=128, num_sms=132, device="cpu")
    buffers = (work.plan, work.part_out, work.part_lse)
    allocated = sum(t.numel() * t.element_size() for t in buffers)
    assert DecodeWorkspace.nbytes(batch_size, 16, 128, 132) == allocated


def test_graph_workspace_bytes_count_a_workspace_per_window(monkeypatch):
    # A model with sliding layers keeps a second workspace per captured batch size; the KV
    # pool is sized with all of them kept free.
    from engine.attention import triton_decode

    monkeypatch.setattr(triton_decode, "_num_sms", lambda device: 132)
    attn = triton_decode.TritonGraphDecode(torch.device("cpu"))
    attn.configure(16, 8, 256, torch.bfloat16, 256**-0.5, windows=(1024, 1024, None))
    sizes = [1, 2, 64]
    for size in sizes:
        attn.prepare_graph(size)
    works = [work for size in sizes for work in attn._work[size].values()]
    assert sorted(work.window or 0 for work in works) == [0] * 3 + [1024] * 3
    buffers = [t for work in works for t in (work.plan, work.part_out, work.part_lse)]
    allocated = sum(t.numel() * t.element_size() for t in buffers)
    assert attn.graph_workspace_bytes(sizes) == allocated


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


# (window, page size, sequence lengths, head dim), run with a group of 2: sequences
# shorter than the window, exactly it and one past it, much longer (its window split in
# several chunks), and windows that start mid-page (every start here but 0 and 16's
# multiples) so the loop's first step straddles pages; Gemma's head width, on its shorter
# loop steps.
WINDOW_CASES = [
    (8, 4, [3, 8, 9, 37, 130], 32),
    (200, 16, [5, 200, 201, 700, 333], 32),
    (150, 8, [1, 149, 151, 1003], 32),
    (40, 16, [7, 40, 300], 256),
]


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"w{c[0]}-page{c[1]}-d{c[3]}")
def test_windowed_decode_equals_the_torch_backends_window(target, case):
    from engine.attention.base import AttentionMetadata
    from engine.attention.torch_backend import TorchPagedAttention
    from engine.kernels.decode_attention import DecodeWorkspace, paged_decode_attention

    window, page, lens, head_dim = case
    heads, kv_heads = 4, 2
    device = "cuda" if target == "cuda" else "cpu"
    rng = random.Random(window)
    batch = len(lens)
    pages = [-(-n // page) for n in lens]
    num_blocks = sum(pages) + 2
    order = rng.sample(range(num_blocks), num_blocks)
    tables = [order[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(batch)]
    gen = torch.Generator().manual_seed(window)
    kv_cache = torch.randn(num_blocks, 2, page, kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(torch.bfloat16).to(device)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(torch.bfloat16).to(device)
    meta = AttentionMetadata.from_block_tables(
        [1] * batch, lens, tables, torch.zeros(batch, dtype=torch.int64, device=device), page
    )
    # 16 SMs: windows over 128 tokens split into 128-token chunks
    work = DecodeWorkspace(batch, heads, head_dim, 16, device, window=window)
    first_pages = np.append(meta.slots * meta.block_table.shape[1], 0).astype(np.int32)
    work.plan.copy_(torch.from_numpy(work.host_plan(meta.seq_lens, first_pages)))
    assert work.split[0].item() > batch or window < 128  # longer windows take several chunks
    scale = 0.3
    out = paged_decode_attention(q, kv_cache, meta.block_table.view(-1), work, scale)
    expected = TorchPagedAttention().forward(q, kv_cache, meta, scale, window)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    # Not what the whole sequence gives: the window mattered.
    whole = TorchPagedAttention().forward(q, kv_cache, meta, scale)
    assert not torch.allclose(out.float()[-1], whole.float()[-1], atol=5e-2)


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("window", [None, 40])
def test_fp8_decode_equals_the_torch_backends_fp8_emulation(target, window):
    """An fp8 pool with scales other than 1 (K's folded into the softmax scale, V's into
    the output), several chunks a sequence, GQA: what the torch backend computes in float32
    from the same pool, up to the kernel's bf16 rounding."""
    from engine.attention.base import AttentionMetadata
    from engine.attention.torch_backend import TorchPagedAttention
    from engine.kernels.decode_attention import DecodeWorkspace, paged_decode_attention
    from engine.kv.fp8 import quantize

    heads, kv_heads, head_dim, page = 4, 2, 32, 16
    lens, k_scale, v_scale = [5, 300, 133], 0.03, 2.5
    device = "cuda" if target == "cuda" else "cpu"
    rng = random.Random(7)
    pages = [-(-n // page) for n in lens]
    num_blocks = sum(pages) + 2
    order = rng.sample(range(num_blocks), num_blocks)
    tables = [order[sum(pages[:i]) : sum(pages[: i + 1])] for i in range(len(lens))]
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(num_blocks, 2, page, kv_heads, head_dim, generator=gen)
    kv_cache = torch.stack([quantize(kv[:, 0], k_scale), quantize(kv[:, 1], v_scale)], 1)
    kv_cache = kv_cache.to(device)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(torch.bfloat16).to(device)
    meta = AttentionMetadata.from_block_tables(
        [1] * len(lens),
        lens,
        tables,
        torch.zeros(len(lens), dtype=torch.int64, device=device),
        page,
    )
    work = DecodeWorkspace(len(lens), heads, head_dim, 4, device, window=window)
    first_pages = np.append(meta.slots * meta.block_table.shape[1], 0).astype(np.int32)
    work.plan.copy_(torch.from_numpy(work.host_plan(meta.seq_lens, first_pages)))
    assert work.split[0].item() > len(lens) or window is not None  # sequences split
    scale = head_dim**-0.5
    out = paged_decode_attention(
        q, kv_cache, meta.block_table.view(-1), work, scale, k_scale=k_scale, v_scale=v_scale
    )
    expected = TorchPagedAttention().forward(
        q, kv_cache, meta, scale, window, k_scale=k_scale, v_scale=v_scale
    )
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    unscaled = TorchPagedAttention().forward(q, kv_cache, meta, scale, window)
    assert not torch.allclose(out.float(), unscaled.float(), atol=0.1)  # the scales mattered


class GraphDecodeBeside:
    """Decode steps through TritonGraphDecode (the CUDA-graph decode, run here by the
    interpreter), every other step through the torch backend: CudaAttention's split with
    the torch backend for flashinfer."""

    supports_cuda_graphs = False
    supports_sliding_window = True

    def __init__(self, config, batch_size: int) -> None:
        from engine.attention.torch_backend import TorchPagedAttention
        from engine.attention.triton_decode import TritonGraphDecode

        self.eager, self.graph_decode = TorchPagedAttention(), TritonGraphDecode("cpu")
        self.graph_decode.configure(
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            torch.float32,
            config.attention_scale,
            config.attention_windows,
        )
        self.graph_decode.prepare_graph(batch_size)  # every decode step's
        self._planned_for = None
        self.graph_steps = 0

    def forward(self, q, kv_cache, meta, scale, window=None, k_scale=1.0, v_scale=1.0):
        if self._planned_for is not meta:  # PagedRunner drives the model without plan()
            self._planned_for, decode = meta, bool((meta.query_lens == 1).all())
            self._backend = self.graph_decode if decode else self.eager
            if decode:
                self.graph_decode.plan(meta)
                self.graph_steps += 1
        return self._backend.forward(q, kv_cache, meta, scale, window, k_scale, v_scale)


@pytest.mark.skipif(not INTERPRETED, reason="run by test_decode_attention_in_the_interpreter")
def test_gemma3_decodes_through_the_graph_decode_in_the_interpreter(monkeypatch, tmp_path):
    """A tiny Gemma 3 (window 8, a global layer between sliding ones, its own softmax
    scale): decode steps of two sequences, far past the window, through the graph decode's
    per-window workspaces give the logits the torch backend gives."""
    from engine.attention import triton_decode
    from engine.attention.torch_backend import TorchPagedAttention
    from engine.model.loader import load_model
    from tests.test_model_parity import PagedRunner, prompt_ids, rel_error
    from tests.tiny_models import write_tiny_model

    monkeypatch.setattr(triton_decode, "_num_sms", lambda device: 2)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no CUDA host here
    s, f = "sliding_attention", "full_attention"
    directory = write_tiny_model(
        tmp_path,
        "gemma3_text",
        sliding_window=8,
        num_hidden_layers=3,
        layer_types=[s, f, s],
        query_pre_attn_scalar=24,
    )
    _, config = load_model(directory, torch.float32, "cpu", TorchPagedAttention())
    runs = {}
    for name in ("torch", "graph"):
        backend = (
            TorchPagedAttention() if name == "torch" else GraphDecodeBeside(config, batch_size=2)
        )
        model, config = load_model(directory, torch.float32, "cpu", backend)
        runner = PagedRunner(model, config)
        prompts = [prompt_ids(config.vocab_size, 21, seed=1), prompt_ids(config.vocab_size, 5)]
        runner.step([(0, prompts[0]), (1, prompts[1])])
        tokens = prompt_ids(config.vocab_size, 2 * 14, seed=2)
        runs[name] = [runner.step([(0, [a]), (1, [b])]) for a, b in zip(tokens[::2], tokens[1::2])]
    assert backend.graph_steps == 14
    for got, want in zip(runs["graph"], runs["torch"], strict=True):
        for g, w in zip(got, want, strict=True):
            assert rel_error(g, w) < 1e-4


@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_decode_attention_in_the_interpreter() -> None:
    rerun_interpreter_cases(__file__)
