"""Tensor parallelism on the CPU: N gloo processes, each holding its shard of a tiny
checkpoint, give the logits and greedy tokens of the whole model in one process."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.attention.torch_backend import TorchPagedAttention
from engine.errors import ModelLoadError
from engine.kv.fp8 import FP8_DTYPE, set_kv_scales
from engine.kv.pool import kv_bytes_per_block
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.parallel.group import TensorParallel
from engine.parallel.shard import ModelShard
from tests.test_fp8_weights import write_fp8
from tests.test_model_parity import (  # noqa: F401 (one_intra_op_thread: autouse)
    PagedRunner,
    one_intra_op_thread,
    prompt_ids,
    rel_error,
)
from tests.tiny_models import write_tiny_gguf, write_tiny_model

TOLERANCE = 1e-4
DECODE_STEPS = 6

# name -> (arch, tensor-parallel size, write_tiny_model overrides)
CASES = {
    "llama-4-heads-2-kv-at-2": ("llama", 2, {}),
    "qwen3-at-2": ("qwen3", 2, {}),  # q/k norm
    # 2 KV heads at 3 ranks: repeated to 6 (2 a rank); vocabulary and MLP split unevenly.
    "llama-6-heads-2-kv-at-3": ("llama", 3, {"num_attention_heads": 6, "hidden_size": 96}),
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


def generate(
    model: LlamaForCausalLM, config: ModelConfig, kv_scale: float | None = None
) -> tuple[torch.Tensor, list[int]]:
    """float32 last-position logits of a prompt's prefill and of each greedy decode step
    after it, and the greedy tokens; with a kv_scale, over an fp8 KV pool of K and V
    scales kv_scale and 2 * kv_scale in every layer."""
    runner = PagedRunner(model, config)
    if kv_scale is not None:
        runner.kv_caches = [cache.to(FP8_DTYPE) for cache in runner.kv_caches]
        set_kv_scales(model, [(kv_scale, 2 * kv_scale)] * config.num_layers)
    rows = [runner.step([(0, prompt_ids(config.vocab_size, 21, seed=5))])[0][-1]]
    tokens: list[int] = []
    for _ in range(DECODE_STEPS):
        tokens.append(int(rows[-1].argmax()))
        rows.append(runner.step([(0, [tokens[-1]])])[0][-1])
    return torch.stack(rows).float(), tokens


def run_rank(
    rank: int, size: int, port: int, directory: Path, out: Path, kv_scale: float | None
) -> None:
    """One rank: its shard loaded and run; what it saw saved as rank{rank}.pt."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        tp = TensorParallel.of_default_group()
        model, config = load_model(directory, torch.float32, "cpu", TorchPagedAttention(), tp=tp)
        logits, tokens = generate(model, config, kv_scale)
        torch.save(
            {"logits": logits, "tokens": tokens, "kv_heads": model.shard.kv_heads},
            out / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("name", list(CASES))
def test_shards_match_one_process(name: str, tmp_path: Path) -> None:
    arch, size, overrides = CASES[name]
    assert_shards_match(write_tiny_model(tmp_path / "model", arch, **overrides), size, tmp_path)


@pytest.mark.parametrize(
    ("scheme", "block", "size", "overrides"),
    [
        ("channel", None, 2, {}),
        # 2 KV heads repeated to 6: each rank's two KV heads are whole blocks of 16 rows.
        (
            "block",
            (16, 16),
            3,
            {"num_attention_heads": 6, "hidden_size": 96, "intermediate_size": 96},
        ),
    ],
)
def test_fp8_checkpoint_shards_match_one_process(
    scheme: str, block: tuple[int, int] | None, size: int, overrides: dict, tmp_path: Path
) -> None:
    """On the CPU fp8 weights are dequantized as they load: each rank's with its part of
    the scales."""
    source = write_tiny_model(tmp_path / "model", "qwen2", **overrides)
    fp8_dir, _ = write_fp8(source, tmp_path, scheme, *([block] if block else []))
    assert_shards_match(fp8_dir, size, tmp_path)


def test_shards_match_one_process_over_an_fp8_kv_pool(tmp_path: Path) -> None:
    """Each layer's one K and one V scale hold for whichever KV heads a rank keeps."""
    directory = write_tiny_model(tmp_path / "model", "llama")
    assert_shards_match(directory, 2, tmp_path, kv_scale=0.02)


def assert_shards_match(
    directory: Path, size: int, tmp_path: Path, kv_scale: float | None = None
) -> None:
    """size ranks give the greedy tokens of one process, and its logits within TOLERANCE."""
    model, config = load_model(directory, torch.float32, "cpu", TorchPagedAttention())
    expected_logits, expected_tokens = generate(model, config, kv_scale)

    mp.spawn(run_rank, args=(size, free_port(), directory, tmp_path, kv_scale), nprocs=size)
    for rank in range(size):
        seen = torch.load(tmp_path / f"rank{rank}.pt")
        assert seen["kv_heads"] == ModelShard.of(config, TensorParallel(rank, size)).kv_heads
        assert seen["tokens"] == expected_tokens
        for got, expected in zip(seen["logits"], expected_logits, strict=True):
            assert rel_error(got, expected) < TOLERANCE


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


@pytest.mark.parametrize(
    ("arch", "overrides", "refused"),
    [
        ("gemma3_text", {"sliding_window": 16}, "Gemma 3"),
        ("phi3", {}, "fused"),
    ],
)
def test_what_has_no_shard_yet_is_refused(
    arch: str, overrides: dict, refused: str, tmp_path: Path
) -> None:
    directory = write_tiny_model(tmp_path, arch, **overrides)
    with pytest.raises(ModelLoadError, match=refused):
        load_model(directory, torch.float32, "cpu", TorchPagedAttention(), tp=TensorParallel(0, 2))


def test_gguf_is_refused(tmp_path: Path) -> None:
    gguf_path = write_tiny_gguf(write_tiny_model(tmp_path / "hf", "llama"), tmp_path / "m.gguf")
    with pytest.raises(ModelLoadError, match="GGUF"):
        load_model(gguf_path, torch.float32, "cpu", TorchPagedAttention(), tp=TensorParallel(0, 2))


def test_a_ranks_kv_blocks_hold_its_kv_heads_only(tmp_path: Path) -> None:
    """The pool is sized by the bytes of the KV heads a rank holds, not the model's."""
    directory = write_tiny_model(tmp_path, "llama", num_attention_heads=6, hidden_size=96)
    model, config = load_model(
        directory, torch.float32, "cpu", TorchPagedAttention(), tp=TensorParallel(0, 2)
    )
    assert (config.num_kv_heads, model.shard.num_kv_heads) == (2, 1)
    whole = kv_bytes_per_block(config, 16, torch.float32)
    assert kv_bytes_per_block(config, 16, torch.float32, model.shard.num_kv_heads) == whole // 2
