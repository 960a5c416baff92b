"""fp8 projections on CUDA: out = x @ W^T with W in float8_e4m3fn, one scale per output row.

x is quantized per token on the fly (each row's amax mapped to e4m3's largest value, 448),
then torch._scaled_mm's rowwise recipe multiplies the two fp8 operands on the tensor cores
and applies both scale vectors (scale_a [M, 1], scale_b [1, N], float32) in its epilogue.
That recipe writes bfloat16 only, so a float16 model's output is cast once more. A decode
batch of a few rows is a weight read, which the skinny-GEMM Triton kernel does faster
(SKINNY_MAX_ROWS): it takes x as it is, 16-bit, and the fp8 weight with its scales, so
those rows are not quantized (one kernel fewer, and x keeps its precision). Nothing reads a
value back to the host, so a decode step with fp8 projections is captured in a CUDA graph
like any other.

`quantize_rows` is also how weights become fp8 on load (engine/model/fp8.py): a weight's
output rows are a matrix's rows as a token's features are.
"""

from __future__ import annotations

import torch

from engine.kernels.dispatch import use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# An all-zero row gets this amax instead of 0: its scale stays finite, its values 0.
_MIN_AMAX = 1e-12
# Up to this many rows (decode batches) the product runs in the skinny-GEMM Triton kernel
# (engine/kernels/triton_linear.py), beyond in torch._scaled_mm. Measured on the H100
# (benchmarks/gpu_fp8_linear.py, RESULTS.md) with x quantized for both: a Llama-3-8B
# layer's four projections take 107 vs 145 us at 1 row, 137 vs 144 at 2, and 155 vs 142
# at 4.
SKINNY_MAX_ROWS = 2


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 scales [M, 1]) with x ~= q * scale: each
    row's amax (in float32) mapped to 448. On CUDA one Triton kernel (every fp8 projection
    of a decode step runs one, so kernels count); elsewhere quantize_rows_torch."""
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        from engine.kernels import triton_kernels

        return triton_kernels.quantize_rows(x, FP8, FP8_MAX, _MIN_AMAX)
    return quantize_rows_torch(x)


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in five torch kernels: the rows' amax (the infinity norm, in float32,
    in one pass), the scales, and x / scale (a 16-bit x promoted to float32 in the same
    kernel), clamped in place so a quotient rounded past 448 cannot become NaN (e4m3fn has
    no infinity), cast to fp8."""
    amax = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp_(min=_MIN_AMAX).div_(FP8_MAX)
    return (x / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] fp8 * weight_scale [N, 1])^T (+ bias [N]), in x's dtype
    (a float32 x takes torch._scaled_mm at any row count). N and K must be multiples of 16
    (fp8_linear_fits)."""
    x = x.contiguous()  # both GEMMs take row-major x only
    skinny = x.shape[0] <= SKINNY_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
    if skinny and use_triton(x) and weight.is_contiguous():
        from engine.kernels import triton_linear

        return triton_linear.skinny_fp8_linear(x, weight, weight_scale, bias)
    x_fp8, x_scale = quantize_rows(x)
    out = torch._scaled_mm(
        x_fp8,
        weight.t(),  # column-major, as the fp8 GEMM wants its second operand
        scale_a=x_scale,
        scale_b=weight_scale.view(1, -1),
        out_dtype=torch.bfloat16,
    )
    if bias is not None:
        out = out + bias
    return out if out.dtype == x.dtype else out.to(x.dtype)


def fp8_linear_fits(out_features: int, in_features: int) -> bool:
    """Whether fp8_linear takes a weight of this shape (the fp8 GEMM's alignment)."""
    return out_features % 16 == 0 and in_features % 16 == 0


def fp8_linear_runs(device: torch.device) -> bool:
    """Whether the device has fp8 tensor cores: CUDA of compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
