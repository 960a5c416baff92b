"""Rotary position embedding of q and k, after Qwen3's per-head q/k RMSNorm when it has one.

"rotate_half" (neox) convention as in Hugging Face Llama: each head vector is split into
halves (x1, x2) and frequency i rotates the pair (x1[i], x2[i]) by the token's angle;
engine/model/rope.py looks up those angles' cos and sin once per step.

Numerics follow Hugging Face: the norm exactly as engine/kernels/norm.py computes it
(float32 statistics, rounded to the dtype, times the weight), then the rotation in float32
of that rounded value, cast back. On CUDA one Triton kernel norms and rotates every q and
k head of a step, reading them in place from the merged qkv projection's output.
"""

from __future__ import annotations

import torch

from engine.kernels.dispatch import use_triton
from engine.kernels.norm import rms_norm_torch


def rotary_qk(
    q: torch.Tensor,  # [T, Hq, D], a view with a contiguous last dim
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # float32 [T, D // 2]
    sin: torch.Tensor,  # float32 [T, D // 2]
    q_norm_weight: torch.Tensor | None = None,  # [D]; both norm weights or neither
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) normed per head (when the weights are given), then rotated: fresh tensors
    in the input dtype (the norm's result dtype when normed). The inputs are not modified."""
    assert (q_norm_weight is None) == (k_norm_weight is None), "q and k are normed together"
    if use_triton(q):
        from engine.kernels import triton_kernels

        return triton_kernels.rotary_qk(q, k, cos, sin, q_norm_weight, k_norm_weight, eps)
    return rotary_qk_torch(q, k, cos, sin, q_norm_weight, k_norm_weight, eps)


def rotary_qk_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    if q_norm_weight is not None and k_norm_weight is not None:
        q = rms_norm_torch(q, q_norm_weight, eps)
        k = rms_norm_torch(k, k_norm_weight, eps)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos = cos.unsqueeze(1)  # broadcast over heads
    sin = sin.unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)
