"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral) against transformers, in float32.

Tiny random checkpoints written by transformers itself cover the router (top-k with and
without renormalisation), stacked experts loaded from per-expert tensors, and Qwen3-MoE's
dense layers (`mlp_only_layers`, `decoder_sparse_step`). The offline LLM generates greedily
through the whole engine; the paged runner of test_model_parity checks logits, including a
step that mixes sequences, whose tokens then share experts.
"""

from __future__ import annotations

import gguf
import grpc
import httpx2 as httpx
import pytest
import torch
import transformers

from engine.attention.torch_backend import TorchPagedAttention
from engine.errors import ModelLoadError
from engine.llm import LLM
from engine.model.config import ModelConfig
from engine.model.loader import load_model
from engine.model.moe import SparseMoeBlock
from engine.sampling_params import SamplingParams
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from tests.server_process import free_port, running_server
from tests.test_model_parity import (
    TOLERANCE,
    PagedRunner,
    one_intra_op_thread,  # noqa: F401 (an autouse fixture: one thread for tiny models)
    prompt_ids,
    reference_logits,
    rel_error,
)
from tests.tiny_models import write_tiny_model

GREEDY = dict(temperature=0.0, ignore_eos=True)
NUM_NEW_TOKENS = 48

# name -> (model_type, write_tiny_model keyword arguments)
TINY_MOE_MODELS = {
    # Layer 1 dense by mlp_only_layers; top-3 of 8, weights not renormalised.
    "qwen3-moe": (
        "qwen3_moe",
        dict(
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    # Every second layer sparse; renormalised top-2.
    "qwen3-moe-step2": (
        "qwen3_moe",
        dict(
            num_hidden_layers=4,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            decoder_sparse_step=2,
        ),
    ),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.fixture(scope="module", params=list(TINY_MOE_MODELS))
def tiny_moe(request, tmp_path_factory):
    """(checkpoint directory, transformers' model) for one tiny MoE checkpoint."""
    model_type, overrides = TINY_MOE_MODELS[request.param]
    directory = write_tiny_model(tmp_path_factory.mktemp(request.param), model_type, **overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    return directory, reference.eval()


def hf_greedy(reference, prompt: list[int]) -> list[int]:
    """transformers' greedy continuation, end tokens included (as ignore_eos): each step is
    a full forward, which generate() would replace with min_new_tokens, masking the end."""
    ids = list(prompt)
    while len(ids) < len(prompt) + NUM_NEW_TOKENS:
        ids.append(int(reference_logits(reference, ids)[-1].argmax()))
    return ids[len(prompt) :]


def test_layers_are_sparse_where_transformers_makes_them(tiny_moe):
    directory, reference = tiny_moe
    model, config = load_model(directory, torch.float32, "cpu", TorchPagedAttention())
    ours = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in reference.model.layers]
    assert ours == theirs and any(ours)


def test_logits_match_transformers(tiny_moe):
    """Last-position and all-position logits: prefill, chunked prefill, decode, mixed step."""
    directory, reference = tiny_moe
    model, config = load_model(directory, torch.float32, "cpu", TorchPagedAttention())
    check_mixed_step(model, config, reference)


def check_mixed_step(model, config, reference) -> None:
    """Logits of three sequences in one step: a decode, a whole prompt, a prompt's second
    chunk, each against transformers' over the whole sequence."""
    a, b, c = (prompt_ids(config.vocab_size, n, seed=n) for n in (37, 21, 30))
    runner = PagedRunner(model, config)
    runner.step([(1, b[:20]), (2, c[:13])])  # b then decodes, c prefills its second chunk
    got_b, got_a, got_c = runner.step([(1, b[20:]), (0, a), (2, c[13:])])
    for ids, got in ((a, got_a), (b, got_b), (c, got_c)):
        expected = reference_logits(reference, ids)[-len(got) :]
        assert rel_error(got[-1], expected[-1]) < TOLERANCE
        assert rel_error(got, expected) < TOLERANCE


def test_offline_llm_greedy_matches_transformers(tiny_moe):
    check_offline_greedy(*tiny_moe)


def test_prefix_caching_and_preemption_keep_outputs(tiny_moe):
    check_prefix_caching_and_preemption(*tiny_moe)


def check_offline_greedy(directory, reference) -> None:
    """The offline LLM's greedy tokens for four prompts of 5 to 31 tokens are transformers'."""
    llm = LLM(str(directory), num_blocks=256, block_size=4)
    vocab = llm.engine.model_config.vocab_size
    prompts = [prompt_ids(vocab, n, seed=20 + n) for n in (5, 12, 19, 31)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW_TOKENS, **GREEDY))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(reference, prompt)


def check_prefix_caching_and_preemption(directory, reference) -> None:
    """A pool too small for the batch (preemption), shared prefixes (cache hits) and a
    token budget that chunks prompts: the same greedy tokens as transformers."""
    llm = LLM(str(directory), num_blocks=40, block_size=4, max_num_batched_tokens=24)
    vocab = llm.engine.model_config.vocab_size
    shared = prompt_ids(vocab, 20, seed=5)
    prompts = [shared + prompt_ids(vocab, 3 + 5 * i, seed=30 + i) for i in range(6)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NUM_NEW_TOKENS, **GREEDY))
    for prompt, output in zip(prompts, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(reference, prompt)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.hit_tokens > 0


# --- configs and files we refuse -------------------------------------------------------


def moe_config_json(**overrides) -> dict:
    config = transformers.AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
    ).to_dict()
    return config | {"architectures": ["Qwen3MoeForCausalLM"]} | overrides


def test_config_reads_moe_fields():
    config = ModelConfig.from_hf_config(moe_config_json(mlp_only_layers=[0], norm_topk_prob=True))
    assert config.qk_norm and config.moe is not None
    assert (config.moe.num_experts, config.moe.num_experts_per_tok) == (4, 2)
    assert config.moe.norm_topk_prob and config.moe.mlp_only_layers == (0,)
    assert [config.moe.is_sparse_layer(i) for i in range(2)] == [False, True]


@pytest.mark.parametrize(
    "key,value",
    [("num_experts_per_tok", 5), ("num_experts_per_tok", 0), ("decoder_sparse_step", 0)],
)
def test_unsupported_moe_value_is_named(key, value):
    with pytest.raises(ModelLoadError, match=f"^unsupported MoE config value {key}={value}"):
        ModelConfig.from_hf_config(moe_config_json(**{key: value}))


def test_gguf_moe_is_refused(tmp_path):
    """llama.cpp writes Mixtral as architecture "llama" with an expert count."""
    path = tmp_path / "mixtral.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_expert_count(8)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF mixture-of-experts models are not supported"):
        load_model(path, torch.float32, "cpu", TorchPagedAttention())


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_bfloat16_block_matches_transformers(model_type, monkeypatch):
    """One MoE block in bfloat16, bit for bit, where the dtype the router weights are applied
    in shows (Mixtral: float32; Qwen3-MoE: the model's dtype). With transformers' matmul:
    the CPU's linear() takes another library at some row counts, which rounds differently."""
    monkeypatch.setattr("engine.model.moe.linear", torch.nn.functional.linear)
    hf_config = transformers.AutoConfig.for_model(
        model_type, hidden_size=32, intermediate_size=48, moe_intermediate_size=48,
        num_experts=6, num_local_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=1,
    )  # fmt: skip
    config = ModelConfig.from_hf_config(hf_config.to_dict())
    torch.manual_seed(0)
    # The modeling file's loop, not the grouped matmul transformers picks by default.
    reference = transformers.AutoModelForCausalLM.from_config(
        hf_config, experts_implementation="eager"
    )
    block = reference.model.layers[0].mlp
    for param in block.parameters():
        param.data.normal_(0.0, 0.3)
    ours = SparseMoeBlock(config, config.moe)
    ours.load_state_dict(block.state_dict())
    block, ours = block.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = torch.randn(1, 40, 32).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(ours(x[0]), block(x)[0])


def test_served_by_both_doors_as_transformers_answers(tmp_path):
    """`pagedserve serve` with a MoE checkpoint: gRPC Generate's greedy tokens are
    transformers', and the REST door answers the same prompt with the same text."""
    model_type, overrides = TINY_MOE_MODELS["qwen3-moe"]
    directory = write_tiny_model(tmp_path / "model", model_type, **overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    prompt = prompt_ids(reference.config.vocab_size, 12, seed=7)
    expected = hf_greedy(reference.eval(), prompt)
    http_port = free_port()
    with running_server(directory, "--http-port", str(http_port), "--num-blocks", "64") as server:
        with grpc.insecure_channel(server.target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingOptions(temperature=0.0),
                stopping=pb.StoppingOptions(max_tokens=NUM_NEW_TOKENS, ignore_eos=True),
            )
            candidate = stub.Generate(request, timeout=60).candidates[0]
        body = {"prompt": prompt, "max_tokens": NUM_NEW_TOKENS, **GREEDY}
        completion = httpx.post(
            f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60
        ).json()
    assert list(candidate.token_ids) == expected
    assert completion["choices"][0]["text"] == candidate.text
