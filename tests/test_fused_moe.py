"""engine/kernels/fused_moe.py on the CPU: the grouping by expert, torch._grouped_mm's path,
and the Triton grouped GEMM under Triton's interpreter, each against the reference path
(Experts.reference, what the CPU serves with). The interpreter needs TRITON_INTERPRET=1
before triton is imported: test_fused_moe_in_the_interpreter reruns this file's
"interpreter" cases in a subprocess, as tests/test_kernels.py does. tests/test_gpu_moe.py
runs the same implementations on CUDA at real model shapes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.kernels import fused_moe
from engine.kernels.dispatch import triton_importable
from engine.llm import LLM
from engine.model import moe
from engine.model.moe import Experts
from engine.sampling_params import SamplingParams
from tests.test_kernels import INTERPRETED, rerun_interpreter_cases
from tests.test_model_parity import one_intra_op_thread  # noqa: F401 (autouse: small models)
from tests.test_triton_linear import interpreter_multiplies_bf16_values  # noqa: F401 (autouse)
from tests.tiny_models import write_tiny_model

# (tokens, hidden, intermediate, experts, top-k): T = 1; more experts than pairs; partial
# tile blocks everywhere (hidden 48, intermediate 24 against blocks of 16 and 32).
SHAPES = [(1, 32, 16, 4, 2), (7, 48, 24, 6, 2), (9, 32, 24, 16, 3), (33, 64, 32, 5, 1)]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


def random_experts(hidden: int, inter: int, num_experts: int, dtype: torch.dtype) -> Experts:
    config = SimpleNamespace(hidden_size=hidden)
    moe_config = SimpleNamespace(num_experts=num_experts, moe_intermediate_size=inter)
    experts = Experts(config, moe_config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=hidden**-0.5)
        experts.down_proj.normal_(std=inter**-0.5)
    return experts.to(dtype).requires_grad_(False)


def random_routing(tokens: int, num_experts: int, top_k: int, dtype: torch.dtype):
    """(weights, expert ids) as a router gives them: k distinct experts per token; the
    last expert is never chosen (where there are spare ones), so one group is empty."""
    scores = torch.rand(tokens, num_experts)
    if num_experts > top_k:
        scores[:, -1] = -1.0
    weights, ids = scores.softmax(-1).topk(top_k, dim=-1)
    return weights.to(dtype), ids


def case(shape: tuple, dtype: torch.dtype):
    tokens, hidden, inter, num_experts, top_k = shape
    experts = random_experts(hidden, inter, num_experts, dtype)
    weights, ids = random_routing(tokens, num_experts, top_k, dtype)
    x = torch.randn(tokens, hidden).to(dtype)
    return experts, x, weights, ids


# ---- grouping ------------------------------------------------------------------------


def test_group_by_expert_sorts_pairs_stably_and_counts_empty_experts():
    ids = torch.tensor([[3, 0], [0, 3], [1, 0]])
    g = fused_moe.group_by_expert(ids, num_experts=5)
    assert g.order.tolist() == [1, 2, 5, 4, 0, 3]  # pairs token * k + slot, by expert
    assert g.counts.tolist() == [3, 1, 0, 2, 0]
    assert g.ends.tolist() == [3, 4, 4, 6, 6] and g.ends.dtype == torch.int32


def padded_rows(ids: torch.Tensor, num_experts: int, block_m: int):
    """What triton_moe.align_rows lays out, in torch: the pairs stably sorted by expert,
    each expert's rows padded to block_m (padding rows hold T*k), the rows padded to
    fused_moe.padded_size, and each block's expert (E past the last expert's rows)."""
    num_pairs = ids.numel()
    g = fused_moe.group_by_expert(ids, num_experts)
    size = fused_moe.padded_size(num_pairs, num_experts, block_m)
    padded_counts = (g.counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    # Sorted row i of expert e moves from ends[e] - counts[e] + i to padded start[e] + i.
    shift = (padded_ends - padded_counts) - (g.ends.long() - g.counts)
    sorted_experts = ids.reshape(-1)[g.order].long()
    rows = torch.arange(num_pairs) + shift[sorted_experts]
    pair_of_row = torch.full((size,), num_pairs, dtype=torch.int64)
    pair_of_row[rows] = g.order
    block_expert = torch.searchsorted(padded_ends, torch.arange(0, size, block_m), right=True)
    return pair_of_row.to(torch.int32), block_expert.to(torch.int32)


# (tokens, experts, top-k) beside SHAPES': several chunks of the alignment kernels' pairs
# (300 and 2,048 pairs), more experts than a power of two, and than pairs.
ALIGN_SHAPES = [(1, 4, 2), (7, 6, 2), (9, 16, 3), (100, 6, 3), (256, 128, 8), (3, 130, 2)]


@pytest.mark.parametrize("block_m", [1, 4, 16])
@pytest.mark.parametrize("shape", SHAPES)
def test_padded_rows_hold_every_pair_once_in_blocks_of_one_expert(shape, block_m):
    tokens, _, _, num_experts, top_k = shape
    _, ids = random_routing(tokens, num_experts, top_k, torch.float32)
    num_pairs = ids.numel()
    pair_of_row, block_expert = padded_rows(ids, num_experts, block_m)
    assert pair_of_row.numel() == fused_moe.padded_size(num_pairs, num_experts, block_m)
    assert block_expert.numel() * block_m == pair_of_row.numel()
    real = pair_of_row[pair_of_row < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))
    flat = ids.reshape(-1)
    for block, expert in enumerate(block_expert.tolist()):
        rows = pair_of_row[block * block_m : (block + 1) * block_m]
        rows = rows[rows < num_pairs]
        if expert == num_experts:  # past the last expert's rows: all padding
            assert rows.numel() == 0
        else:
            assert rows.numel() > 0 and (flat[rows.long()] == expert).all()


@pytest.mark.parametrize(
    ("tokens", "num_experts", "top_k"),
    [(1, 128, 8), (32, 128, 8), (128, 128, 8), (256, 128, 8), (32, 8, 2), (64, 8, 2)],
)
def test_pick_tiles_blocks_rarely_split_an_experts_rows(tokens, num_experts, top_k):
    """At decode sizes (an expert's rows within the largest BLOCK_M), under even routing (a
    random router's), an expert's rows exceed the chosen BLOCK_M, and so read its weights
    twice, in under 1% of expert-steps."""
    block_m = fused_moe.pick_tiles(tokens * top_k, num_experts).block_m
    split = 0
    for _ in range(50):
        _, ids = torch.rand(tokens, num_experts).topk(top_k, dim=-1)
        split += int((torch.bincount(ids.reshape(-1), minlength=num_experts) > block_m).sum())
    assert split < 0.01 * 50 * num_experts


# ---- torch._grouped_mm ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_grouped_mm_equals_the_reference(shape, dtype):
    experts, x, weights, ids = case(shape, dtype)
    want = experts.reference(x, weights, ids)
    got = fused_moe.grouped_mm_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_float32_router_weights_with_bf16_activations():
    experts, x, _, ids = case(SHAPES[1], torch.bfloat16)
    weights = torch.rand(ids.shape)
    want = experts.reference(x, weights, ids)
    got = fused_moe.grouped_mm_experts(x, weights, ids, experts.gate_up_proj, experts.down_proj)
    torch.testing.assert_close(got, want, **TOLERANCE[torch.bfloat16])


def test_grouped_mm_fits_only_16_byte_strides():
    experts, x, _, _ = case(SHAPES[0], torch.bfloat16)
    assert fused_moe.grouped_mm_fits(x, experts.gate_up_proj, experts.down_proj)
    odd = random_experts(36, 16, 4, torch.bfloat16)  # 36 bf16 = 72 bytes a row
    x_odd = torch.randn(2, 36).to(torch.bfloat16)
    assert not fused_moe.grouped_mm_fits(x_odd, odd.gate_up_proj, odd.down_proj)


def test_experts_take_the_reference_path_on_the_cpu(monkeypatch):
    experts, x, weights, ids = case(SHAPES[1], torch.float32)
    monkeypatch.setattr(moe.Experts, "fused", lambda *args: pytest.fail("fused on the CPU"))
    torch.testing.assert_close(experts(x, weights, ids), experts.reference(x, weights, ids))


def test_fused_dispatch_falls_back_to_grouped_mm_without_triton(monkeypatch):
    experts, x, weights, ids = case(SHAPES[2], torch.float32)
    monkeypatch.setattr(moe, "triton_importable", lambda: False)
    monkeypatch.setattr(moe, "triton_experts", lambda *args: pytest.fail("no triton"))
    got = experts.fused(x, weights, ids)
    torch.testing.assert_close(got, experts.reference(x, weights, ids), **TOLERANCE[torch.float32])


def test_a_tiny_moe_model_generates_the_same_on_the_fused_path(tmp_path, monkeypatch):
    """The fused path's glue inside a model (router weights as the model makes them, its
    activations' layout), through torch._grouped_mm: the Triton kernel needs CUDA or the
    interpreter, which the cases below run on the kernel alone."""
    directory = write_tiny_model(tmp_path, "qwen3_moe", num_experts=6, num_experts_per_tok=2)
    prompts = [[5, 17, 42, 8, 99, 3, 61], [7, 7, 250]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = LLM(str(directory), num_blocks=64, block_size=4).generate(prompts, params)
    calls = []
    grouped_mm_experts = moe.grouped_mm_experts
    monkeypatch.setattr(moe, "triton_importable", lambda: False)
    monkeypatch.setattr(
        moe, "grouped_mm_experts", lambda *a: calls.append(1) or grouped_mm_experts(*a)
    )
    monkeypatch.setattr(moe.Experts, "forward", moe.Experts.fused)
    got = LLM(str(directory), num_blocks=64, block_size=4).generate(prompts, params)
    assert calls  # the fused path ran, not the reference fallback
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


# ---- the Triton kernel, in the interpreter -------------------------------------------
# The interpreter rounds float32 to bf16 toward zero (the GPU to nearest even), which about
# triples the kernel's bf16 error here; TOLERANCE's bf16 bounds hold either way.

INTERPRETER_TILES = [
    None,  # pick_tiles: decode tiles at these sizes
    fused_moe.PREFILL_TILES,
    fused_moe.MoeTiles(block_m=16, block_n=16, block_k=32, num_warps=1, num_stages=1),
]


@pytest.mark.skipif(not INTERPRETED, reason="run by test_fused_moe_in_the_interpreter")
@pytest.mark.parametrize("tiles", INTERPRETER_TILES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_triton_experts_equal_the_reference_interpreter(shape, dtype, tiles):
    experts, x, weights, ids = case(shape, dtype)
    want = experts.reference(x, weights, ids)
    got = fused_moe.triton_experts(
        x, weights, ids, experts.gate_up_proj, experts.down_proj, tiles=tiles
    )
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


@pytest.mark.skipif(not INTERPRETED, reason="run by test_fused_moe_in_the_interpreter")
@pytest.mark.parametrize("tiles", INTERPRETER_TILES[1:])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gated_gemm_is_silu_and_mul_of_the_plain_one_interpreter(dtype, tiles):
    """The first GEMM with silu_and_mul in its epilogue against the plain GEMM followed by
    the activation: the same values, up to the dots' summation order."""
    from engine.kernels import triton_moe
    from engine.kernels.activation import silu_and_mul_torch

    experts, x, _, ids = case(SHAPES[2], dtype)
    num_experts, top_k = experts.gate_up_proj.shape[0], ids.shape[1]
    size = fused_moe.padded_size(ids.numel(), num_experts, tiles.block_m)
    layout = triton_moe.align_rows(ids, num_experts, tiles.block_m, size)
    launch = dict(vars(tiles))
    plain = triton_moe.grouped_gemm(x, experts.gate_up_proj, *layout, top_k, None, **launch)
    gated = triton_moe.grouped_gemm(
        x, experts.gate_up_proj, *layout, top_k, None, gated=True, **launch
    )
    assert gated.shape == (ids.numel(), experts.down_proj.shape[2])
    torch.testing.assert_close(gated, silu_and_mul_torch(plain), **TOLERANCE[dtype])


@pytest.mark.skipif(not INTERPRETED, reason="run by test_fused_moe_in_the_interpreter")
@pytest.mark.parametrize("block_m", [1, 16, 64])
@pytest.mark.parametrize("shape", ALIGN_SHAPES)
def test_align_rows_lays_out_what_the_stable_sort_and_padding_do_interpreter(shape, block_m):
    from engine.kernels import triton_moe

    tokens, num_experts, top_k = shape
    _, ids = random_routing(tokens, num_experts, top_k, torch.float32)
    size = fused_moe.padded_size(ids.numel(), num_experts, block_m)
    got = triton_moe.align_rows(ids, num_experts, block_m, size)
    want = padded_rows(ids, num_experts, block_m)
    for got_part, want_part in zip(got, want, strict=True):
        assert got_part.dtype == torch.int32 and torch.equal(got_part, want_part)


def torch_top_k_softmax(logits: torch.Tensor, top_k: int, renormalize: bool):
    """The router's torch path, but among equal logits (frequent in bf16) the lowest expert
    first, as a stable sort puts them: torch.topk leaves their order open."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    order = torch.sort(logits.float(), dim=-1, descending=True, stable=True).indices
    ids = order[:, :top_k]
    weights = probs.gather(-1, ids)
    return (weights / weights.sum(-1, keepdim=True) if renormalize else weights), ids


@pytest.mark.skipif(not INTERPRETED, reason="run by test_fused_moe_in_the_interpreter")
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(1, 4, 1), (5, 6, 2), (9, 130, 8)])
def test_top_k_softmax_is_the_routers_softmax_and_top_k_interpreter(
    tokens, num_experts, top_k, dtype, renormalize
):
    """The kernel against torch's softmax in float32, top-k and renormalisation: the same
    experts, largest first, and their weights; a router's logits as a strided view too."""
    from engine.kernels import triton_moe

    logits = torch.randn(tokens, num_experts + 3).to(dtype)[:, :num_experts]
    weights, ids = triton_moe.top_k_softmax(logits, top_k, renormalize)
    want_weights, want_ids = torch_top_k_softmax(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not INTERPRETED, reason="run by test_fused_moe_in_the_interpreter")
def test_top_k_softmax_takes_the_lowest_expert_among_equals_interpreter():
    from engine.kernels import triton_moe

    logits = torch.tensor([[1.0, 3.0, 0.5, 3.0, 3.0]])
    weights, ids = triton_moe.top_k_softmax(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 3]]
    assert weights.tolist() == [[0.5, 0.5]]


@pytest.mark.skipif(not INTERPRETED, reason="run by test_fused_moe_in_the_interpreter")
def test_the_router_takes_the_kernel_where_triton_runs_interpreter(monkeypatch):
    """Router.forward as on CUDA (the kernel) and as on the CPU (torch): the same choice,
    its weights in the model's dtype or float32 as the config says."""
    from types import SimpleNamespace

    config = SimpleNamespace(hidden_size=32)
    moe_config = SimpleNamespace(
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, float32_weights=False
    )
    router = moe.Router(config, moe_config).to(torch.bfloat16).requires_grad_(False)
    router.weight.normal_()
    x = torch.randn(5, 32).to(torch.bfloat16)
    want_weights, want_ids = router(x)
    monkeypatch.setattr(moe, "use_triton", lambda tensor: True)
    got_weights, got_ids = router(x)
    assert torch.equal(got_ids.long(), want_ids)
    assert got_weights.dtype == want_weights.dtype == torch.bfloat16
    torch.testing.assert_close(got_weights, want_weights)


@pytest.mark.skipif(not triton_importable(), reason="triton is not installed")
@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_fused_moe_in_the_interpreter() -> None:
    rerun_interpreter_cases(__file__)
