"""engine/kernels/triton_linear.py (the skinny GEMM of decoding) and linear()'s routing to it.

The kernel must equal x.float() @ W.float().T (+ bias) up to one rounding to the 16-bit
output, for row counts across its power-of-two row blocks and for N and K that are not
multiples of its block sizes, through both ways of forming products (CUDA cores, tensor
cores). It runs on CUDA (marked gpu) and on the CPU under Triton's interpreter, which
needs TRITON_INTERPRET=1 before triton is imported: test_skinny_linear_in_the_interpreter
reruns this file's "interpreter" cases in a subprocess, as tests/test_kernels.py does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.dispatch import triton_importable
from engine.model import llama
from tests.test_kernels import INTERPRETED, TRITON_TARGETS, rerun_interpreter_cases

needs_triton = pytest.mark.skipif(not triton_importable(), reason="triton is not installed")

ROWS = [1, 3, 8, 16]
# (N, K, bias): partial blocks of N (70, 33) and a partial last K step (200, 1000).
SHAPES = [(40, 64, True), (70, 200, False), (33, 1000, True)]


@pytest.fixture(autouse=True)
def seeded() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def interpreter_multiplies_bf16_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's interpreter keeps bf16 as its uint16 bits and tl.dot multiplies the bits
    (triton-lang/triton#11584, unsupported upstream): give its dot float32 operands, as
    the GPU's bf16 mma does in effect (a bf16 product is exact in float32)."""
    if not INTERPRETED:
        return
    import triton.language as tl
    from triton.runtime import interpreter

    create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_of_values(self, a, b, d, *args):
        a, b = (self.cast_impl(t, tl.float32) if t.dtype == tl.bfloat16 else t for t in (a, b))
        return create_dot(self, a, b, d, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot_of_values)


def configs(rows: int) -> list:
    """The rule's pick, then each product form with small blocks: several K steps, the
    last one partial, and a partial block of N (CUDA cores up to 8 rows, as far as the
    benchmark's sweep tries them)."""
    from engine.kernels.triton_linear import SkinnyConfig

    dot = SkinnyConfig(use_dot=True, block_n=16, block_k=128, num_warps=4, num_stages=2)
    cores = SkinnyConfig(use_dot=False, block_n=8, block_k=128, num_warps=2, num_stages=1)
    return [None, dot] if rows > 8 else [None, dot, cores]


def assert_one_rounding_from(out: torch.Tensor, expected: torch.Tensor) -> None:
    """out (16-bit) within one ulp of the float32 product: round to nearest on the GPU,
    toward zero under the interpreter; the float32 sums differ only in their order."""
    eps = torch.finfo(out.dtype).eps
    torch.testing.assert_close(out.float(), expected, rtol=eps, atol=1e-3)


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", ROWS)
def test_skinny_linear_equals_the_float32_product(
    target: str, rows: int, dtype: torch.dtype
) -> None:
    from engine.kernels.triton_linear import skinny_linear

    device = "cuda" if target == "cuda" else "cpu"
    for n, k, has_bias in SHAPES:
        x = torch.randn(rows, k, dtype=dtype, device=device)
        weight = torch.randn(n, k, dtype=dtype, device=device)
        bias = torch.randn(n, dtype=dtype, device=device) if has_bias else None
        expected = x.float() @ weight.float().T
        if bias is not None:
            expected += bias.float()
        for config in configs(rows):
            out = skinny_linear(x, weight, bias, config)
            assert out.shape == (rows, n) and out.dtype == dtype and out.is_contiguous()
            assert_one_rounding_from(out, expected)


@pytest.mark.parametrize("target", TRITON_TARGETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("rows", ROWS)
def test_skinny_fp8_linear_equals_the_float32_product_with_the_scaled_weight(
    target: str, rows: int, dtype: torch.dtype
) -> None:
    """A 16-bit x times an fp8 weight with its row scales: x @ (W * w_scale)^T in float32,
    rounded once, through both product forms, with pick_config's one-byte K steps too."""
    from engine.kernels.fp8_linear import quantize_rows_torch
    from engine.kernels.triton_linear import pick_config, skinny_fp8_linear

    device = "cuda" if target == "cuda" else "cpu"
    for n, k, has_bias in SHAPES:
        x = torch.randn(rows, k, device=device).to(dtype)
        weight, w_scale = quantize_rows_torch(torch.randn(n, k, device=device) / k**0.5)
        bias = torch.randn(n, dtype=dtype, device=device) if has_bias else None
        expected = x.float() @ (weight.float() * w_scale).T
        if bias is not None:
            expected += bias.float()
        for config in [*configs(rows), pick_config(rows, n, k, weight_bytes=1)]:
            out = skinny_fp8_linear(x, weight, w_scale.view(-1), bias, config)
            assert out.shape == (rows, n) and out.dtype == dtype and out.is_contiguous()
            assert_one_rounding_from(out, expected)


@needs_triton
def test_one_byte_weights_take_k_steps_of_the_same_bytes_on_cuda_cores() -> None:
    """pick_config's W tile (block_n x block_k elements) holds as many bytes for an fp8
    weight as for a 16-bit one on CUDA cores, until K itself is shorter; the tensor-core
    form's tiles (x's padded rows take most of its shared memory) stay as they are."""
    import triton

    from engine.kernels.triton_linear import CUDA_CORE_MAX_ROWS, pick_config

    for rows in (1, 2, 4, 16, 64):
        for n, k in ((4096, 4096), (4096, 14336), (6144, 4096), (1024, 1536)):
            wide, narrow = pick_config(rows, n, k), pick_config(rows, n, k, weight_bytes=1)
            if rows > CUDA_CORE_MAX_ROWS:
                assert narrow == wide
                continue
            assert not narrow.use_dot and narrow.block_n == wide.block_n
            assert narrow.block_k == min(2 * wide.block_k, triton.next_power_of_2(k))


@needs_triton
def test_fp8_linear_takes_the_skinny_kernel_for_a_few_16_bit_rows_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fp8_linear on a device taken to run triton: up to SKINNY_MAX_ROWS rows of a 16-bit
    x go to the skinny kernel as they are (nothing quantized); more rows, or a float32 x,
    are quantized per token for torch._scaled_mm."""
    from engine.kernels import fp8_linear, triton_linear

    skinny, quantized = [], []

    def recording_kernel(x, weight, weight_scale, bias):
        skinny.append((x.shape[0], x.dtype))
        return (x.float() @ (weight.float() * weight_scale.view(-1, 1)).T).to(x.dtype)

    def recording_quantize(x):
        quantized.append(x.shape[0])
        return fp8_linear.quantize_rows_torch(x)

    monkeypatch.setattr(fp8_linear, "use_triton", lambda x: True)
    monkeypatch.setattr(fp8_linear, "quantize_rows", recording_quantize)
    monkeypatch.setattr(triton_linear, "skinny_fp8_linear", recording_kernel)
    # torch._scaled_mm needs fp8 tensor cores: here a float32 product of the same operands.
    monkeypatch.setattr(
        torch,
        "_scaled_mm",
        lambda a, b, scale_a, scale_b, out_dtype: (
            (a.float() * scale_a) @ (b.float() * scale_b)
        ).to(out_dtype),
    )
    weight, scale = fp8_linear.quantize_rows_torch(torch.randn(32, 64))
    limit = fp8_linear.SKINNY_MAX_ROWS
    for rows, dtype in [(1, torch.bfloat16), (limit, torch.float16), (limit + 1, torch.bfloat16)]:
        skinny.clear(), quantized.clear()
        out = fp8_linear.fp8_linear(torch.randn(rows, 64, dtype=dtype), weight, scale.view(-1))
        assert out.shape == (rows, 32) and out.dtype == dtype
        assert (skinny, quantized) == (([(rows, dtype)], []) if rows <= limit else ([], [rows]))
    skinny.clear(), quantized.clear()
    fp8_linear.fp8_linear(torch.randn(1, 64), weight, scale.view(-1))
    assert (skinny, quantized) == ([], [1])


@needs_triton
def test_skinny_linear_rejects_what_it_does_not_read() -> None:
    """Checked on the host before any launch: strided operands, mixed or 32-bit dtypes."""
    from engine.kernels.triton_linear import skinny_linear

    x = torch.randn(2, 64, dtype=torch.bfloat16)
    weight = torch.randn(32, 64, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="contiguous"):
        skinny_linear(x, torch.randn(64, 32, dtype=torch.bfloat16).T)
    with pytest.raises(AssertionError, match="contiguous"):
        skinny_linear(torch.randn(64, 2, dtype=torch.bfloat16).T, weight)
    with pytest.raises(AssertionError, match="share a dtype"):
        skinny_linear(x, weight.half())
    with pytest.raises(AssertionError, match="16-bit"):
        skinny_linear(x.float(), weight.float())
    with pytest.raises(AssertionError):
        skinny_linear(x, weight, torch.randn(32))  # a float32 bias


@needs_triton
def test_linear_routes_only_small_contiguous_half_batches_to_the_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """linear() off the CPU, on meta tensors with triton taken to apply: the kernel for at
    most SKINNY_MAX_ROWS rows of contiguous bf16/fp16 (bias included, the LM head's shape
    too), F.linear for everything else."""
    from engine.kernels import triton_linear

    calls = []

    def recording_kernel(x, weight, bias=None):
        calls.append((tuple(x.shape), tuple(weight.shape), bias is not None))
        return F.linear(x, weight, bias)

    monkeypatch.setattr(llama, "use_triton", lambda x: True)
    monkeypatch.setattr(triton_linear, "skinny_linear", recording_kernel)

    def routed(x, weight, bias=None) -> bool:
        calls.clear()
        out = llama.linear(x, weight, bias)
        assert out.shape == (*x.shape[:-1], weight.shape[0])
        return bool(calls)

    limit = llama.SKINNY_MAX_ROWS
    bf16 = {"dtype": torch.bfloat16, "device": "meta"}
    weight, bias = torch.empty(4096, 1024, **bf16), torch.empty(4096, **bf16)
    assert routed(torch.empty(1, 1024, **bf16), weight)
    assert routed(torch.empty(limit, 1024, **bf16), weight, bias)
    assert routed(torch.empty(limit, 1024, **bf16), torch.empty(151936, 1024, **bf16))  # LM head
    half = {"dtype": torch.float16, "device": "meta"}
    assert routed(torch.empty(2, 1024, **half), torch.empty(4096, 1024, **half))

    assert not routed(torch.empty(limit + 1, 1024, **bf16), weight)  # a prefill
    assert not routed(torch.empty(1, 1024, device="meta"), torch.empty(4096, 1024, device="meta"))
    assert not routed(torch.empty(1024, 2, **bf16).T, weight)  # strided x
    assert not routed(torch.empty(1, 1, 1024, **bf16), weight)  # 3-D x
    assert not routed(torch.empty(1, 1024, **bf16), torch.empty(1024, 4096, **bf16).T)
    assert not routed(torch.empty(1, 1024, **bf16), weight, torch.empty(4096, device="meta"))

    monkeypatch.setattr(llama, "use_triton", lambda x: False)  # no triton, or not CUDA
    assert not routed(torch.empty(1, 1024, **bf16), weight)


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_importable()), reason="needs CUDA and triton"
)
def test_skinny_linear_captures_in_a_cuda_graph() -> None:
    """Captured once at a bucket's row count, replayed on new x: the new product."""
    from engine.kernels.triton_linear import skinny_linear

    x = torch.randn(4, 1024, dtype=torch.bfloat16, device="cuda")
    weight = torch.randn(6144, 1024, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()  # warm up (compile) off the default stream, as torch advises
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        skinny_linear(x, weight)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_linear(x, weight)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert_one_rounding_from(out, x.float() @ weight.float().T)


@needs_triton
@pytest.mark.skipif(INTERPRETED, reason="this is the outer run")
def test_skinny_linear_in_the_interpreter() -> None:
    rerun_interpreter_cases(__file__)
