"""fp8 weights: checkpoints published in float8, and bf16 ones quantized on load.

A checkpoint's config.json says `quantization_config.quant_method == "fp8"`, and each
quantized projection `X.weight` is float8_e4m3fn [N, K] beside its scale, the real weight
being weight * scale:
    X.weight_scale_inv  [ceil(N / bn), ceil(K / bk)]   per block, weight_block_size [bn, bk]
                                                       (transformers' fine-grained layout:
                                                       Qwen3-*-FP8, DeepSeek-V3)
    X.weight_scale_inv or X.weight_scale, one value    per tensor
    X.weight_scale      [N] or [N, 1]                  per output row
Which tensors are fp8 is read off their dtypes, so `modules_to_not_convert` /
`ignored_layers` need no reading: those modules' tensors are in the model's dtype. With
activation_scheme "static" each projection also has `X.input_scale` (or
`X.activation_scale`); it is checked and not used: activations are quantized per token as
they come, which is never coarser than one calibrated scale per tensor.

Where fp8 runs (engine/kernels/fp8_linear.py: CUDA of compute capability 8.9 or newer)
the projections (qkv, o, gate_up, down) become Fp8Linear modules: an fp8 weight and one
float32 scale per output row. Row scales make every merge exact: q, k and v (gate and up)
keep their own, whatever their checkpoint scales were. Per-tensor and per-row checkpoint
scales are kept as they are; block scales become row scales, each row dequantized and
quantized again with its own amax (one more rounding of each weight, within e4m3's step).
torch._scaled_mm also has a 128x128-block recipe, but only on sm90 with a recent cuBLAS
and with activations scaled per 128 columns; the rowwise recipe runs on sm89 and sm90
alike, so every fp8 projection takes the one path. `quantization = "fp8"` quantizes a
checkpoint's projections the same way as they load, and fails at start anywhere else.
Anywhere else (the CPU, older GPUs, the embeddings, the LM head) fp8 checkpoint weights are
dequantized to the model's dtype at load. A mixture of experts is dequantized whole on the
CPU and refused where fp8 runs: its experts would need an fp8 grouped GEMM.

Under tensor parallelism a rank reads its rows or columns of each weight and the part of the
scale that goes with them (`scale_index`): a per-tensor scale whole, per-row scales the rows
of a column-parallel shard and all of them for a row-parallel one, block scales the blocks
its part covers, which must be whole blocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import nn

from engine.errors import ModelLoadError
from engine.kernels.fp8_linear import FP8, fp8_linear, quantize_rows

# The projections that can be Fp8Linear modules (llama.py's Linear of these names).
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Checkpoint tensors beside an fp8 weight, by suffix: the weight's scale, or the static
# activation scale.
WEIGHT_SCALES = (".weight_scale_inv", ".weight_scale")
INPUT_SCALES = (".input_scale", ".activation_scale")


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What config.json's quantization_config says of an fp8 checkpoint."""

    block: tuple[int, int] | None  # weight_block_size; None: per-tensor or per-row scales

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> Fp8Checkpoint | None:
        """None for a checkpoint without quantization_config; one ModelLoadError line for
        any other quantization or an fp8 variant we do not load."""
        q = d.get("quantization_config")
        if q is None:
            return None
        method = q.get("quant_method")
        if method != "fp8":
            raise ModelLoadError(
                f"unsupported quantization_config quant_method {method!r}; only 'fp8' is supported"
            )
        scheme = q.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            _unsupported("activation_scheme", scheme, "'dynamic' or 'static'")
        if q.get("fmt", "e4m3") != "e4m3":
            _unsupported("fmt", q["fmt"], "'e4m3'")
        if q.get("scale_fmt", "float") != "float":
            _unsupported("scale_fmt", q["scale_fmt"], "'float'")
        block = q.get("weight_block_size")
        if block is None:
            return cls(block=None)
        if not (
            isinstance(block, list | tuple)
            and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)
        ):
            _unsupported("weight_block_size", block, "two positive integers")
        return cls(block=(block[0], block[1]))

    def dequantize(self, name: str, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The float32 values of checkpoint weight `name` (fp8 [N, K]) and its scale."""
        self.check_weight(name, weight)
        n, k = weight.shape
        scale = scale.float()
        if scale.numel() == 1:  # per tensor
            return weight.float() * scale.reshape(())
        if tuple(scale.shape) in ((n,), (n, 1)):  # per output row
            return weight.float() * scale.reshape(n, 1)
        if self.block is not None and scale.dim() == 2:
            bn, bk = self.block
            if tuple(scale.shape) == (math.ceil(n / bn), math.ceil(k / bk)):
                per_element = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
                return weight.float() * per_element
        raise ModelLoadError(
            f"the scale of fp8 tensor {name!r} [{n}, {k}] has shape {tuple(scale.shape)}; "
            f"expected one value, [{n}] or [{n}, 1]"
            + (f", or blocks of {list(self.block)}" if self.block is not None else "")
        )

    def rows(
        self, name: str, weight: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An fp8 weight [N, K] with one float32 scale per row [N] (Fp8Linear's layout):
        per-tensor and per-row scales as they are, block scales requantized by row."""
        self.check_weight(name, weight)
        n = weight.shape[0]
        if scale.numel() == 1:
            return weight, scale.float().reshape(1).expand(n)
        if tuple(scale.shape) in ((n,), (n, 1)):
            return weight, scale.float().reshape(n)
        return quantized(self.dequantize(name, weight, scale))

    def scale_index(
        self,
        name: str,
        weight_shape: Sequence[int],
        scale_shape: Sequence[int],
        weight_index: tuple[int, Sequence[int]],
    ) -> tuple[int, Sequence[int]] | None:
        """(dim, indices) of the scale of checkpoint weight `name` that go with the part of
        the weight `weight_index` reads (its dim and indices); None for all of the scale."""
        dim, index = weight_index
        if math.prod(scale_shape) == 1:  # per tensor
            return None
        if tuple(scale_shape) in ((weight_shape[0],), (weight_shape[0], 1)):  # per output row
            return (0, index) if dim == 0 else None
        if self.block is None or len(scale_shape) != 2:
            return None  # not a block grid: dequantize names the shape it cannot read
        # Each block the part covers must be all of it: a block's scale is one value for
        # rows (columns) that a rank cannot share with another.
        size, block = weight_shape[dim], self.block[dim]
        blocks: list[int] = []
        i = 0
        while i < len(index):
            whole = range(index[i] // block * block, min((index[i] // block + 1) * block, size))
            if tuple(index[i : i + len(whole)]) != tuple(whole):
                what = ("rows", "columns")[dim]
                raise ModelLoadError(
                    f"fp8 tensor {name!r} {list(weight_shape)}: a tensor-parallel shard holds "
                    f"{what} {index[0]}..{index[-1]} of its {size}, not whole blocks of "
                    f"weight_block_size {list(self.block)}; choose a tensor_parallel_size "
                    f"that splits its {size} {what} on multiples of {block}"
                )
            blocks.append(index[i] // block)
            i += len(whole)
        return dim, blocks

    @staticmethod
    def check_weight(name: str, weight: torch.Tensor) -> None:
        if weight.dtype != FP8 or weight.dim() != 2:
            raise ModelLoadError(
                f"fp8 tensor {name!r} is {weight.dtype} {tuple(weight.shape)}; only 2-D "
                "float8_e4m3fn weights are supported"
            )


def quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] in fp8 with one float32 scale per output row [N]."""
    weight_fp8, scale = quantize_rows(weight)
    return weight_fp8, scale.view(-1)


def check_input_scale(name: str, scale: torch.Tensor) -> None:
    """A static activation scale: one value (read, not used: activations scale per token)."""
    if scale.numel() != 1:
        raise ModelLoadError(
            f"activation scale {name!r} has shape {tuple(scale.shape)}; only one value per "
            "tensor is supported"
        )


class Fp8Linear(nn.Module):
    """A projection with an fp8 weight [N, K] and one float32 scale per output row [N]."""

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(out_features, dtype=torch.float32), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.bias)


def use_fp8_linears(model: nn.Module, names: set[str]) -> None:
    """Make the projections `names` (module names in `model`) Fp8Linear modules."""
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        setattr(parent, child, Fp8Linear(old.in_features, old.out_features, old.bias is not None))


def _unsupported(key: str, value: object, expected: str) -> NoReturn:
    raise ModelLoadError(
        f"unsupported fp8 quantization_config {key}={value!r} (expected {expected})"
    )
