"""Tensor parallelism on the CPU: N gloo processes, each holding its shard of a tiny
checkpoint (safetensors of each family, GGUF, fp8), give the logits and greedy tokens of
the whole model in one process. The engine's side (worker processes, the real SmolLM2
through `pagedserve generate`) is tests/test_tensor_parallel_engine.py."""

from __future__ import annotations

import contextlib
import functools
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.attention.torch_backend import TorchPagedAttention
from engine.errors import ModelLoadError
from engine.kernels.fp8_linear import FP8, quantize_rows
from engine.kv.fp8 import set_kv_scales
from engine.kv.pool import kv_bytes_per_block
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.parallel.group import TensorParallel
from engine.parallel.shard import ModelShard
from tests.test_fp8_weights import (  # noqa: F401 (fp8_runs: a fixture)
    SCHEMES,
    fp8_runs,
    load,
    write_fp8,
)
from tests.test_model_parity import (  # noqa: F401 (one_intra_op_thread: autouse)
    PagedRunner,
    one_intra_op_thread,
    prompt_ids,
    rel_error,
)
from tests.tiny_models import write_tiny_gguf, write_tiny_model

TOLERANCE = 1e-4
DECODE_STEPS = 6

SIX_HEADS = {"num_attention_heads": 6, "hidden_size": 96}
S, F = "sliding_attention", "full_attention"
# Windows shorter than the prompt, soft-capped logits, a tied and an untied head.
GEMMA3 = {"sliding_window": 8, "query_pre_attn_scalar": 24, "final_logit_softcapping": 30.0}

# name -> (arch, tensor-parallel size, write_tiny_model overrides)
MODELS = {
    "llama-4-heads-2-kv-at-2": ("llama", 2, {}),
    "qwen3-at-2": ("qwen3", 2, {}),  # q/k norm
    # 2 KV heads at 3 ranks: repeated to 6 (2 a rank); vocabulary and MLP split unevenly.
    "llama-6-heads-2-kv-at-3": ("llama", 3, SIX_HEADS),
    # Fused qkv_proj and gate_up_proj; half of each head rotated (rows reordered per head).
    "phi3-partial-rotary-at-2": ("phi3", 2, {"partial_rotary_factor": 0.5}),
    "phi3-6-heads-2-kv-at-3": ("phi3", 3, SIX_HEADS),
    "gemma3-at-2": ("gemma3_text", 2, GEMMA3 | {"layer_types": [S, F]}),
    "gemma3-6-heads-2-kv-at-3": (
        "gemma3_text",
        3,
        GEMMA3 | SIX_HEADS | {"layer_types": [F, S], "tie_word_embeddings": True},
    ),
    # Experts of 32 rows (the dense layer 1 has 128), top-3 of 8 not renormalised.
    "qwen3-moe-at-2": (
        "qwen3_moe",
        2,
        {
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],
        },
    ),
    # Every second layer sparse; experts of 32 rows split 10, 11, 11, the dense MLP's 128
    # 42, 43, 43.
    "qwen3-moe-step2-at-3": (
        "qwen3_moe",
        3,
        {
            "num_attention_heads": 6,
            "hidden_size": 96,
            "num_hidden_layers": 4,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
        },
    ),
    "mixtral-at-2": ("mixtral", 2, {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


def tiny_gguf(directory: Path) -> Path:
    """Sliced after dequantizing and undoing llama.cpp's q/k row order: 2 KV heads at 3."""
    hf = write_tiny_model(directory / "hf", "llama", **SIX_HEADS)
    return write_tiny_gguf(hf, directory / "m.gguf")


def fp8_checkpoint(scheme: str, block: tuple[int, int] | None, **overrides) -> Callable:
    """On the CPU fp8 weights are dequantized as they load: each rank's with its part of
    the scales."""

    def build(directory: Path) -> Path:
        source = write_tiny_model(directory / "model", "qwen2", **overrides)
        return write_fp8(source, directory, scheme, *([block] if block else []))[0]

    return build


# name -> (tensor-parallel size, what writes the model into a directory, the fp8 KV pool's
# scale or None): every model above, and
CASES: dict[str, tuple[int, Callable[[Path], Path], float | None]] = {
    **{
        name: (size, functools.partial(write_tiny_model, arch=arch, **overrides), None)
        for name, (arch, size, overrides) in MODELS.items()
    },
    "gguf-6-heads-2-kv-at-3": (3, tiny_gguf, None),
    "fp8-channel-at-2": (2, fp8_checkpoint("channel", None), None),
    # 2 KV heads repeated to 6: each rank's two KV heads are whole blocks of 16 rows.
    "fp8-blocks-at-3": (
        3,
        fp8_checkpoint("block", (16, 16), **SIX_HEADS, intermediate_size=96),
        None,
    ),
    # Each layer's one K and one V scale hold for whichever KV heads a rank keeps.
    "llama-over-an-fp8-kv-pool-at-2": (2, functools.partial(write_tiny_model, arch="llama"), 0.02),
}


def generate(
    model: LlamaForCausalLM, config: ModelConfig, kv_scale: float | None = None
) -> tuple[torch.Tensor, list[int]]:
    """float32 last-position logits of a prompt's prefill and of each greedy decode step
    after it, and the greedy tokens; with a kv_scale, over an fp8 KV pool of K and V
    scales kv_scale and 2 * kv_scale in every layer."""
    runner = PagedRunner(model, config)
    if kv_scale is not None:
        runner.kv_caches = [cache.to(FP8) for cache in runner.kv_caches]
        set_kv_scales(model, [(kv_scale, 2 * kv_scale)] * config.num_layers)
    rows = [runner.step([(0, prompt_ids(config.vocab_size, 21, seed=5))])[0][-1]]
    tokens: list[int] = []
    for _ in range(DECODE_STEPS):
        tokens.append(int(rows[-1].argmax()))
        rows.append(runner.step([(0, [tokens[-1]])])[0][-1])
    return torch.stack(rows).float(), tokens


def group_threads() -> list[str]:
    """The names of this process's threads that a gloo process group runs."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            names.append((task / "comm").read_text().strip())
    return [name for name in names if "gloo" in name]


def run_rank(
    rank: int, size: int, port: int, jobs: list[tuple[str, Path, float | None]], out: Path
) -> None:
    """One rank: for each job (name, model, KV scale), its shard loaded and run; what it
    saw saved as {name}-rank{rank}.pt. Its models do not hold the group: it ends as it is
    destroyed, its threads with it (left to the interpreter's exit, a gloo thread still
    at work there aborts the process)."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        tp = TensorParallel.of_default_group()
        for name, path, kv_scale in jobs:
            model, config = load_model(path, torch.float32, "cpu", TorchPagedAttention(), tp=tp)
            logits, tokens = generate(model, config, kv_scale)
            torch.save(
                {"logits": logits, "tokens": tokens, "kv_heads": model.shard.kv_heads},
                out / f"{name}-rank{rank}.pt",
            )
        dist.barrier()  # no rank leaves the group while a peer still talks to it
    finally:
        dist.destroy_process_group()
    assert group_threads() == []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("size", [2, 3])
def test_shards_match_one_process(size: int, tmp_path: Path) -> None:
    """Every case of this size, its ranks spawned once: each rank's greedy tokens are one
    process's, its logits within TOLERANCE."""
    jobs, expected = [], {}
    for name, (case_size, build, kv_scale) in CASES.items():
        if case_size == size:
            path = build(tmp_path / name)
            model, config = load_model(path, torch.float32, "cpu", TorchPagedAttention())
            expected[name] = (config, *generate(model, config, kv_scale))
            jobs.append((name, path, kv_scale))
    mp.spawn(run_rank, args=(size, free_port(), jobs, tmp_path), nprocs=size)
    for name, (config, expected_logits, expected_tokens) in expected.items():
        for rank in range(size):
            seen = torch.load(tmp_path / f"{name}-rank{rank}.pt")
            shard = ModelShard.of(config, TensorParallel(rank, size))
            assert seen["kv_heads"] == shard.kv_heads, name
            assert seen["tokens"] == expected_tokens, name
            for got, want in zip(seen["logits"], expected_logits, strict=True):
                assert rel_error(got, want) < TOLERANCE, name


def tiny_config(heads: int, kv_heads: int, vocab_size: int = 400) -> ModelConfig:
    return ModelConfig.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab_size,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": 16,
        }
    )


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "per_rank"),
    [
        (8, 4, 2, [(0, 1), (2, 3)]),  # split
        (8, 2, 4, [(0,), (0,), (1,), (1,)]),  # one each, shared by two ranks
        (6, 3, 2, [(0, 0, 1), (1, 2, 2)]),  # repeated to lcm(3, 2) = 6
        (6, 2, 3, [(0, 0), (0, 1), (1, 1)]),
    ],
)
def test_each_rank_holds_the_kv_heads_of_its_query_heads(
    heads: int, kv_heads: int, size: int, per_rank: list[tuple[int, ...]]
) -> None:
    config = tiny_config(heads, kv_heads)
    group = heads // kv_heads
    for rank, expected in enumerate(per_rank):
        shard = ModelShard.of(config, TensorParallel(rank, size))
        assert shard.kv_heads == expected
        local_group = shard.num_heads // shard.num_kv_heads
        for i, head in enumerate(shard.heads):
            assert shard.kv_heads[i // local_group] == head // group


def test_vocabulary_rows_are_padded_alike() -> None:
    config = tiny_config(6, 2, vocab_size=400)
    shards = [ModelShard.of(config, TensorParallel(rank, 3)) for rank in range(3)]
    assert [s.vocab for s in shards] == [range(0, 134), range(134, 268), range(268, 400)]
    assert {s.vocab_rows for s in shards} == {134}
    assert sum(s.intermediate_size for s in shards) == config.intermediate_size


def test_query_heads_not_divisible_are_refused() -> None:
    with pytest.raises(
        ModelLoadError, match=r"num_attention_heads \(4\).*tensor_parallel_size \(3\)"
    ):
        ModelShard.of(tiny_config(4, 2), TensorParallel(0, 3))


def test_a_rank_reads_only_its_rows(tmp_path: Path) -> None:
    """No process group is needed to load a shard: only its forward runs collectives."""
    directory = write_tiny_model(tmp_path, "qwen2", num_attention_heads=6, hidden_size=96)
    model, config = load_model(
        directory, torch.float32, "cpu", TorchPagedAttention(), tp=TensorParallel(1, 3)
    )
    whole, _ = load_model(directory, torch.float32, "cpu", TorchPagedAttention())
    attn, whole_attn = model.model.layers[0].self_attn, whole.model.layers[0].self_attn
    q, kv = config.q_size, config.kv_size
    # Rank 1 of 3: query heads 2-3, KV heads 0 and 1 (each 16 rows).
    torch.testing.assert_close(attn.qkv_proj.weight[:32], whole_attn.qkv_proj.weight[32:64])
    torch.testing.assert_close(attn.qkv_proj.bias[32:64], whole_attn.qkv_proj.bias[q : q + 32])
    torch.testing.assert_close(
        attn.qkv_proj.weight[64:], whole_attn.qkv_proj.weight[q + kv : q + 2 * kv]
    )
    torch.testing.assert_close(attn.o_proj.weight, whole_attn.o_proj.weight[:, 32:64])
    embed = model.model.embed_tokens.weight
    assert embed.shape[0] == -(-config.vocab_size // 3)


def test_a_rank_reads_its_rows_of_each_fused_part(tmp_path: Path) -> None:
    """Phi-3's checkpoint stacks q/k/v in one qkv_proj and gate/up in one gate_up_proj."""
    directory = write_tiny_model(tmp_path, "phi3", **SIX_HEADS)
    model, config = load_model(
        directory, torch.float32, "cpu", TorchPagedAttention(), tp=TensorParallel(1, 3)
    )
    whole, _ = load_model(directory, torch.float32, "cpu", TorchPagedAttention())
    layer, whole_layer = model.model.layers[1], whole.model.layers[1]
    qkv, whole_qkv = layer.self_attn.qkv_proj.weight, whole_layer.self_attn.qkv_proj.weight
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    # Rank 1 of 3: query heads 2-3, KV heads 0 and 1 (each 16 rows), MLP rows 42-84.
    torch.testing.assert_close(qkv[:32], whole_qkv[32:64])
    torch.testing.assert_close(qkv[32:64], whole_qkv[q : q + kv])
    torch.testing.assert_close(qkv[64:], whole_qkv[q + kv :])
    gate_up, whole_gate_up = layer.mlp.gate_up_proj.weight, whole_layer.mlp.gate_up_proj.weight
    torch.testing.assert_close(gate_up[:43], whole_gate_up[42:85])
    torch.testing.assert_close(gate_up[43:], whole_gate_up[inter + 42 : inter + 85])


def test_a_rank_holds_every_expert_with_its_share_of_their_rows(tmp_path: Path) -> None:
    """Each expert's gate and up rows and down columns of the MoE's own intermediate size,
    the dense layer's of the dense size, the router whole."""
    directory = write_tiny_model(
        tmp_path,
        "qwen3_moe",
        num_attention_heads=6,
        hidden_size=96,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        mlp_only_layers=[1],
    )
    model, _ = load_model(
        directory, torch.float32, "cpu", TorchPagedAttention(), tp=TensorParallel(2, 3)
    )
    whole, _ = load_model(directory, torch.float32, "cpu", TorchPagedAttention())
    sparse, whole_sparse = model.model.layers[0].mlp, whole.model.layers[0].mlp
    torch.testing.assert_close(sparse.gate.weight, whole_sparse.gate.weight)
    gate_up, whole_gate_up = sparse.experts.gate_up_proj, whole_sparse.experts.gate_up_proj
    assert gate_up.shape == (4, 2 * 11, 96)  # rank 2 of 3: rows 21-31 of 32
    torch.testing.assert_close(gate_up[:, :11], whole_gate_up[:, 21:32])
    torch.testing.assert_close(gate_up[:, 11:], whole_gate_up[:, 53:64])
    torch.testing.assert_close(sparse.experts.down_proj, whole_sparse.experts.down_proj[..., 21:])
    dense, whole_dense = model.model.layers[1].mlp, whole.model.layers[1].mlp
    torch.testing.assert_close(dense.down_proj.weight, whole_dense.down_proj.weight[:, 85:])


# A layer's projections, and the checkpoint projections merged into each, in order.
MERGED = {
    "self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "self_attn.o_proj": ("o_proj",),
    "mlp.gate_up_proj": ("gate_proj", "up_proj"),
    "mlp.down_proj": ("down_proj",),
}
ROW_PARALLEL = ("self_attn.o_proj", "mlp.down_proj")


def rank_part(
    whole: torch.Tensor, projection: str, config: ModelConfig, shard: ModelShard
) -> torch.Tensor:
    """What `shard` holds of a one-process projection's weight or row scales: each merged
    part's rows of a column-parallel one; a row-parallel one's columns, its row scales whole."""
    if projection in ROW_PARALLEL:
        _, columns = shard.checkpoint_index(f"{projection}.weight")
        return whole if whole.dim() == 1 else whole[:, list(columns)]
    sizes = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size}
    parts = MERGED[projection]
    pieces = whole.split([sizes.get(part, config.intermediate_size) for part in parts])
    module = projection.rpartition(".")[0]
    return torch.cat(
        [
            piece[list(shard.checkpoint_index(f"{module}.{part}.weight")[1])]
            for piece, part in zip(pieces, parts, strict=True)
        ]
    )


def as_bytes(weight: torch.Tensor) -> torch.Tensor:
    """fp8 weights as their bytes: what indexing and torch.equal take."""
    return weight.view(torch.uint8) if weight.dtype == FP8 else weight


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_ranks_dequantized_fp8_projections_are_its_part_of_one_process(
    scheme: str, tmp_path: Path
) -> None:
    source = write_tiny_model(tmp_path / "model", "qwen2")
    fp8_dir, _ = write_fp8(source, tmp_path, scheme, (16, 32))
    whole = load(fp8_dir)
    for rank in range(2):
        model = load(fp8_dir, tp=TensorParallel(rank, 2))
        for projection in MERGED:
            name = f"model.layers.1.{projection}"
            expected = rank_part(
                whole.get_submodule(name).weight, projection, whole.config, model.shard
            )
            assert torch.equal(model.get_submodule(name).weight, expected), (rank, name)


@pytest.mark.usefixtures("fp8_runs")
@pytest.mark.parametrize("scheme", [*SCHEMES, "quantized on load"])
def test_a_ranks_fp8_projections_are_its_part_of_one_process(scheme: str, tmp_path: Path) -> None:
    """Fp8Linear's fp8 rows and row scales (built on the CPU here as where fp8 runs). A
    rank's rows requantized from a block checkpoint or its own weight have the scales of
    its own columns: a row-parallel rank's row scales are those of its columns alone."""
    source = write_tiny_model(tmp_path / "model", "qwen2")
    if scheme == "quantized on load":
        directory, plain_dir, options = source, source, {"quantization": "fp8"}
    else:
        directory, plain_dir = write_fp8(source, tmp_path, scheme, (16, 32))
        options = {}
    whole, plain = load(directory, **options), load(plain_dir)
    requantized = scheme in ("block", "quantized on load")
    for rank in range(2):
        model = load(directory, tp=TensorParallel(rank, 2), **options)
        for projection in MERGED:
            name = f"model.layers.1.{projection}"
            if requantized and projection in ROW_PARALLEL:
                columns = rank_part(
                    plain.get_submodule(name).weight, projection, whole.config, model.shard
                )
                weight, scale = quantize_rows(columns)
            else:
                expected = whole.get_submodule(name)
                weight, scale = (
                    rank_part(as_bytes(t), projection, whole.config, model.shard)
                    for t in (expected.weight, expected.weight_scale)
                )
            got = model.get_submodule(name)
            assert torch.equal(as_bytes(got.weight), as_bytes(weight)), (rank, name)
            assert torch.equal(got.weight_scale, scale.view(-1)), (rank, name)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_an_fp8_mixture_of_experts_shard_is_that_of_its_dequantized_weights(
    scheme: str, tmp_path: Path
) -> None:
    """Each expert's scales split with its rows (gate, up) and columns (down) of 16."""
    source = write_tiny_model(
        tmp_path / "model", "qwen3_moe", moe_intermediate_size=32, mlp_only_layers=[1]
    )
    fp8_dir, plain_dir = write_fp8(source, tmp_path, scheme, (16, 16))
    for rank in range(2):
        tp = TensorParallel(rank, 2)
        got, want = load(fp8_dir, tp=tp).state_dict(), load(plain_dir, tp=tp).state_dict()
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert torch.equal(got[name], value), (rank, name)


def test_fp8_blocks_a_rank_would_share_are_refused(tmp_path: Path) -> None:
    """Blocks of 48 rows: gate_proj's 128 rows split at 64 leave block 1 on both ranks."""
    source = write_tiny_model(tmp_path / "model", "qwen2")
    fp8_dir, _ = write_fp8(source, tmp_path, "block", (48, 32))
    with pytest.raises(
        ModelLoadError,
        match=r"fp8 tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' \[128, 64\]: a "
        r"tensor-parallel shard holds rows 0\.\.63 of its 128, not whole blocks of "
        r"weight_block_size \[48, 32\]; choose a tensor_parallel_size that splits its 128 "
        r"rows on multiples of 48",
    ):
        load(fp8_dir, tp=TensorParallel(0, 2))


def test_a_ranks_kv_blocks_hold_its_kv_heads_only(tmp_path: Path) -> None:
    """The pool is sized by the bytes of the KV heads a rank holds, not the model's."""
    directory = write_tiny_model(tmp_path, "llama", num_attention_heads=6, hidden_size=96)
    model, config = load_model(
        directory, torch.float32, "cpu", TorchPagedAttention(), tp=TensorParallel(0, 2)
    )
    assert (config.num_kv_heads, model.shard.num_kv_heads) == (2, 1)
    whole = kv_bytes_per_block(config, 16, torch.float32)
    assert kv_bytes_per_block(config, 16, torch.float32, model.shard.num_kv_heads) == whole // 2


def report_smallest(rank: int, size: int, port: int, out: Path) -> None:
    """One rank of three offering 20, 17 and 14 KV blocks: what each is told."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        tp = TensorParallel.of_default_group()
        agreed = tp.smallest(20 - 3 * rank, torch.device("cpu"))
        (out / f"smallest{rank}").write_text(str(agreed))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_the_pool_the_smallest_fits(tmp_path: Path) -> None:
    mp.spawn(report_smallest, args=(3, free_port(), tmp_path), nprocs=3)
    assert [(tmp_path / f"smallest{rank}").read_text() for rank in range(3)] == ["14"] * 3
