"""Rotary position embedding's angles, "rotate_half" (neox) convention as in Hugging Face Llama.

Each head vector is split into halves (x1, x2); frequency i rotates the pair
(x1[i], x2[i]) by angle position * inv_freq[i]. Scaling changes inv_freq and, for longrope
and yarn, multiplies cos and sin by an attention factor, as transformers does. This module
computes one cos/sin table for every position; engine/kernels/rotary.py (the Triton kernel on
CUDA, torch on the CPU) applies the rotation from it, so every variant runs on every path.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")

# Each scaling type's config fields besides rope_type: (required, optional).
_ROPE_FIELDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "linear": (frozenset({"factor"}), frozenset()),
    "llama3": (
        frozenset(
            {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        ),
        frozenset(),
    ),
    "longrope": (
        frozenset({"short_factor", "long_factor", "factor", "original_max_position_embeddings"}),
        frozenset({"attention_factor"}),
    ),
    "yarn": (
        frozenset({"factor", "original_max_position_embeddings"}),
        frozenset(
            {"beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}
        ),
    ),
}


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    return "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))


def check_rope_scaling(scaling: dict[str, Any] | None, rotary_dim: int) -> None:
    """Refuse, in one line naming it, a scaling type or field we would not run exactly."""
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return
    if rope_type not in _ROPE_FIELDS:
        raise ModelLoadError(
            f"unsupported rope_scaling type {rope_type!r}; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    required, optional = _ROPE_FIELDS[rope_type]
    given = {key for key, value in scaling.items() if value is not None} - {"rope_type", "type"}
    if unknown := sorted(given - required - optional):
        raise ModelLoadError(
            f"unsupported rope_scaling field {unknown[0]!r} for rope_type {rope_type!r}"
        )
    if missing := sorted(required - given):
        raise ModelLoadError(f"rope_scaling type {rope_type!r} needs the field {missing[0]!r}")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != rotary_dim // 2:
                raise ModelLoadError(
                    f"rope_scaling {key} has {len(scaling[key])} values, expected {rotary_dim // 2}"
                )


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies on the CPU, after scaling (longrope's short
    ones: rope_cos_sin switches to its long ones past the original context)."""
    inv_freq = 1.0 / _wavelengths(head_dim, theta)
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq
    check_rope_scaling(scaling, head_dim)
    if rope_type == "linear":
        # Positions divided by the factor == frequencies divided by it.
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "longrope":
        return _longrope_inv_freq(head_dim, theta, scaling["short_factor"])
    return _yarn_inv_freq(head_dim, theta, scaling)


def _wavelengths(head_dim: int, theta: float) -> torch.Tensor:
    """theta ** (2i / head_dim): the unscaled inverse frequencies' inverses, float32 as in
    transformers."""
    return theta ** (
        torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
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


def _longrope_inv_freq(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE (Phi-3): each frequency slowed by its own factor."""
    factors_cpu = torch.tensor(factors, dtype=torch.float32, device="cpu")
    return 1.0 / (factors_cpu * _wavelengths(head_dim, theta))


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolate (divide by `factor`) the frequencies that turn fewer than beta_slow
    times over the original context, keep those that turn more than beta_fast times, and
    ramp linearly between; the same float32 steps as transformers."""
    factor = float(scaling["factor"])
    original_context = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times
        return (head_dim * math.log(original_context / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = (
        (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    ).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (unchanged), 0: interpolate

    wavelengths = _wavelengths(head_dim, theta)
    return (1.0 / (factor * wavelengths)) * (1 - keep) + (1.0 / wavelengths) * keep


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What transformers multiplies cos and sin by (1.0 but for longrope and yarn)."""
    rope_type = rope_type_of(scaling)
    if rope_type not in ("longrope", "yarn"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if rope_type == "longrope":
        original_context = scaling["original_max_position_embeddings"]
        return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original_context))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def rope_cos_sin(
    head_dim: int,
    max_positions: int,
    theta: float,
    scaling: dict[str, Any] | None,
    rotary_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [max_positions, head_dim // 2] on the CPU.

    With a rotary_dim below head_dim (Phi-4-mini), transformers rotates only the first
    rotary_dim values of each head, as a head of that size. Their angles fill the first
    rotary_dim // 2 columns and the rest turn by nothing (cos 1, sin 0), which is that
    rotation once the loader has put each head's q and k rows in rotary_order.

    longrope: transformers picks the short or the long factors for a whole forward by its
    largest position (long once it reaches original_max_position_embeddings), and keeps
    earlier keys in the KV cache as they were rotated. Generating one token a step, that is
    short factors below that position and long ones from it, which this table holds: a
    function of the position alone, so a sequence is rotated the same whether its prompt
    comes whole, in chunks, from the prefix cache or again after a preemption. transformers
    differs only where one forward spans the switch: a prompt longer than the original
    context gets long factors at every position there, short ones here below the switch.
    """
    rotary_dim = rotary_dim or head_dim
    positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
    inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
    if rope_type_of(scaling) == "longrope":
        switch = scaling["original_max_position_embeddings"]
        long_inv_freq = _longrope_inv_freq(rotary_dim, theta, scaling["long_factor"])
        angles = torch.cat(
            (
                torch.outer(positions[:switch], inv_freq),
                torch.outer(positions[switch:], long_inv_freq),
            )
        )
    else:
        angles = torch.outer(positions, inv_freq)
    scale = attention_factor(scaling)
    unturned = (max_positions, (head_dim - rotary_dim) // 2)
    cos = torch.cat((angles.cos() * scale, torch.ones(unturned, device="cpu")), dim=1)
    sin = torch.cat((angles.sin() * scale, torch.zeros(unturned, device="cpu")), dim=1)
    return cos, sin


def rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's q/k rows under which rotate-half over the whole head turns
    exactly the pairs that rotate-half over its first rotary_dim values would: the rotated
    halves [a, b] and the rest [c, d] become [a, c, b, d], so a[i] pairs with b[i] and c[j]
    with d[j] (unturned). q.k is the same in any order both share; v is not reordered."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    a = torch.arange(0, half)
    c = torch.arange(rotary_dim, rotary_dim + rest)
    return torch.cat((a, c, a + half, c + rest))


class RotaryEmbedding(torch.nn.Module):
    """Holds cos/sin for every position up to max_positions, computed once."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
    ):
        super().__init__()
        # Built on the CPU even when the model is being built on the meta device, so the
        # loader only has to move it; float32 whatever the model dtype.
        cos, sin = rope_cos_sin(head_dim, max_positions, theta, scaling, rotary_dim)
        self.register_buffer("cos_cache", cos, persistent=False)  # [max_positions, D/2]
        self.register_buffer("sin_cache", sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a flat [T] positions tensor: each float32 [T, head_dim // 2]."""
        return self.cos_cache[positions], self.sin_cache[positions]
