"""Rotary position embedding of q and k, after Qwen3's per-head q/k RMSNorm when it has one,
fused with writing the rotated k and v into the layer's paged KV pool.

"rotate_half" (neox) convention as in Hugging Face Llama: each head vector is split into
halves (x1, x2) and frequency i rotates the pair (x1[i], x2[i]) by the token's angle;
engine/model/rope.py looks up those angles' cos and sin once per step.

Numerics follow Hugging Face: the norm exactly as engine/kernels/norm.py computes it
(float32 statistics, rounded to the dtype, times the weight), then the rotation in float32
of that rounded value, cast back; k is then cast to the pool's dtype as it is stored (an
fp8 pool's: divided by the layer's scale in float32, clamped to +-448 and rounded to e4m3,
engine/kv/fp8.py; v alike). The
attention backends read K and V only from the pool, so the rotated k is never returned.
On CUDA one Triton kernel norms and rotates every q and k head of a step, reading them in
place from the merged qkv projection's output, and writes k and v to their slots.
"""

from __future__ import annotations

import torch

from engine.kernels.dispatch import use_triton
from engine.kernels.kv_cache import store_kv_torch
from engine.kernels.norm import rms_norm_torch


def rotary_and_store_kv(
    q: torch.Tensor,  # [T, Hq, D], a view with a contiguous last dim
    k: torch.Tensor,  # [T, Hkv, D], same dtype as q
    v: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # float32 [T, D // 2]
    sin: torch.Tensor,  # float32 [T, D // 2]
    kv_cache: torch.Tensor,  # this layer's [num_blocks, 2, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64 [T]; -1: a padding row, written nowhere
    q_norm_weight: torch.Tensor | None = None,  # [D]; both norm weights or neither
    k_norm_weight: torch.Tensor | None = None,  # [D]
    eps: float = 0.0,
    k_scale: float = 1.0,  # an fp8 pool's scales; other pools ignore them
    v_scale: float = 1.0,
) -> torch.Tensor:
    """q normed per head (when the weights are given) and rotated: a fresh tensor in the
    input dtype (the norm's result dtype when normed). k, normed and rotated the same way,
    and v are stored at their rows' slots of kv_cache (engine/kernels/kv_cache.py), cast
    to its dtype. The inputs are not modified.

    On CUDA this is one Triton kernel with no host sync, so it can be captured in a CUDA
    graph; the torch version finds padding rows on the host."""
    assert (q_norm_weight is None) == (k_norm_weight is None), "q and k are normed together"
    impl = rotary_and_store_kv_torch
    if use_triton(q):
        from engine.kernels import triton_kernels

        impl = triton_kernels.rotary_and_store_kv
    return impl(
        q,
        k,
        v,
        cos,
        sin,
        kv_cache,
        slot_mapping,
        q_norm_weight,
        k_norm_weight,
        eps,
        k_scale,
        v_scale,
    )


def rotary_and_store_kv_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    q, k = rotary_qk_torch(q, k, cos, sin, q_norm_weight, k_norm_weight, eps)
    store_kv_torch(k, v, kv_cache, slot_mapping, k_scale, v_scale)
    return q


def rotary_qk_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) normed per head (when the weights are given), then rotated: fresh tensors."""
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
