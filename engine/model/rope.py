"""Rotary position embedding's angles, "rotate_half" (neox) convention as in Hugging Face Llama.

Each head vector is split into halves (x1, x2); frequency i rotates the pair
(x1[i], x2[i]) by angle position * inv_freq[i]. Scaling only changes inv_freq. This module
computes the angles' cos and sin; engine/kernels/rotary.py applies the rotation.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies on the CPU, after scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if rope_type in (None, "default"):
        return inv_freq
    if rope_type == "linear":
        # Positions divided by the factor == frequencies divided by it.
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelLoadError(
        f"unsupported rope_scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: slow the low frequencies by `factor`, keep the high ones, blend in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    original_context = float(scaling["original_max_position_embeddings"])

    wavelength = 2 * math.pi / inv_freq
    # 0 where the wavelength is long (scale fully), 1 where it is short (keep as is).
    blend = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blend = blend.clamp(0.0, 1.0)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin for every position up to max_positions, computed once."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        # Built on the CPU even when the model is being built on the meta device, so the
        # loader only has to move it; float32 whatever the model dtype.
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        angles = torch.outer(positions, inv_freq)
        self.register_buffer("cos_cache", angles.cos(), persistent=False)  # [max_positions, D/2]
        self.register_buffer("sin_cache", angles.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a flat [T] positions tensor: each float32 [T, head_dim // 2]."""
        return self.cos_cache[positions], self.sin_cache[positions]
