"""Every way a checkpoint can be wrong ends in a ModelLoadError that names the problem.
Also: what the config reader makes of the less common config.json layouts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention.torch_backend import TorchPagedAttention
from engine.errors import ModelLoadError
from engine.llm import LLM
from engine.model.config import ModelConfig
from engine.model.loader import load_model, read_hf_config
from engine.sampling_params import SamplingParams
from tests.tiny_models import write_tiny_gguf, write_tiny_model


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("pristine"), "llama")


@pytest.fixture
def model_dir(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of a valid tiny model that a test may break."""
    return Path(shutil.copytree(pristine, tmp_path / "model"))


def load(path: Path):
    return load_model(path, torch.float32, "cpu", TorchPagedAttention())


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_weights(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_valid_copy_loads(model_dir: Path):
    model, config = load(model_dir)
    assert config.architecture == "LlamaForCausalLM" and config.num_layers == 2
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (64 + 2 * 32, 64)
    tensors = [*model.parameters(), *model.buffers()]
    assert not any(t.is_meta for t in tensors)


def test_random_weights_need_no_checkpoint(model_dir: Path):
    for weights in model_dir.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(ModelLoadError, match="no .safetensors weights"):
        load(model_dir)
    model, config = load_model(
        model_dir, torch.float32, "cpu", TorchPagedAttention(), random_weights=True
    )
    params = dict(model.named_parameters())
    assert params["model.layers.0.input_layernorm.weight"].eq(1).all()
    projection = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert projection.shape == (64 + 2 * 32, 64)
    assert abs(projection.std().item() - 0.02) < 0.002
    # The engine setting takes the same road: it starts and generates from the config alone.
    llm = LLM(str(model_dir), load_format="dummy", num_blocks=64, block_size=4)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_missing_path(tmp_path: Path):
    with pytest.raises(ModelLoadError, match="model path does not exist: .*nowhere"):
        load(tmp_path / "nowhere")


def test_not_a_model_file(tmp_path: Path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="expected a model directory or a .gguf file"):
        load(path)


def test_missing_config_json(model_dir: Path):
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="no config.json in"):
        load(model_dir)


def test_unparsable_config_json(model_dir: Path):
    (model_dir / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot parse .*config.json"):
        load(model_dir)


def test_config_missing_required_key(model_dir: Path):
    config = json.loads((model_dir / "config.json").read_text())
    del config["hidden_size"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="config.json is missing the key 'hidden_size'"):
        load(model_dir)


def test_no_safetensors(model_dir: Path):
    (model_dir / "model.safetensors").unlink()
    (model_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(
        ModelLoadError, match=r"no \.safetensors weights in .*pytorch_model\.bin is not supported"
    ):
        load(model_dir)


def test_unsupported_architecture(model_dir: Path):
    edit_config(model_dir, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError) as error:
        load(model_dir)
    message = str(error.value)
    assert "unsupported architecture 'GPT2LMHeadModel'" in message
    for supported in (
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ):
        assert supported in message


def test_unsupported_rope_scaling(model_dir: Path):
    edit_config(
        model_dir, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}
    )
    with pytest.raises(
        ModelLoadError,
        match="unsupported rope_scaling type 'dynamic'.*default, linear, llama3, longrope, yarn",
    ):
        load(model_dir)


@pytest.mark.parametrize(
    ("scaling", "message"),
    [
        (
            {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "extrapolation": 2,
            },
            "unsupported rope_scaling field 'extrapolation' for rope_type 'yarn'",
        ),
        ({"rope_type": "llama3", "factor": 8.0}, "rope_scaling type 'llama3' needs the field"),
        (
            {
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [1.0] * 7,
                "original_max_position_embeddings": 32,
            },
            "long_factor has 7 values, expected 8",
        ),
    ],
)
def test_rope_scaling_fields_are_checked(model_dir: Path, scaling: dict, message: str):
    edit_config(model_dir, rope_parameters={**scaling, "rope_theta": 1e4})
    with pytest.raises(ModelLoadError, match=message):
        load(model_dir)


def test_partial_rotary_factor_refused(model_dir: Path):
    edit_config(model_dir, partial_rotary_factor=0.75)
    with pytest.raises(ModelLoadError, match="unsupported partial_rotary_factor 0.75"):
        load(model_dir)


def test_unsupported_rope_scaling_old_layout(model_dir: Path):
    edit_config(model_dir, rope_parameters=None, rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(ModelLoadError, match="unsupported rope_scaling type 'dynamic'"):
        load(model_dir)


def test_missing_tensor(model_dir: Path):
    edit_weights(model_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        ModelLoadError, match=r"missing 1 tensor\(s\): model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        load(model_dir)


def test_shape_mismatch_names_tensor_file_and_shapes(model_dir: Path):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)

    edit_weights(model_dir, shrink)
    with pytest.raises(ModelLoadError) as error:
        load(model_dir)
    assert str(error.value) == (
        "tensor 'model.layers.0.self_attn.k_proj.weight' in model.safetensors has shape "
        "(16, 64), expected (32, 64)"
    )


def test_config_disagreeing_with_weights(model_dir: Path):
    edit_config(model_dir, intermediate_size=96)
    with pytest.raises(
        ModelLoadError,
        match=r"mlp\.\w+_proj\.weight' in model\.safetensors has shape \(\d+, \d+\), expected \(\d+, \d+\)",
    ):
        load(model_dir)


def test_unexpected_tensor(model_dir: Path):
    edit_weights(
        model_dir, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)})
    )
    with pytest.raises(
        ModelLoadError,
        match="unexpected tensor 'model.layers.0.self_attn.o_proj.bias' in model.safetensors",
    ):
        load(model_dir)


def test_missing_shard(tmp_path: Path):
    directory = write_tiny_model(tmp_path / "sharded", "llama", shards=2)
    shard = sorted(directory.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(
        ModelLoadError,
        match=f"shard {shard.name} listed in model.safetensors.index.json is missing",
    ):
        load(directory)


def test_biased_o_proj_refused(model_dir: Path):
    edit_config(model_dir, attention_bias=True)
    with pytest.raises(
        ModelLoadError, match="attention_bias=true is not supported for LlamaForCausalLM"
    ):
        load(model_dir)


def test_gqa_heads_must_divide(model_dir: Path):
    edit_config(model_dir, num_key_value_heads=3)
    with pytest.raises(
        ModelLoadError,
        match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)",
    ):
        load(model_dir)


# --- GGUF ------------------------------------------------------------------------------


def test_gguf_garbage(tmp_path: Path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="cannot read GGUF file .*model.gguf"):
        load(path)


def test_gguf_unsupported_architecture(tmp_path: Path):
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        ModelLoadError, match="unsupported GGUF architecture 'gpt2'; supported: llama, qwen2, qwen3"
    ):
        load(path)


def test_gguf_rope_freqs_refused(pristine: Path, tmp_path: Path):
    rope_freqs = {"rope_freqs.weight": np.ones(8, dtype=np.float32)}
    path = write_tiny_gguf(pristine, tmp_path / "llama31.gguf", extra_tensors=rope_freqs)
    with pytest.raises(ModelLoadError, match="rope_freqs.weight .* not supported"):
        load(path)


def test_gguf_unknown_tensor(pristine: Path, tmp_path: Path):
    extra = {"blk.0.attn_qkv.weight": np.zeros((4, 64), dtype=np.float32)}
    path = write_tiny_gguf(pristine, tmp_path / "odd.gguf", extra_tensors=extra)
    with pytest.raises(ModelLoadError, match="unexpected GGUF tensor 'blk.0.attn_qkv.weight'"):
        load(path)


# --- config.json layouts ---------------------------------------------------------------

BASE_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "eos_token_id": [7, 9],
}


def test_old_rope_layout_is_read():
    config = ModelConfig.from_hf_config(
        {**BASE_CONFIG, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert config.rope_theta == 5e5
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.head_dim == 16 and config.eos_token_ids == (7, 9)


def test_new_rope_layout_is_read():
    params = {"rope_type": "default", "rope_theta": 1e6}
    config = ModelConfig.from_hf_config({**BASE_CONFIG, "rope_parameters": params})
    assert config.rope_theta == 1e6 and config.rope_scaling is None


def test_model_type_stands_in_for_architectures():
    d = {**BASE_CONFIG, "model_type": "qwen3"}
    del d["architectures"]
    config = ModelConfig.from_hf_config(d)
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm


def test_sliding_window_caps_context():
    """We attend over the full context, exact only while it fits in the window."""
    mistral = {**BASE_CONFIG, "architectures": ["MistralForCausalLM"], "sliding_window": 512}
    assert ModelConfig.from_hf_config(mistral).max_position_embeddings == 512
    assert (
        ModelConfig.from_hf_config({**mistral, "sliding_window": None}).max_position_embeddings
        == 2048
    )
    qwen2 = {**BASE_CONFIG, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 512}
    assert ModelConfig.from_hf_config(qwen2).max_position_embeddings == 2048  # window unused
    qwen2_windowed = {**qwen2, "use_sliding_window": True}
    assert ModelConfig.from_hf_config(qwen2_windowed).max_position_embeddings == 512


def test_phi3_hub_config_is_read():
    """Phi-3-mini-128k's layout: the original context at the top level, no factor, and the
    older rope type name that transformers reads as longrope."""
    scaling = {"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    phi3 = {
        **BASE_CONFIG,
        "architectures": ["Phi3ForCausalLM"],
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rope_scaling": scaling,
        "sliding_window": 262144,
    }
    config = ModelConfig.from_hf_config(phi3)
    assert config.rope_scaling == {
        "rope_type": "longrope",
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "original_max_position_embeddings": 4096,
        "factor": 32.0,
    }
    assert config.max_position_embeddings == 131072  # the window is longer than the context
    mini_4k = {
        **phi3,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "sliding_window": 2047,
    }
    assert ModelConfig.from_hf_config(mini_4k).max_position_embeddings == 2047


def test_generation_config_adds_eos_ids(model_dir: Path):
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert read_hf_config(model_dir).eos_token_ids == (2, 5)
