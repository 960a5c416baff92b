"""RMSNorm, alone and fused with the residual add that precedes it in every decoder layer.

Numerics follow Hugging Face: statistics in float32, the normalized value cast back to
the input's dtype, then scaled by the weight (weight * normed.to(dtype)). The fused
form rounds residual + x to the stream's dtype before its statistics, exactly as the
unfused add-then-norm does, so both paths give the same numbers.
"""

from __future__ import annotations

import torch

from engine.kernels.dispatch import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize over the last dim of x [..., D] (any leading dims, e.g. per-head q/k norm)."""
    if use_triton(x):
        from engine.kernels import triton_kernels

        return triton_kernels.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): the next sublayer's input and the new stream.

    Both are fresh tensors; neither input is modified. On CUDA one kernel reads x and
    residual once and writes both results.
    """
    if use_triton(x):
        from engine.kernels import triton_kernels

        return triton_kernels.fused_add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_torch(x, residual, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return rms_norm_torch(residual, weight, eps), residual
