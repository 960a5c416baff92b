"""Build a LlamaForCausalLM (or its Gemma3ForCausalLM) from a Hugging Face directory or a GGUF file.

The module is built on the meta device (no memory), then each checkpoint tensor is
converted to the target dtype and device as it streams in, and the finished tensors are
assigned into the module: one copy of the weights ever exists. q/k/v and gate/up are
copied into slices of their merged parameter as they arrive.

fp8 weights (engine/model/fp8.py): where fp8 runs, the projections an fp8 checkpoint
holds in fp8 (all of them with quantization "fp8") are built as Fp8Linear modules and each
checkpoint piece arrives as fp8 rows and their scales; elsewhere an fp8 tensor is
dequantized to the target dtype as it arrives, once its scale has come too.

Under tensor parallelism (tp.size > 1) the model is this rank's shard
(engine/parallel/shard.py) and each safetensors tensor is read as the rows or columns the
rank holds, the pieces of the merged q/k/v and gate/up and each expert's too (Phi-3's
fused qkv_proj and gate_up_proj as each part's rows), an fp8 weight's scale as the part
that goes with them (Fp8Checkpoint.scale_index); a GGUF tensor is dequantized whole, then
sliced.

With random_weights no checkpoint tensor is read: every parameter is drawn on the device
as transformers initialises a model (matrices normal with std 0.02, biases 0, norm
weights at their neutral value), so a model's speed can be measured from its config alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from engine.attention.base import AttentionBackend
from engine.errors import ModelLoadError, ValidationError
from engine.kernels.fp8_linear import FP8, fp8_linear_fits, fp8_linear_runs
from engine.model.config import ModelConfig, as_token_ids
from engine.model.fp8 import (
    INPUT_SCALES,
    PROJECTIONS,
    WEIGHT_SCALES,
    Fp8Checkpoint,
    check_input_scale,
    quantized,
    use_fp8_linears,
)
from engine.model.gemma3 import Gemma3ForCausalLM
from engine.model.gguf import gguf_model_config, gguf_tensors, open_gguf
from engine.model.llama import Linear, LlamaForCausalLM
from engine.model.moe import ExpertRows, layer_mlp, moe_checkpoint_pieces
from engine.model.phi3 import FUSED_CHECKPOINTS, put_rotary_rows_in_order
from engine.parallel.group import SINGLE_PROCESS, TensorParallel
from engine.parallel.shard import ModelShard

# (checkpoint name, tensor, file it came from)
NamedTensors = Iterable[tuple[str, torch.Tensor, str]]
# Where a checkpoint tensor goes in its parameter: all of it (None), rows, or an expert's rows.
Rows = slice | ExpertRows | None

log = logging.getLogger(__name__)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: torch.device | str,
    attn_backend: AttentionBackend,
    random_weights: bool = False,
    quantization: str | None = None,
    tp: TensorParallel = SINGLE_PROCESS,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """The model (this rank's shard of it) on `device` in `dtype`; quantization "fp8" makes
    its projections fp8."""
    path = Path(path)
    device = torch.device(device)
    if quantization is not None and not fp8_linear_runs(device):
        raise ValidationError(
            "quantization",
            f"fp8 needs a CUDA GPU of compute capability 8.9 or newer (Ada, Hopper); {device} "
            "has none",
        )
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"expected a model directory or a .gguf file, got {path}")
        reader = open_gguf(path)
        config = gguf_model_config(reader)
        named = _sliced_gguf_tensors(gguf_tensors(reader, config), ModelShard.of(config, tp), path)
        num_tensors = len(reader.tensors)
        fp8_names: set[str] = set()
    else:
        config = read_hf_config(path)
        files = [] if random_weights else safetensors_files(path)
        num_tensors = sum(len(_safetensors_keys(f)) for f in files)
        named = _read_safetensors(files, ModelShard.of(config, tp), config.fp8)
        fp8_names = _fp8_tensor_names(files) if config.fp8 is not None else set()

    if config.moe is not None and fp8_linear_runs(device):
        _refuse_fp8_experts(config, quantization)
    with torch.device("meta"):
        if config.gemma3 is not None:
            model = Gemma3ForCausalLM(config, attn_backend, tp)
        else:
            model = LlamaForCausalLM(config, attn_backend, layer_mlp, tp)
    if fp8_linear_runs(device):
        fp8_modules = _fp8_projections(model, config, fp8_names, quantize=quantization == "fp8")
        use_fp8_linears(model, fp8_modules)
    if random_weights:
        model.load_state_dict(_random_weights(model, config, dtype, device), assign=True)
        model.to(device)
        return model.eval(), config
    weights = _load_weights(model, config, named, num_tensors, dtype, device)
    if config.rotary_dim < config.head_dim:
        put_rotary_rows_in_order(
            {n: w.view(torch.uint8) if w.dtype == FP8 else w for n, w in weights.items()},
            config.head_dim,
            config.rotary_dim,
            model.shard.num_heads,
            model.shard.num_kv_heads,
        )
    model.load_state_dict(weights, assign=True, strict=True)
    model.to(device)  # moves the rope cache, built on the CPU; weights are already there
    return model.eval(), config


def read_hf_config(directory: Path) -> ModelConfig:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"no config.json in {directory}")
    config = ModelConfig.from_hf_config(_read_json(config_path))
    # Chat models often list extra stop ids (e.g. Llama 3's <|eot_id|>) only here.
    generation_path = directory / "generation_config.json"
    if generation_path.is_file():
        extra = as_token_ids(_read_json(generation_path).get("eos_token_id"))
        eos_ids = tuple(dict.fromkeys(config.eos_token_ids + extra))
        config = dataclasses.replace(config, eos_token_ids=eos_ids)
    return config


def safetensors_files(directory: Path) -> list[Path]:
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map", {})
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"shard {file.name} listed in {index_path.name} is missing")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        hint = " (pytorch_model.bin is not supported)" if any(directory.glob("*.bin")) else ""
        raise ModelLoadError(f"no .safetensors weights in {directory}{hint}")
    return files


def _read_safetensors(
    files: list[Path], shard: ModelShard, fp8: Fp8Checkpoint | None
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Each tensor, or the part of it the shard holds."""
    # A scale's part depends on its weight's shape, which may be in another file.
    shapes = _tensor_shapes(files) if fp8 is not None and shard.tp.size > 1 else {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    index = shard.checkpoint_index(name)
                    if index is not None and fp8 is not None:
                        index = _scale_index(name, index, fp8, shapes)
                    if index is None:
                        yield name, f.get_tensor(name), file.name
                    else:
                        yield name, _read_index(f.get_slice(name), *index), file.name
        except SafetensorError as e:
            raise ModelLoadError(f"cannot read {file}: {e}") from e


def _sliced_gguf_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], shard: ModelShard, path: Path
) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Each dequantized GGUF tensor (q and k already in Hugging Face's row order), or the
    part of it the shard holds."""
    for name, tensor in tensors:
        index = shard.checkpoint_index(name)
        yield name, tensor if index is None else _read_index(tensor, *index), path.name


def _scale_index(
    name: str,
    index: tuple[int, Sequence[int]],
    fp8: Fp8Checkpoint,
    shapes: dict[str, list[int]],
) -> tuple[int, Sequence[int]] | None:
    """The part of checkpoint tensor `name` to read, `index` being what the shard holds of
    the projection it belongs to: an fp8 scale's part goes with that of its weight."""
    if name.endswith(INPUT_SCALES):
        return None  # one value
    if not name.endswith(WEIGHT_SCALES):
        return index
    weight = name.rpartition(".")[0] + ".weight"
    if weight not in shapes:
        return None  # _load_weights names the weight that is missing
    return fp8.scale_index(weight, shapes[weight], shapes[name], index)


def _tensor_shapes(files: list[Path]) -> dict[str, list[int]]:
    """Every tensor's shape, read off the files' headers."""
    shapes = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                shapes.update((name, f.get_slice(name).get_shape()) for name in f.keys())
        except SafetensorError as e:
            raise ModelLoadError(f"cannot read {file}: {e}") from e
    return shapes


def _read_index(tensor_slice: Any, dim: int, index: Sequence[int]) -> torch.Tensor:
    """tensor.index_select(dim, index) of a safetensors slice (or a tensor), reading only
    the runs of consecutive rows or columns it names."""
    parts = [
        tensor_slice[(slice(None),) * dim + (slice(start, stop),)] for start, stop in _runs(index)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _runs(index: Sequence[int]) -> list[tuple[int, int]]:
    """(start, stop) of each run of consecutive indices, in order."""
    if isinstance(index, range):
        return [(index.start, index.stop)]
    runs = [(index[0], index[0] + 1)]
    for i in index[1:]:
        if i == runs[-1][1]:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _safetensors_keys(file: Path) -> list[str]:
    try:
        with safe_open(file, framework="pt") as f:
            return list(f.keys())
    except SafetensorError as e:
        raise ModelLoadError(f"cannot read {file}: {e}") from e


def _load_weights(
    model: LlamaForCausalLM,
    config: ModelConfig,
    named: NamedTensors,
    num_tensors: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """Stream checkpoint tensors into real tensors for every parameter of the meta model."""
    params = dict(model.named_parameters())
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    fp8_scales = {name for name, p in params.items() if name.endswith(".weight_scale")}
    pieces = checkpoint_pieces(
        {n: s for n, s in shapes.items() if n not in fp8_scales}, config, model.shard
    )
    weights: dict[str, torch.Tensor] = {}
    loaded: set[str] = set()
    scales: dict[str, torch.Tensor] = {}  # fp8 checkpoint weight name -> its scale
    waiting: dict[str, tuple[torch.Tensor, str]] = {}  # fp8 weights whose scale is yet to come
    dequantized = 0
    progress = tqdm(
        named,
        total=num_tensors,
        desc="Loading weights",
        leave=False,
        disable=not sys.stderr.isatty(),
    )
    for name, tensor, source in progress:
        if config.fp8 is not None and name.endswith(INPUT_SCALES):
            check_input_scale(name, tensor)
            continue
        if config.fp8 is not None and name.endswith(WEIGHT_SCALES):
            name = name.rpartition(".")[0] + ".weight"  # the weight it scales
            scales[name] = tensor
            if name not in waiting:
                continue
            tensor, source = waiting.pop(name)
        elif tensor.dtype == FP8 and name not in scales:
            waiting[name] = (tensor, source)
            continue
        elif tensor.dtype.itemsize == 1 and tensor.dtype.is_floating_point and tensor.dtype != FP8:
            raise ModelLoadError(
                f"tensor {name!r} in {source} is {tensor.dtype}; of the 8-bit floats only "
                "float8_e4m3fn is supported"
            )
        if name not in pieces:
            if _is_ignored(name, config):
                continue
            raise ModelLoadError(f"unexpected tensor {name!r} in {source}")
        param, rows = pieces[name]
        expected = shapes[param] if rows is None else _shape_of(shapes[param], rows)
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(
                f"tensor {name!r} in {source} has shape {tuple(tensor.shape)}, expected {expected}"
            )
        if params[param].dtype == FP8:  # an Fp8Linear's weight, and its row scales beside it
            scale_param = param + "_scale"
            tensor, row_scales = _fp8_rows(config.fp8, name, tensor, scales.get(name), device)
            for target, value in ((param, tensor), (scale_param, row_scales)):
                if rows is None:
                    weights[target] = value.contiguous()
                else:
                    if target not in weights:
                        weights[target] = torch.empty(
                            shapes[target], dtype=value.dtype, device=device
                        )
                    weights[target][rows].copy_(value)
            loaded.add(name)
            continue
        if tensor.dtype == FP8:
            assert config.fp8 is not None
            tensor = config.fp8.dequantize(name, tensor.to(device), scales[name].to(device))
            dequantized += 1
        if rows is None:
            weights[param] = tensor.to(device=device, dtype=dtype).contiguous()
        else:
            if param not in weights:  # zeros: a padded vocabulary shard's tail stays zero
                weights[param] = torch.zeros(shapes[param], dtype=dtype, device=device)
            weights[param][rows].copy_(tensor)
        loaded.add(name)

    if waiting:
        raise ModelLoadError(
            f"fp8 tensor {next(iter(waiting))!r} has no weight_scale_inv or weight_scale"
        )
    missing = [name for name in pieces if name not in loaded]
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")
    if dequantized:
        log.info(
            "%d fp8 tensors dequantized to %s: no fp8 matmul takes them here", dequantized, dtype
        )
    return weights


def _fp8_rows(
    fp8: Fp8Checkpoint | None,
    name: str,
    tensor: torch.Tensor,
    scale: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint piece of an Fp8Linear's weight as fp8 rows and one scale per row: an fp8
    tensor's own scales (fp8.rows), or a 16/32-bit tensor quantized here."""
    tensor = tensor.to(device)
    if tensor.dtype != FP8:
        return quantized(tensor)
    assert fp8 is not None and scale is not None
    return fp8.rows(name, tensor, scale.to(device))


def _fp8_projections(
    model: LlamaForCausalLM, config: ModelConfig, fp8_names: set[str], quantize: bool
) -> set[str]:
    """The projections to build as Fp8Linear: all of them when quantizing on load, else
    those whose checkpoint pieces are all fp8; each only where the fp8 matmul takes its shape."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    parts: dict[str, list[str]] = {}
    for name, (param, _) in checkpoint_pieces(shapes, config, model.shard).items():
        parts.setdefault(param, []).append(name)
    chosen = set()
    for name, module in model.named_modules():
        if not (isinstance(module, Linear) and name.rpartition(".")[2] in PROJECTIONS):
            continue
        if not fp8_linear_fits(module.out_features, module.in_features):
            continue
        if quantize or all(part in fp8_names for part in parts[f"{name}.weight"]):
            chosen.add(name)
    return chosen


def _refuse_fp8_experts(config: ModelConfig, quantization: str | None) -> None:
    """Where fp8 runs, a mixture of experts' experts would need an fp8 grouped GEMM."""
    why = f"{config.architecture}'s experts have no fp8 kernel; serve its bf16 checkpoint"
    if quantization is not None:
        raise ValidationError("quantization", f"fp8 is not supported for {why}")
    if config.fp8 is not None:
        raise ModelLoadError(f"fp8 checkpoints are not supported on CUDA for {why}")


def _fp8_tensor_names(files: list[Path]) -> set[str]:
    """The checkpoint's float8_e4m3fn tensors, read off the files' headers."""
    names = set()
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                names.update(k for k in f.keys() if f.get_slice(k).get_dtype() == "F8_E4M3")
        except SafetensorError as e:
            raise ModelLoadError(f"cannot read {file}: {e}") from e
    return names


def _random_weights(
    model: LlamaForCausalLM, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    # Gemma's norms scale by (1 + w), so their neutral weight is 0; everyone else's is 1.
    norm_value = 0.0 if config.gemma3 is not None else 1.0
    generator = torch.Generator(device).manual_seed(0)
    weights = {}
    for name, param in model.named_parameters():
        if param.dtype == FP8:  # an Fp8Linear: drawn as the others, then quantized
            weight = torch.empty(param.shape, dtype=dtype, device=device)
            weights[name], weights[name + "_scale"] = quantized(
                weight.normal_(0.0, 0.02, generator=generator)
            )
            continue
        if name in weights:  # an Fp8Linear's row scales
            continue
        weight = torch.empty(param.shape, dtype=dtype, device=device)
        if param.dim() > 1:
            weight.normal_(0.0, 0.02, generator=generator)
        else:
            weight.fill_(norm_value if "norm" in name else 0.0)
        weights[name] = weight
    return weights


def _shape_of(shape: tuple[int, ...], rows: slice | ExpertRows) -> tuple[int, ...]:
    """The shape of param[rows], read from a meta tensor (no memory)."""
    return tuple(torch.empty(shape, device="meta")[rows].shape)


def checkpoint_pieces(
    param_shapes: dict[str, tuple[int, ...]], config: ModelConfig, shard: ModelShard
) -> dict[str, tuple[str, Rows]]:
    """Checkpoint tensor name (the shard's part of it) -> (our parameter, its rows in that
    parameter or None for all)."""
    q, kv, inter = shard.q_size, shard.kv_size, shard.intermediate_size
    vocab = len(shard.vocab)
    merged = {
        "qkv_proj": (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)),
        "gate_up_proj": (("gate_proj", 0, inter), ("up_proj", inter, inter)),
    }
    if config.architecture in FUSED_CHECKPOINTS:
        merged = {}  # the checkpoint holds our merged parameters as they are
    pieces: dict[str, tuple[str, Rows]] = {}
    for param in param_shapes:
        module = param.split(".")[-2]
        if (moe := moe_checkpoint_pieces(param, config, shard)) is not None:
            pieces.update(moe)  # stacked experts and the router
        elif module in merged:
            for part, start, rows in merged[module]:
                pieces[param.replace(module, part)] = (param, slice(start, start + rows))
        elif module in ("embed_tokens", "lm_head") and vocab < shard.vocab_rows:
            pieces[param] = (param, slice(0, vocab))  # the padded rows past it stay zero
        else:
            pieces[param] = (param, None)
    return pieces


def _is_ignored(name: str, config: ModelConfig) -> bool:
    """Tensors some checkpoints carry that we do not need."""
    if name.endswith("rotary_emb.inv_freq"):  # recomputed from the config
        return True
    if name.endswith((".self_attn.k_scale", ".self_attn.v_scale")):  # engine/kv/fp8.py reads them
        return True
    return name == "lm_head.weight" and config.tie_word_embeddings  # tied copy of the embedding


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot parse {path}: {e}") from e
