"""Host arrays to the device: one asynchronous copy from one pinned buffer per call."""

from __future__ import annotations

import itertools

import numpy as np
import torch

_TORCH_DTYPES = {
    np.dtype(name): getattr(torch, name) for name in ("int32", "int64", "float32", "bool")
}


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host arrays as tensors on `device`. On CUDA all of them travel in one asynchronous
    copy from one pinned buffer: each separate copy would cost a launch, and a copy from
    unpinned memory waits for every kernel queued before it."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    # Every part starts 16-byte aligned: Triton specializes a kernel on whether each
    # pointer is, so parts that shifted with the batch size would recompile kernels.
    *offsets, total = itertools.accumulate((-(-a.nbytes // 16) * 16 for a in arrays), initial=0)
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    staging_bytes = staging.numpy()
    for a, offset in zip(arrays, offsets, strict=True):
        part = np.ascontiguousarray(a).reshape(-1)
        staging_bytes[offset : offset + a.nbytes] = part.view(np.uint8)
    on_device = staging.to(device, non_blocking=True)
    return [
        on_device[offset : offset + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
        for a, offset in zip(arrays, offsets, strict=True)
    ]
