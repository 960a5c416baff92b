"""Writing new tokens' K and V into a layer's paged KV pool, in plain torch.

Layout (engine/attention/base.py): kv_cache [num_blocks, 2, block_size, Hkv, D], 0 = K,
1 = V; token row t goes to slot slot_mapping[t] = block * block_size + offset, and a
slot of -1 (a padding row of a CUDA-graph batch) is written nowhere.

The model writes K/V through engine/kernels/rotary.py's rotary_and_store_kv, whose CPU
path ends here; on CUDA its Triton kernel stores the rows itself.
"""

from __future__ import annotations

import torch

from engine.kv.fp8 import to_pool


def store_kv_torch(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64 [T]
    k_scale: float = 1.0,  # an fp8 pool's scales (engine/kv/fp8.py); other pools ignore them
    v_scale: float = 1.0,
) -> None:
    """Store each row's k and v at its slot, cast to the pool's dtype (an fp8 pool's:
    divided by the scale, clamped, rounded); slot -1 goes nowhere.

    Non-finite values are clamped on the way in, so the pool only ever holds finite
    numbers: the torch attention backend masks stale slots instead of clearing them, and
    masked-out stale slots then contribute exactly 0 to other sequences' attention (a
    stale nan or inf would turn 0 * x into nan). Looking for padding rows reads the slots
    on the host: a sync on CUDA, so this is the CPU path and the reference, not a kernel.
    """
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        rows = keep.nonzero().flatten()
        k, v, slot_mapping = k[rows], v[rows], slot_mapping[rows]
    block_size = kv_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    kv_cache[blocks, 0, offsets] = to_pool(torch.nan_to_num(k), kv_cache.dtype, k_scale)
    kv_cache[blocks, 1, offsets] = to_pool(torch.nan_to_num(v), kv_cache.dtype, v_scale)
