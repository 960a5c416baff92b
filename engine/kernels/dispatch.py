"""When an op takes its Triton kernel: the tensor is on CUDA and triton imports."""

from __future__ import annotations

import functools

import torch


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_importable()
