"""Writing new tokens' K and V into a layer's paged KV pool.

Layout (engine/attention/base.py): kv_cache [num_blocks, 2, block_size, Hkv, D], 0 = K,
1 = V; token row t goes to slot slot_mapping[t] = block * block_size + offset, and a
slot of -1 (a padding row of a CUDA-graph batch) is written nowhere.
"""

from __future__ import annotations

import torch

from engine.kernels.dispatch import use_triton


def store_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64 [T]
) -> None:
    """Store each row's k and v at its slot, cast to the pool's dtype.

    On CUDA this is one Triton kernel with no host sync, so it can be captured in a CUDA
    graph; the torch version finds the rows to write on the host.
    """
    if use_triton(kv_cache):
        from engine.kernels import triton_kernels

        triton_kernels.store_kv(k, v, kv_cache, slot_mapping)
    else:
        store_kv_torch(k, v, kv_cache, slot_mapping)


def store_kv_torch(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    rows = (slot_mapping >= 0).nonzero().flatten()
    slots = slot_mapping[rows]
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[blocks, 0, offsets] = k[rows].to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = v[rows].to(kv_cache.dtype)
