"""Gemma 3 (text) against transformers' eager attention, in float32.

Tiny random checkpoints written by transformers itself, with a sliding window of 8 between
global layers: prompts and generations run well past the window, so every sliding layer
drops keys while the global ones keep them. They cover both rope bases (one with linear
scaling on the global layers), query_pre_attn_scalar, final logit soft-capping, tied and
untied heads; the offline LLM generates greedily through the whole engine, also with
prefix caching and preemption.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from engine.attention.torch_backend import TorchPagedAttention
from engine.errors import ModelLoadError
from engine.model.config import ModelConfig
from engine.model.loader import load_model
from tests.test_model_parity import (
    TOLERANCE,
    PagedRunner,
    one_intra_op_thread,  # noqa: F401 (an autouse fixture: one thread for tiny models)
    prompt_ids,
    reference_logits,
    rel_error,
)
from tests.test_moe_parity import (
    check_mixed_step,
    check_offline_greedy,
    check_prefix_caching_and_preemption,
)
from tests.tiny_models import write_tiny_model

WINDOW = 8
S, F = "sliding_attention", "full_attention"

# name -> write_tiny_model keyword arguments
TINY_GEMMA3_MODELS = {
    "gemma3": dict(
        num_hidden_layers=4,
        layer_types=[S, F, S, S],
        tie_word_embeddings=True,
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
    ),
    "gemma3-linear-rope-untied": dict(
        num_hidden_layers=3,
        layer_types=[S, S, F],
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_parameters={
            F: {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
            S: {"rope_type": "default", "rope_theta": 500.0},
        },
    ),
}


@pytest.fixture(scope="module", params=list(TINY_GEMMA3_MODELS))
def tiny_gemma3(request, tmp_path_factory):
    """(checkpoint directory, transformers' model with eager attention)."""
    directory = write_tiny_model(
        tmp_path_factory.mktemp(request.param),
        "gemma3_text",
        sliding_window=WINDOW,
        **TINY_GEMMA3_MODELS[request.param],
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    )
    return directory, reference.eval()


def test_logits_match_transformers(tiny_gemma3):
    """Whole prefill, chunked prefill, one token at a time and a mixed step, all past the
    window."""
    directory, reference = tiny_gemma3
    model, config = load_model(directory, torch.float32, "cpu", TorchPagedAttention())
    assert config.gemma3.has_sliding_layers
    check_mixed_step(model, config, reference)
    a = prompt_ids(config.vocab_size, 37)
    runner = PagedRunner(model, config)
    rows = [runner.step([(3, a[:3])])[0]] + [runner.step([(3, [t])])[0] for t in a[3:]]
    expected = reference_logits(reference, a)
    assert rel_error(rows[-1][-1], expected[-1]) < TOLERANCE
    assert rel_error(torch.cat(rows), expected) < TOLERANCE


def test_offline_llm_greedy_matches_transformers(tiny_gemma3):
    """Prompts of 5 (its decode crosses the window) to 31 tokens."""
    check_offline_greedy(*tiny_gemma3)


def test_prefix_caching_and_preemption_keep_outputs(tiny_gemma3):
    check_prefix_caching_and_preemption(*tiny_gemma3)


# --- configs and backends we refuse ----------------------------------------------------


def gemma3_config_json(**overrides) -> dict:
    config = transformers.AutoConfig.for_model(
        "gemma3_text",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        sliding_window=WINDOW,
    ).to_dict()
    return config | overrides


def test_config_reads_the_older_flat_layout():
    """transformers < 5 (and the published checkpoints): a sliding_window_pattern, flat rope
    keys with rope_local_base_freq for the local layers."""
    d = gemma3_config_json(
        architectures=["Gemma3ForCausalLM"],
        sliding_window_pattern=2,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        d.pop(key, None)
    config = ModelConfig.from_hf_config(d)
    assert config.gemma3.layer_windows == (WINDOW, None, WINDOW, None)
    assert (config.rope_theta, config.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0})
    assert config.gemma3.local_rope_theta == 10_000.0


def test_backends_are_configured_with_the_models_scale_and_windows():
    d = gemma3_config_json(query_pre_attn_scalar=24, layer_types=[S, F, S, S])
    config = ModelConfig.from_hf_config(d)
    assert config.attention_scale == 24**-0.5  # not head_dim's
    assert config.attention_windows == (WINDOW, None)  # each distinct one, once
    qwen = ModelConfig.from_hf_config(
        transformers.AutoConfig.for_model("qwen3", head_dim=64).to_dict()
    )
    assert (qwen.attention_scale, qwen.attention_windows) == (64**-0.5, (None,))


@pytest.mark.parametrize(
    "key,value",
    [
        ("attn_logit_softcapping", 50.0),
        ("use_bidirectional_attention", True),
        ("hidden_activation", "gelu"),
        ("sliding_window", None),
    ],
)
def test_unsupported_gemma3_value_is_named(key, value):
    with pytest.raises(ModelLoadError, match=f"^unsupported Gemma 3 config value {key}="):
        ModelConfig.from_hf_config(gemma3_config_json(**{key: value}))


def test_unsupported_global_rope_type_is_named():
    rope = gemma3_config_json()["rope_parameters"]
    rope[F] = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6}
    with pytest.raises(ModelLoadError, match="^unsupported Gemma 3 config value rope_scaling="):
        ModelConfig.from_hf_config(gemma3_config_json(rope_parameters=rope))


class NoWindowBackend(TorchPagedAttention):
    supports_sliding_window = False


def test_backend_without_sliding_windows_is_refused_at_load(tmp_path):
    directory = write_tiny_model(tmp_path, "gemma3_text", sliding_window=WINDOW)
    with pytest.raises(ModelLoadError, match="^Gemma 3 needs sliding-window attention"):
        load_model(directory, torch.float32, "cpu", NoWindowBackend())
