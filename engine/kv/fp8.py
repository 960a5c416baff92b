"""An fp8 (e4m3) KV pool: what it stores, and the per-layer scales it is read with.

With kv_cache_dtype = fp8_e4m3 every layer's pool is torch.float8_e4m3fn, half the bytes
of a 16-bit one. Each layer has one scale for K and one for V (per tensor): a K row is
stored as k / k_scale, clamped to e4m3's largest finite value (448) and rounded to the
nearest e4m3 (ties to even), and read as float32(stored) * k_scale; V alike. The scales
are 1.0 unless the checkpoint carries `model.layers.N.self_attn.k_scale` / `v_scale`
tensors, as published fp8 checkpoints do (the same meaning: the factor a stored value is
multiplied by when read).

The scales never change after loading, so each attention layer holds them as plain
floats (Attention.k_scale, v_scale) and hands them to the KV write and the backend as
launch arguments: no device tensor to read, nothing per step, and a CUDA graph captures
them as constants.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import ModelLoadError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value; float8_e4m3fn has no infinity


def quantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale, clamped to +-FP8_MAX and rounded to e4m3 (computed in float32)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """A pool's values in float32: fp8 ones times their scale, others as they are."""
    x = x.float()
    return x if scale == 1.0 else x * scale


def to_pool(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a pool of `dtype` stores it: quantized for fp8, else cast."""
    return quantize(x, scale) if dtype == FP8_DTYPE else x.to(dtype)


def read_kv_scales(files: Iterable[Path], num_layers: int) -> list[tuple[float, float]]:
    """Each layer's (k_scale, v_scale) from a checkpoint's safetensors files; 1.0 where a
    layer has none."""
    found: dict[str, float] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name.endswith((".self_attn.k_scale", ".self_attn.v_scale")):
                        found[name] = _scale_value(name, f.get_tensor(name))
        except SafetensorError as e:
            raise ModelLoadError(f"cannot read {file}: {e}") from e
    return [
        tuple(found.get(f"model.layers.{i}.self_attn.{kv}_scale", 1.0) for kv in "kv")
        for i in range(num_layers)
    ]


def _scale_value(name: str, tensor: torch.Tensor) -> float:
    if tensor.numel() != 1:
        raise ModelLoadError(f"{name} must be one value (a per-tensor scale), got {tensor.shape}")
    value = float(tensor.float().item())
    if not (value > 0 and math.isfinite(value)):
        raise ModelLoadError(f"{name} must be a finite number > 0, got {value}")
    return value


def set_kv_scales(model: torch.nn.Module, scales: list[tuple[float, float]]) -> None:
    """Give each attention layer (a module with k_scale, v_scale and layer_index) its own."""
    for module in model.modules():
        if hasattr(module, "k_scale") and hasattr(module, "layer_index"):
            module.k_scale, module.v_scale = scales[module.layer_index]
