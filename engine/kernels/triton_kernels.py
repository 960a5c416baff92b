"""The Triton kernels behind engine/kernels' ops, and their launchers.

Imported only on the Triton path (it needs triton). Each launcher takes the same
arguments as its op and returns fresh contiguous outputs (rotary_and_store_kv also writes
into the KV pool it is given); inputs may be strided views (a q slice of the merged qkv
projection, the gate-up output) as long as their last dim is contiguous. Launchers never
read tensor values on the host, so every kernel can be captured in a CUDA graph. Token
counts are not specialized on (do_not_specialize), so a new batch size does not compile a
new kernel variant. On sm_90 and later the per-layer kernels (norms, rotary + KV write,
SiLU-and-mul) use programmatic dependent launch, and the sampling race takes its noise's
logarithms on the GPU's approximate log unit (_log_exponential_noise says where it stays
exact).

TRITON_INTERPRET=1 runs these kernels on CPU tensors (tests/test_kernels.py does).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, libdevice


def _num_warps(elements_per_program: int) -> int:
    return min(max(elements_per_program // 256, 1), 8)


@functools.cache
def _pdl_options(device: torch.device) -> dict[str, bool]:
    """The launch options of a kernel that calls _pdl_start: programmatic dependent launch
    (sm_90 on) both in the kernel (PDL) and at its launch (launch_pdl), or neither. A kernel
    launched so may start while the kernel before it finishes, and waits in gdc_wait()
    before reading that kernel's output; the gap between the two (a launch's latency) is
    hidden. Not in the interpreter."""
    pdl = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    # Called before the kernel reads anything the kernel before it wrote: it waits for that
    # kernel to finish (and its writes to be visible); the next kernel may then start
    # launching. Most kernels call it first thing.
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr,
    x_stride_outer,
    x_stride_inner,
    res_ptr,
    res_stride_outer,
    res_stride_inner,
    weight_ptr,
    out_ptr,
    res_out_ptr,
    num_rows,
    rows_per_outer,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl_start(PDL)
    # Row r of the flattened [..., D] input sits at (r // rows_per_outer, r % rows_per_outer)
    # of a [outer, inner, D] view: per-head norms read q/k heads in place, without a copy.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_DIM)
    mask = (rows < num_rows)[:, None] & (cols < dim)[None, :]
    outer = rows // rows_per_outer
    inner = rows % rows_per_outer
    x_offsets = (outer * x_stride_outer + inner * x_stride_inner)[:, None] + cols[None, :]
    out_offsets = rows[:, None] * dim + cols[None, :]
    x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res_offsets = (outer * res_stride_outer + inner * res_stride_inner)[:, None] + cols[None, :]
        res = tl.load(res_ptr + res_offsets, mask=mask, other=0.0)
        # Rounded to the stream's dtype before the statistics, as an eager add would be.
        x = (x.to(tl.float32) + res.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + out_offsets, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x32 * x32, axis=1) / dim + eps)
    normed = (x32 * inv_rms[:, None]).to(x.dtype)  # Hugging Face scales in the input's dtype
    weight = tl.load(weight_ptr + cols, mask=cols < dim, other=0.0)
    out = weight.to(tl.float32)[None, :] * normed.to(tl.float32)
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x as [outer, inner, D] with a contiguous last dim: (view, stride_outer, stride_inner,
    inner). Views of up to 3 dims are used as they are; more leading dims are flattened."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        x = x[None]
    if x.dim() == 2:
        return x, x.stride(0), 0, 1
    x = x.reshape(-1, *x.shape[-2:])
    return x, x.stride(0), x.stride(1), x.shape[1]


def _launch_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dim = x.shape[-1]
    num_rows = x.numel() // dim
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    x_rows, x_outer, x_inner, rows_per_outer = _as_rows(x)
    res_out = res_rows = None
    res_outer = res_inner = 0
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
        res_out = torch.empty_like(residual, memory_format=torch.contiguous_format)
        res_rows, res_outer, res_inner, _ = _as_rows(residual)
    block_dim = triton.next_power_of_2(dim)
    block_rows = max(1, 1024 // block_dim)  # several short rows (a head each) per program
    _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
        x_rows,
        x_outer,
        x_inner,
        res_rows,
        res_outer,
        res_inner,
        weight,
        out,
        res_out,
        num_rows,
        rows_per_outer,
        dim,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROWS=block_rows,
        BLOCK_DIM=block_dim,
        num_warps=_num_warps(block_rows * block_dim),
        **_pdl_options(x.device),
    )
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch_rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch_rms_norm(x, residual, weight, eps)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, x_row_stride, out_ptr, inter, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    _pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    x_row = x_ptr + row * x_row_stride
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + inter + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    act = (gate32 * tl.sigmoid(gate32)).to(gate.dtype)  # rounded like eager F.silu's output
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    x = gate_up.reshape(-1, gate_up.shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
        x,
        x.stride(0),
        out,
        inter,
        BLOCK=block,
        num_warps=_num_warps(block),
        **_pdl_options(x.device),
    )
    return out


@triton.jit
def _quantize_rows_kernel(
    x_ptr,
    x_row_stride,
    q_ptr,
    scale_ptr,
    cols,
    min_amax,
    fp8_max,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    # One row a program: its amax in float32 (a pass over the row), then x / scale clamped
    # to +-fp8_max (e4m3fn has no infinity) and rounded to fp8 (a second pass, from L2).
    _pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, cols, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offsets, mask=offsets < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0), min_amax) / fp8_max
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < cols
        x = tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x / scale, -fp8_max), fp8_max)
        tl.store(q_ptr + row * cols + offsets, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_rows(
    x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, min_amax: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (fp8 [M, K], float32 scales [M, 1]), one kernel:
    engine/kernels/fp8_linear.py's quantize_rows."""
    rows, cols = x.shape
    q = torch.empty((rows, cols), dtype=fp8_dtype, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows == 0:
        return q, scale
    block = min(triton.next_power_of_2(cols), 2048)
    _quantize_rows_kernel[(rows,)](
        x,
        x.stride(0),
        q,
        scale,
        cols,
        min_amax,
        fp8_max,
        BLOCK=block,
        num_warps=_num_warps(block),
        **_pdl_options(x.device),
    )
    return q, scale


@triton.jit
def _norm_and_rotate(
    x1,
    x2,
    weight_ptr,
    cols,
    col_mask,
    cos,
    sin,
    half,
    eps,
    dtype: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    # x1, x2: one token's heads as two [heads, D/2] tiles, the halves the rotation pairs up.
    # Returns them normed (HAS_NORM) and rotated, rounded to dtype (the norm's result dtype).
    x1_32 = x1.to(tl.float32)
    x2_32 = x2.to(tl.float32)
    if HAS_NORM:
        squares = tl.sum(x1_32 * x1_32, axis=1) + tl.sum(x2_32 * x2_32, axis=1)
        inv_rms = tl.rsqrt(squares / (2 * half) + eps)[:, None]
        w1 = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + half + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        # Rounded as rms_norm rounds: the normed value to the input's dtype, its product with
        # the weight to the result's; the rotation then starts from that rounded value.
        x1_32 = (w1 * (x1_32 * inv_rms).to(x1.dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2_32 = (w2 * (x2_32 * inv_rms).to(x2.dtype).to(tl.float32)).to(dtype).to(tl.float32)
    rotated1 = x1_32 * cos[None, :] - x2_32 * sin[None, :]
    rotated2 = x2_32 * cos[None, :] + x1_32 * sin[None, :]
    return rotated1.to(dtype), rotated2.to(dtype)


@triton.jit
def _rotary_and_store_kv_kernel(
    q_ptr,
    q_stride_token,
    q_stride_head,
    k_ptr,
    k_stride_token,
    k_stride_head,
    v_ptr,
    v_stride_token,
    v_stride_head,
    cos_ptr,
    sin_ptr,
    cos_stride,
    q_weight_ptr,
    k_weight_ptr,
    q_out_ptr,
    cache_ptr,
    cache_stride_block,
    cache_stride_kv,
    cache_stride_slot,
    cache_stride_head,
    slot_ptr,
    block_size,
    num_q_heads,
    num_kv_heads,
    half,
    eps,
    k_scale,  # an fp8 pool's (engine/kv/fp8.py); unread for other pools
    v_scale,
    HAS_NORM: tl.constexpr,
    BLOCK_Q_HEADS: tl.constexpr,
    BLOCK_KV_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    _pdl_start(PDL)
    # One program per token: its cos / sin row is read once for all its q and k heads; its
    # rotated q goes to q_out, its rotated k and its v to its slot of the pool (or nowhere:
    # slot -1). Heads are tiled as halves [heads, D/2], v included. Every load comes before
    # the first store: the compiler cannot move a load above a store that may alias it, and
    # one round of memory latency is what this small kernel's time is.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < half
    cos = tl.load(cos_ptr + token * cos_stride + cols, mask=col_mask, other=0.0)
    sin = tl.load(sin_ptr + token * cos_stride + cols, mask=col_mask, other=0.0)
    q_heads = tl.arange(0, BLOCK_Q_HEADS)
    q_mask = (q_heads < num_q_heads)[:, None] & col_mask[None, :]
    q_in = q_ptr + token * q_stride_token + q_heads[:, None] * q_stride_head + cols[None, :]
    q1 = tl.load(q_in, mask=q_mask, other=0.0)
    q2 = tl.load(q_in + half, mask=q_mask, other=0.0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    kv_heads = tl.arange(0, BLOCK_KV_HEADS)
    # slot broadcast to a tensor first: a scalar bool in a mask trips Triton 3.9's interpreter
    writes = (tl.zeros([BLOCK_KV_HEADS], tl.int64) + slot >= 0) & (kv_heads < num_kv_heads)
    kv_mask = writes[:, None] & col_mask[None, :]
    k_in = k_ptr + token * k_stride_token + kv_heads[:, None] * k_stride_head + cols[None, :]
    v_in = v_ptr + token * v_stride_token + kv_heads[:, None] * v_stride_head + cols[None, :]
    k1 = tl.load(k_in, mask=kv_mask, other=0.0)
    k2 = tl.load(k_in + half, mask=kv_mask, other=0.0)
    v1 = tl.load(v_in, mask=kv_mask, other=0.0)
    v2 = tl.load(v_in + half, mask=kv_mask, other=0.0)

    dtype = q_out_ptr.dtype.element_ty  # q and k round alike (the launcher checks)
    q1, q2 = _norm_and_rotate(
        q1, q2, q_weight_ptr, cols, col_mask, cos, sin, half, eps, dtype, HAS_NORM
    )
    k1, k2 = _norm_and_rotate(
        k1, k2, k_weight_ptr, cols, col_mask, cos, sin, half, eps, dtype, HAS_NORM
    )
    q_out = q_out_ptr + (token * num_q_heads + q_heads[:, None]) * (2 * half) + cols[None, :]
    tl.store(q_out, q1, mask=q_mask)
    tl.store(q_out + half, q2, mask=q_mask)
    cache_dtype = cache_ptr.dtype.element_ty
    cache_k = (
        cache_ptr
        + (slot // block_size) * cache_stride_block
        + (slot % block_size) * cache_stride_slot
        + kv_heads[:, None] * cache_stride_head
        + cols[None, :]
    )
    cache_v = cache_k + cache_stride_kv
    tl.store(cache_k, _to_pool(k1, k_scale, cache_dtype), mask=kv_mask)
    tl.store(cache_k + half, _to_pool(k2, k_scale, cache_dtype), mask=kv_mask)
    tl.store(cache_v, _to_pool(v1, v_scale, cache_dtype), mask=kv_mask)
    tl.store(cache_v + half, _to_pool(v2, v_scale, cache_dtype), mask=kv_mask)


@triton.jit
def _to_pool(x, scale, cache_dtype: tl.constexpr):
    # As engine/kv/fp8.py's to_pool: an fp8 pool's value is x / scale in float32, clamped
    # to +-448 (e4m3 has no infinity) and rounded to nearest; any other pool's is a cast.
    if cache_dtype == tl.float8e4nv:
        scaled = x.to(tl.float32) / scale
        return tl.minimum(tl.maximum(scaled, -448.0), 448.0).to(cache_dtype)
    return x.to(cache_dtype)


def rotary_and_store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.stride(0) == 1
    assert kv_cache.shape[-2:] == (num_kv_heads, head_dim) and kv_cache.stride(-1) == 1
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    assert cos.shape == sin.shape == (num_tokens, head_dim // 2) and cos.stride() == sin.stride()
    assert cos.stride(-1) == 1 and cos.dtype == sin.dtype == torch.float32
    has_norm = q_norm_weight is not None
    # The kernel rounds k where it rounds q (then casts k to the pool's dtype).
    assert k.dtype == q.dtype, "q and k come from one projection"
    q_dtype = q.dtype
    if has_norm:  # rms_norm's result dtype
        assert k_norm_weight.dtype == q_norm_weight.dtype, "q and k norm weights differ in dtype"
        q_dtype = torch.promote_types(q.dtype, q_norm_weight.dtype)
    q_out = torch.empty(q.shape, dtype=q_dtype, device=q.device)
    block_q_heads = triton.next_power_of_2(num_q_heads)
    block_half = triton.next_power_of_2(head_dim // 2)
    if num_tokens:
        _rotary_and_store_kv_kernel[(num_tokens,)](
            q,
            q.stride(0),
            q.stride(1),
            k,
            k.stride(0),
            k.stride(1),
            v,
            v.stride(0),
            v.stride(1),
            cos,
            sin,
            cos.stride(0),
            q_norm_weight,
            k_norm_weight,
            q_out,
            kv_cache,
            kv_cache.stride(0),
            kv_cache.stride(1),
            kv_cache.stride(2),
            kv_cache.stride(3),
            slot_mapping,
            kv_cache.shape[2],
            num_q_heads,
            num_kv_heads,
            head_dim // 2,
            eps,
            k_scale,
            v_scale,
            HAS_NORM=has_norm,
            BLOCK_Q_HEADS=block_q_heads,
            BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
            BLOCK_HALF=block_half,
            num_warps=_num_warps(2 * block_q_heads * block_half),
            **_pdl_options(q.device),
        )
    return q_out


# ---- sampling: the exponential race of engine/core/sampler.py, in one pass over the logits ----


@triton.jit
def _fmix32(x):
    # MurmurHash3's finaliser on uint32, whose products wrap mod 2^32: the same bits as
    # engine/core/sampler.py's int64 emulation, so the noise is bit-identical to the torch path's.
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed, counter):
    # engine/kernels/race.py row_keys: the int64 seed's two halves, then the counter.
    key = _fmix32(seed.to(tl.uint32) ^ 0x5BD1E995)  # int64 -> uint32 keeps the low half
    key = _fmix32(key ^ (seed >> 32).to(tl.uint32))
    return _fmix32(key ^ counter.to(tl.uint32))


@triton.jit
def _log_exponential_noise(bits, FAST: tl.constexpr):
    # log(E) for E = -log(u), u = ((bits >> 9) + 0.5) * 2^-23: engine/core/sampler.py's noise.
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2^-23
    if not FAST:  # libdevice's logf, a ~20-instruction polynomial (the interpreter's path)
        return tl.log(-tl.log(uniform))
    # On the GPU: the MUFU's approximate logarithm, two instructions, for both logs. Its
    # absolute error (~1e-7) would swamp E where u is near 1, which is where E is small
    # and the noise large: the races' winners. There E = -log1p(-w), w = 1 - u exactly,
    # comes from its series (w < 2^-8: the first term left out is < 1e-10 of w).
    w = ((8388608 - (bits >> 9)).to(tl.float32) - 0.5) * 1.1920928955078125e-07
    series = w * (1.0 + w * (0.5 + w * (0.3333333432674408 + w * 0.25)))
    exponential = tl.where(w < 0.00390625, series, -libdevice.fast_logf(uniform))
    return libdevice.fast_logf(exponential)


# The vocab of each row is split over several programs (stage 1), then a tiny kernel reduces
# each row's splits (stage 2): one program per row would leave most SMs idle at small batch.
_RACE_BLOCK = 2048
# 4 programs of 8 warps per SM: one full wave at stage 1's ~64 registers a thread (sm_90),
# enough loads in flight to stream the logits; once the rows alone fill it, no row is split.
_RACE_PROGRAMS_PER_SM = 4
_RACE_MAX_SPLITS = 128  # stage 2 reduces a row's splits in one block of this many lanes


# vocab_size stays specialized (it is fixed per model): known divisible by 16, the tail mask
# lets the loads be 16-byte vectors. blocks_per_split follows the batch size: not specialized.
@triton.jit(do_not_specialize=["blocks_per_split"])
def _exponential_race_kernel(
    logits_ptr,
    row_stride,
    temperature_ptr,
    greedy_ptr,
    seeds_ptr,
    counters_ptr,
    allowed_ptr,
    allowed_stride,
    split_best_ptr,
    split_index_ptr,
    vocab_size,
    blocks_per_split,
    HAS_TEMPERATURE: tl.constexpr,
    HAS_ALLOWED: tl.constexpr,
    FAST_NOISE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Program (row, split) races the split's slice of the row, blocks_per_split * BLOCK
    # columns (the last split's is shorter). A greedy row: the max of its logits. A sampled
    # row: the max over v of logit_v / temperature - log(E_v), E_v = -log(u_v) with u_v the
    # row key's Weyl-walk hash of v: the same choice as argmax(softmax(scaled) / E), since
    # log softmax only subtracts the row's constant log-normaliser. A token whose bit in the
    # row's allowed words is clear gets -inf. It writes its best value and the first column
    # reaching it to [rows, splits] buffers for stage 2.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    # A multiple of BLOCK the compiler can see: the slices' loads stay aligned (vectorized).
    start = split * blocks_per_split * BLOCK
    end = tl.minimum(start + blocks_per_split * BLOCK, vocab_size)
    greedy = tl.load(greedy_ptr + row)
    key = _row_key(tl.load(seeds_ptr + row), tl.load(counters_ptr + row))
    if HAS_TEMPERATURE:
        # One IEEE division per program, then a multiply per logit: within an ulp of
        # dividing each, as the log approximations below already differ from torch's.
        inv_temperature = tl.math.div_rn(1.0, tl.load(temperature_ptr + row))
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_index = start + tl.arange(0, BLOCK)  # each lane's first column, for a slice all -inf
    for block_start in range(start, end, BLOCK):
        cols = block_start + tl.arange(0, BLOCK)
        mask = cols < end
        logits = tl.load(logits_ptr + row * row_stride + cols, mask=mask, other=float("-inf"))
        value = logits.to(tl.float32)
        if not greedy:
            if HAS_TEMPERATURE:
                value = value * inv_temperature
            bits = _fmix32(key + cols.to(tl.uint32) * 0x9E3779B9)
            value = value - _log_exponential_noise(bits, FAST_NOISE)
        if HAS_ALLOWED:
            words = tl.load(allowed_ptr + row * allowed_stride + cols // 32, mask=mask, other=0)
            value = tl.where((words >> (cols % 32)) & 1 != 0, value, float("-inf"))
        better = value > best  # strict: each lane keeps its first maximum
        best = tl.where(better, value, best)
        best_index = tl.where(better, cols, best_index)
    top = tl.max(best, axis=0)
    # The first column reaching the split's maximum, as torch.argmax picks.
    first = tl.min(tl.where(best == top, best_index, vocab_size), axis=0)
    slot = row * tl.num_programs(1) + split
    tl.store(split_best_ptr + slot, top)
    tl.store(split_index_ptr + slot, first)


@triton.jit(do_not_specialize=["num_splits"])
def _exponential_race_reduce_kernel(
    split_best_ptr,
    split_index_ptr,
    out_ptr,
    num_splits,
    BLOCK_SPLITS: tl.constexpr,
):
    # One program per row: the best of its splits. Among splits tied at the best, the
    # smallest index: splits are ordered and each holds its first, so it is the row's first
    # index reaching the maximum (torch.argmax's tie rule across split boundaries too).
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_SPLITS)
    mask = splits < num_splits
    offsets = row * num_splits + splits
    best = tl.load(split_best_ptr + offsets, mask=mask, other=float("-inf"))
    index = tl.load(split_index_ptr + offsets, mask=mask, other=2**31 - 1)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, index, 2**31 - 1), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


def race_blocks_per_split(num_rows: int, vocab_size: int, num_sms: int, block: int) -> int:
    """How many BLOCK-wide blocks of a row's vocab one program of the race reduces.

    A host formula on shapes alone (no sync, and a captured graph's batch size fixes it):
    aim at _RACE_PROGRAMS_PER_SM programs per SM in all, never more than one block per
    program or _RACE_MAX_SPLITS splits per row. The split count is then the blocks over
    this, rounded up: every split gets at least one block."""
    num_blocks = triton.cdiv(vocab_size, block)
    wanted = _RACE_PROGRAMS_PER_SM * num_sms // max(num_rows, 1)
    return triton.cdiv(num_blocks, min(max(wanted, 1), num_blocks, _RACE_MAX_SPLITS))


def exponential_race(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    is_greedy: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """int64 [B]: per row of logits [B, V] (any float dtype), the argmax on greedy rows, the
    race's winner over logits / temperature (None: already scaled) on the others; only
    among the tokens `allowed` (int32 [B, ceil(V / 32)]) sets, where given."""
    num_rows, vocab_size = logits.shape
    # The interpreter (CPU tensors) splits as an H200 (132 SMs) would.
    num_sms = (
        torch.cuda.get_device_properties(logits.device).multi_processor_count
        if logits.is_cuda
        else 132
    )
    blocks_per_split = race_blocks_per_split(num_rows, vocab_size, num_sms, _RACE_BLOCK)
    race = (logits, temperature, is_greedy, seeds, counters)
    return split_exponential_race(*race, blocks_per_split, _RACE_BLOCK, allowed)


def split_exponential_race(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    is_greedy: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    blocks_per_split: int,
    block: int,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """exponential_race with each row's vocab split in slices of blocks_per_split * block
    columns (tests pick small ones to reach many splits on small vocabs)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    num_rows, vocab_size = logits.shape
    num_splits = triton.cdiv(triton.cdiv(vocab_size, block), blocks_per_split)
    assert 1 <= num_splits <= _RACE_MAX_SPLITS, (vocab_size, block, blocks_per_split)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        split_best = torch.empty(num_rows, num_splits, dtype=torch.float32, device=logits.device)
        split_index = torch.empty(num_rows, num_splits, dtype=torch.int32, device=logits.device)
        _exponential_race_kernel[(num_rows, num_splits)](
            logits,
            logits.stride(0),
            temperature,
            is_greedy,
            seeds,
            counters,
            allowed,
            0 if allowed is None else allowed.stride(0),
            split_best,
            split_index,
            vocab_size,
            blocks_per_split,
            HAS_TEMPERATURE=temperature is not None,
            HAS_ALLOWED=allowed is not None,
            FAST_NOISE=logits.device.type == "cuda",
            BLOCK=block,
            num_warps=_num_warps(block),
        )
        _exponential_race_reduce_kernel[(num_rows,)](
            split_best, split_index, out, num_splits, BLOCK_SPLITS=_RACE_MAX_SPLITS, num_warps=1
        )
    return out


# ---- the persistent batch (engine/core/batch.py) ------------------------------------------------


@triton.jit(do_not_specialize=["num_rows"])
def _step_inputs_kernel(
    row_slots_ptr,
    positions_ptr,
    token_table_ptr,
    block_table_ptr,
    input_ids_ptr,
    kv_slots_ptr,
    num_rows,
    token_width,
    block_width,
    block_size,
    padding_slot,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < num_rows
    slot = tl.load(row_slots_ptr + rows, mask=mask, other=0)
    position = tl.load(positions_ptr + rows, mask=mask, other=0)
    token = tl.load(token_table_ptr + slot * token_width + position, mask=mask, other=0)
    block = tl.load(block_table_ptr + slot * block_width + position // block_size, mask=mask)
    kv_slot = block.to(tl.int64) * block_size + position % block_size
    tl.store(input_ids_ptr + rows, token.to(tl.int64), mask=mask)
    tl.store(kv_slots_ptr + rows, tl.where(slot == padding_slot, -1, kv_slot), mask=mask)


def step_inputs(
    row_slots: torch.Tensor,
    positions: torch.Tensor,
    token_table: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    padding_slot: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeviceBatch.inputs in one launch: per row, its input id and its KV slot."""
    num_rows = row_slots.shape[0]
    input_ids = torch.empty(num_rows, dtype=torch.int64, device=row_slots.device)
    kv_slots = torch.empty(num_rows, dtype=torch.int64, device=row_slots.device)
    block = 256
    _step_inputs_kernel[(triton.cdiv(num_rows, block),)](
        row_slots,
        positions,
        token_table,
        block_table,
        input_ids,
        kv_slots,
        num_rows,
        token_table.stride(0),
        block_table.stride(0),
        block_size,
        padding_slot,
        BLOCK=block,
    )
    return input_ids, kv_slots
