"""fp8 weights on the CPU: checkpoints in the published layouts load as their dequantized
values exactly; what fp8 cannot load fails in one line; the Fp8Linear layout (fp8 rows,
one scale per row) that CUDA runs is built here too, with the device check patched, and
its merged projections checked against their parts."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention.torch_backend import TorchPagedAttention
from engine.errors import ModelLoadError, ValidationError
from engine.kernels.fp8_linear import FP8, FP8_MAX, quantize_rows
from engine.llm import LLM
from engine.model import loader
from engine.model.fp8 import Fp8Linear
from engine.model.loader import load_model
from engine.sampling_params import SamplingParams
from tests.tiny_models import write_tiny_model

# Projections an fp8 checkpoint holds in fp8 (transformers' names; Phi-3's come merged).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROJECTIONS += ("qkv_proj", "gate_up_proj")
# Blocks that do not divide the tiny model's 64 / 128 rows and columns: partial blocks too.
BLOCK = (48, 32)
SCHEMES = ("block", "tensor", "channel")


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("fp8-source"), "qwen2")  # with qkv bias


def quantize(
    weight: torch.Tensor, scheme: str, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, its checkpoint scale) as a published checkpoint holds them."""
    n, k = weight.shape
    if scheme == "tensor":
        scale = weight.abs().amax() / FP8_MAX
        return (weight / scale).to(FP8), scale
    if scheme == "channel":
        fp8, scale = quantize_rows(weight)
        return fp8, scale  # [N, 1]
    bn, bk = block
    blocks = torch.zeros(math.ceil(n / bn), math.ceil(k / bk))
    for i in range(blocks.shape[0]):
        for j in range(blocks.shape[1]):
            blocks[i, j] = weight[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].abs().amax()
    scale = blocks / FP8_MAX
    return (weight / per_element(scale, n, k, block)).to(FP8), scale


def per_element(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize(
    fp8: torch.Tensor, scale: torch.Tensor, scheme: str, block: tuple[int, int]
) -> torch.Tensor:
    if scheme == "block":
        return fp8.float() * per_element(scale, *fp8.shape, block)
    return fp8.float() * scale


def write_fp8(
    source: Path, directory: Path, scheme: str, block: tuple[int, int] = BLOCK
) -> tuple[Path, Path]:
    """(an fp8 checkpoint of `source`, a plain one of its dequantized weights)."""
    fp8_dir = Path(shutil.copytree(source, directory / f"fp8-{scheme}"))
    plain_dir = Path(shutil.copytree(source, directory / f"dequantized-{scheme}"))
    weights = load_file(source / "model.safetensors")
    fp8_weights, plain = dict(weights), dict(weights)
    for name, weight in weights.items():
        if name.split(".")[-2] not in PROJECTIONS or not name.endswith(".weight"):
            continue
        fp8, scale = quantize(weight.float(), scheme, block)
        fp8_weights[name] = fp8
        stem = name.removesuffix(".weight")
        if scheme == "block":
            fp8_weights[stem + ".weight_scale_inv"] = scale
        else:
            fp8_weights[stem + ".weight_scale"] = scale
            fp8_weights[stem + ".input_scale"] = torch.tensor(0.05)  # static, per tensor
        plain[name] = dequantize(fp8, scale, scheme, block)
    save_file(fp8_weights, fp8_dir / "model.safetensors")
    save_file(plain, plain_dir / "model.safetensors")
    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if scheme == "block":
        quantization["weight_block_size"] = list(block)
    else:
        quantization["activation_scheme"] = "static"
    edit_config(fp8_dir, quantization_config=quantization)
    return fp8_dir, plain_dir


def edit_config(directory: Path, **changes) -> None:
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def load(directory: Path, **options):
    return load_model(directory, torch.float32, "cpu", TorchPagedAttention(), **options)[0]


@pytest.fixture(scope="module", params=SCHEMES)
def checkpoints(request, bf16_dir, tmp_path_factory) -> tuple[Path, Path, str]:
    scheme = request.param
    return (*write_fp8(bf16_dir, tmp_path_factory.mktemp("fp8"), scheme), scheme)


def test_an_fp8_checkpoint_loads_as_its_dequantized_weights_exactly(checkpoints):
    fp8_dir, plain_dir, _ = checkpoints
    got, want = load(fp8_dir).state_dict(), load(plain_dir).state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_an_fp8_checkpoint_generates_what_its_dequantized_weights_do(checkpoints):
    fp8_dir, plain_dir, _ = checkpoints
    prompts = [[5, 9, 31, 200, 7], list(range(40, 77))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    outputs = [
        LLM(str(path), device="cpu", num_blocks=32, block_size=16).generate(prompts, params)
        for path in (fp8_dir, plain_dir)
    ]
    # The weights are equal, their addresses not: a CPU matmul may sum in another order for
    # another alignment, so logprobs agree to float32 rounding, not bit for bit.
    for got, want in zip(*outputs, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        torch.testing.assert_close(
            [lp.logprob for lp in got.outputs[0].logprobs],
            [lp.logprob for lp in want.outputs[0].logprobs],
            rtol=0,
            atol=1e-5,
        )


@pytest.fixture
def fp8_runs(monkeypatch):
    """The loader builds Fp8Linear modules on the CPU, as on an fp8-capable GPU."""
    monkeypatch.setattr(loader, "fp8_linear_runs", lambda device: True)


def test_merged_projections_keep_each_parts_fp8_rows_and_scales(checkpoints, fp8_runs):
    fp8_dir, plain_dir, scheme = checkpoints
    model, plain = load(fp8_dir), load(plain_dir)
    checkpoint = load_file(fp8_dir / "model.safetensors")
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.qkv_proj, Fp8Linear) and isinstance(attn.o_proj, Fp8Linear)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, Fp8Linear)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # never fp8
    assert model.lm_head.weight.dtype == torch.float32
    for module, parts in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", ("gate", "up"))):
        merged = model.get_submodule(f"model.layers.1.{module}")
        dequantized = merged.weight.float() * merged.weight_scale[:, None]
        want = plain.get_submodule(f"model.layers.1.{module}").weight
        if scheme == "block":  # requantized by row: within e4m3's step (2^-3 relative)
            assert ((dequantized - want).abs() <= want.abs() / 8 + 1e-6).all()
            continue
        assert torch.equal(dequantized, want)  # per-tensor and per-row scales: exact
        start = 0
        for part in parts:
            name = f"model.layers.1.{module.rpartition('.')[0]}.{part}_proj"
            fp8 = checkpoint[f"{name}.weight"]
            rows = slice(start, start + fp8.shape[0])
            start += fp8.shape[0]
            assert torch.equal(merged.weight[rows].view(torch.uint8), fp8.view(torch.uint8))
            scale = checkpoint[f"{name}.weight_scale"].float().reshape(-1)
            assert torch.equal(merged.weight_scale[rows], scale.expand(fp8.shape[0]))


def test_quantizing_on_load_scales_each_row_as_the_merged_weight(bf16_dir, fp8_runs):
    model, plain = load(bf16_dir, quantization="fp8"), load(bf16_dir)
    for name in ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        merged = model.get_submodule(f"model.layers.0.{name}")
        weight, scale = quantize_rows(plain.get_submodule(f"model.layers.0.{name}").weight)
        assert torch.equal(merged.weight.view(torch.uint8), weight.view(torch.uint8))
        assert torch.equal(merged.weight_scale, scale.view(-1))
    # Biases, norms, embeddings and the LM head stay in the model's dtype.
    assert model.model.layers[0].self_attn.qkv_proj.bias.dtype == torch.float32
    assert model.lm_head.weight.dtype == torch.float32


def test_the_engine_serves_quantized_projections(bf16_dir, fp8_runs):
    """The setting reaches the loader, and a step runs Fp8Linear (the CPU's _scaled_mm)."""
    llm = LLM(str(bf16_dir), device="cpu", num_blocks=32, block_size=16, quantization="fp8")
    assert isinstance(llm.engine.runner.model.model.layers[1].mlp.gate_up_proj, Fp8Linear)
    out = llm.generate([[5, 9, 31]], SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert len(out.outputs[0].token_ids) == 6


def test_random_weights_quantize_too(bf16_dir, fp8_runs):
    model = load(bf16_dir, quantization="fp8", random_weights=True)
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp8Linear) and down.weight.dtype == FP8
    assert (down.weight_scale > 0).all()
    assert model.model.norm.weight.eq(1).all()


def test_fp8_projections_track_the_float32_model(bf16_dir, fp8_runs):
    """The CPU's torch._scaled_mm runs the Fp8Linear path end to end: logits stay close
    (tiny_models' std 0.1 makes the net chaotic: bf16 alone moves its logits by 2%)."""
    tokens = torch.tensor([5, 9, 31, 200, 7, 44, 3, 120])
    fp8, plain = load(bf16_dir, quantization="fp8"), load(bf16_dir)
    got, want = (prefill_logits(model, tokens) for model in (fp8, plain))
    relative = (got - want).norm() / want.norm()
    assert relative < 0.15, relative


def prefill_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    from engine.attention.base import AttentionMetadata

    config = model.config
    cache = [
        torch.zeros(1, 2, 16, config.num_kv_heads, config.head_dim)
        for _ in range(config.num_layers)
    ]
    n = len(tokens)
    meta = AttentionMetadata.from_block_tables([n], [n], [[0]], torch.arange(n), 16)
    model.model.layers[0].self_attn.backend.plan(meta)
    with torch.inference_mode():
        hidden = model(tokens, torch.arange(n), cache, meta)
        return model.compute_logits(hidden).float()


@pytest.mark.parametrize(
    "arch, overrides",
    [("phi3", {"partial_rotary_factor": 0.75}), ("gemma3_text", {})],
    ids=["phi3-partial-rotary", "gemma3"],
)
def test_other_families_fp8_rows_are_their_weights(tmp_path, fp8_runs, arch, overrides):
    """Phi-3's merged checkpoint projections, their rotary rows reordered at load (scales
    with them), and Gemma 3's layers keep per-row fp8 exact."""
    source = write_tiny_model(tmp_path / arch, arch, **overrides)
    fp8_dir, plain_dir = write_fp8(source, tmp_path, "channel")
    model, plain = load(fp8_dir), load(plain_dir)
    projections = [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    assert len(projections) == 4 * model.config.num_layers
    for name, module in projections:
        dequantized = module.weight.float() * module.weight_scale[:, None]
        assert torch.equal(dequantized, plain.get_submodule(name).weight), name


def test_an_fp8_mixture_of_experts_loads_dequantized_on_the_cpu(tmp_path):
    source = write_tiny_model(tmp_path / "moe", "qwen3_moe", mlp_only_layers=[1])
    fp8_dir, plain_dir = write_fp8(source, tmp_path, "channel")
    assert "model.layers.0.mlp.experts.3.up_proj.weight_scale" in load_file(
        fp8_dir / "model.safetensors"
    )
    got, want = load(fp8_dir).state_dict(), load(plain_dir).state_dict()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_fp8_experts_are_refused_where_fp8_runs(tmp_path, fp8_runs):
    source = write_tiny_model(tmp_path / "moe", "qwen3_moe")
    fp8_dir, _ = write_fp8(source, tmp_path, "block")
    with pytest.raises(ModelLoadError, match="Qwen3MoeForCausalLM's experts have no fp8 kernel"):
        load(fp8_dir)
    with pytest.raises(ValidationError, match="quantization: fp8 is not supported for Qwen3Moe"):
        load(source, quantization="fp8")


# ---- what fails, in one line ----------------------------------------------------------------


@pytest.fixture
def block_dir(bf16_dir, tmp_path) -> Path:
    return write_fp8(bf16_dir, tmp_path, "block")[0]


@pytest.mark.parametrize(
    "quantization, message",
    [
        ({"quant_method": "awq", "bits": 4}, "quant_method 'awq'; only 'fp8' is supported"),
        ({"quant_method": "fp8", "activation_scheme": "tensor"}, "activation_scheme='tensor'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
        ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "fmt='e5m2'"),
    ],
)
def test_an_unsupported_quantization_config_names_itself(block_dir, quantization, message):
    edit_config(block_dir, quantization_config=quantization)
    with pytest.raises(ModelLoadError, match=message):
        load(block_dir)


def test_block_scales_of_the_wrong_shape_name_the_tensor(block_dir):
    edit_config(
        block_dir, quantization_config={"quant_method": "fp8", "weight_block_size": [64, 64]}
    )
    with pytest.raises(
        ModelLoadError, match=r"scale of fp8 tensor '.*\.weight' \[\d+, \d+\] has shape"
    ):
        load(block_dir)


def test_an_fp8_weight_without_its_scale_names_it(block_dir):
    path = block_dir / "model.safetensors"
    weights = load_file(path)
    del weights["model.layers.0.mlp.down_proj.weight_scale_inv"]
    save_file(weights, path)
    with pytest.raises(ModelLoadError, match="'model.layers.0.mlp.down_proj.weight' has no"):
        load(block_dir)


def test_an_e5m2_weight_is_refused(block_dir):
    path = block_dir / "model.safetensors"
    weights = load_file(path)
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = weights[name].float().to(torch.float8_e5m2)
    save_file(weights, path)
    with pytest.raises(ModelLoadError, match=f"'{name}' in model.safetensors is torch.float8_e5m2"):
        load(block_dir)


def test_quantization_fp8_on_the_cpu_fails_naming_the_setting(bf16_dir):
    with pytest.raises(ValidationError, match="quantization: fp8 needs a CUDA GPU"):
        LLM(str(bf16_dir), device="cpu", num_blocks=32, quantization="fp8")
