"""SwiGLU's activation: silu(gate) * up over the merged gate-up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.dispatch import use_triton


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: silu of the first half times the second half."""
    if use_triton(gate_up):
        from engine.kernels import triton_kernels

        return triton_kernels.silu_and_mul(gate_up)
    return silu_and_mul_torch(gate_up)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
