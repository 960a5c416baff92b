"""The experts of a sparse layer as one grouped computation on the GPU.

The router gives each token k (weight, expert) pairs; the T*k (token, slot) pairs are
laid out by expert on the device (no host sync, every size fixed by T and k), so each
expert's rows are contiguous and one grouped GEMM runs every expert at once. Two
implementations of the two GEMMs:

- `triton_experts`: our Triton kernel. Each expert's rows are padded to the kernel's
  BLOCK_M (engine/kernels/triton_moe.py's `align_rows`, three small kernels), so every
  program's BLOCK_M rows belong to one expert and it reads that expert's weight tile only;
  padding rows are marked invalid and never loaded or stored. The worst-case padded size
  (`padded_size`) is fixed by T, so the grid is too; programs past the last expert's rows
  return at once. The first GEMM gathers the token rows itself (row = pair // k) and
  applies silu_and_mul in its epilogue, the second multiplies each output row by its
  router weight.
- `grouped_mm_experts`: torch._grouped_mm over the rows sorted by expert
  (`group_by_expert`: a stable sort, counts by scatter_add_) with the per-expert
  cumulative row counts as offsets (torch >= 2.8; on CUDA it needs sm90 and bf16, and
  strides that are multiples of 16 bytes: `grouped_mm_fits`).

Between the two GEMMs silu_and_mul (rounded as the kernel of that name rounds, in both
implementations); after them each token's k outputs, weighted by the
router in float32, are summed in float32 in slot order (deterministic: no atomics) and
rounded once to x's dtype.
Accumulation is float32 throughout. engine/model/moe.py picks one per row count on CUDA;
the reference path (Experts.forward on the CPU) is what both are tested against.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from engine.kernels.activation import silu_and_mul


@dataclass(frozen=True)
class MoeTiles:
    """Block sizes of the Triton grouped GEMM. Untuned starting points until
    benchmarks/gpu_moe.py --tile-sweep measures them: BLOCK_M 16 (tl.dot's least) for
    decode, where an expert gets a handful of rows, 32 for a busy decode, 64 for prefill."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


DECODE_TILES = MoeTiles(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=3)
BUSY_DECODE_TILES = MoeTiles(block_m=32, block_n=64, block_k=128, num_warps=4, num_stages=3)
PREFILL_TILES = MoeTiles(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)


def pick_tiles(num_pairs: int, num_experts: int) -> MoeTiles:
    """The tiles of the smallest BLOCK_M that an expert's rows rarely exceed: an expert
    with more rows than BLOCK_M reads its weights once per block of them. Under even
    routing its rows are about Poisson of mean pairs / experts; rarely is past the mean by
    three standard deviations (at Qwen3-30B-A3B's 256-token decode, mean 16, BLOCK_M 16
    would read 43% of the experts twice)."""
    mean = num_pairs / num_experts
    busiest = mean + 3 * math.sqrt(mean)
    if busiest <= DECODE_TILES.block_m:
        return DECODE_TILES
    return BUSY_DECODE_TILES if busiest <= BUSY_DECODE_TILES.block_m else PREFILL_TILES


@dataclass(frozen=True)
class Grouping:
    """The T*k (token, slot) pairs, flattened as token * k + slot, in expert order."""

    order: torch.Tensor  # [T*k] int64: pair index of each sorted row (stable within an expert)
    counts: torch.Tensor  # [E] int64: rows per expert
    ends: torch.Tensor  # [E] int32: cumulative counts, _grouped_mm's offsets


def group_by_expert(experts: torch.Tensor, num_experts: int) -> Grouping:
    """Sort the pairs of `experts` [T, k] by expert id on the device (no host sync)."""
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    return Grouping(order, counts, counts.cumsum(0).to(torch.int32))


def padded_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows after padding each expert to block_m, at worst: only experts with rows pad, by
    at most block_m - 1 each, and the padded total is a multiple of block_m."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return bound // block_m * block_m


def combine(
    pair_out: torch.Tensor, num_tokens: int, dtype: torch.dtype, weights: torch.Tensor | None
) -> torch.Tensor:
    """[T*k, H] expert outputs in pair order -> [T, H]: each token's k (times `weights`
    [T, k] where not yet weighted) summed in float32, in slot order, rounded once."""
    per_token = pair_out.view(num_tokens, -1, pair_out.shape[-1])
    if weights is not None:
        per_token = per_token.float() * weights.float().unsqueeze(-1)
    # Summed in float32 as read: no float32 copy of the k outputs first.
    return per_token.sum(1, dtype=torch.float32).to(dtype)


# ---- torch._grouped_mm ---------------------------------------------------------------


def grouped_mm_fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """_grouped_mm's layout rules: rows of A and columns of B (the weights' rows, read
    transposed) contiguous, every leading stride a multiple of 16 bytes; on CUDA bf16."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.is_cuda and (x.dtype != torch.bfloat16 or not _sm90_or_newer(x.device)):
        return False
    align = 16 // x.element_size()
    dims = (x.shape[-1], gate_up.shape[1], down.shape[1], down.shape[2])
    tensors = (gate_up, down)
    return all(d % align == 0 for d in dims) and all(
        t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors
    )


@functools.cache
def _sm90_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (9, 0)


def grouped_mm_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """The experts over x [T, H] for router (weights, experts) [T, k] by torch._grouped_mm;
    gate_up [E, 2I, H], down [E, H, I]. Returns [T, H] in x's dtype."""
    num_tokens, top_k = experts.shape
    g = group_by_expert(experts, gate_up.shape[0])
    rows = x[g.order // top_k]  # a fresh contiguous copy: row major, 16-byte aligned
    hidden = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=g.ends)
    hidden = torch._grouped_mm(silu_and_mul(hidden), down.transpose(-2, -1), offs=g.ends)
    pair_out = torch.empty_like(hidden)
    pair_out[g.order] = hidden  # back to pair order (`order` is a permutation): exact
    return combine(pair_out, num_tokens, x.dtype, weights)


# ---- the Triton kernel ---------------------------------------------------------------


def triton_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    tiles: MoeTiles | None = None,
) -> torch.Tensor:
    """The experts over x [T, H] by the Triton grouped GEMM, twice; as grouped_mm_experts.
    x, gate_up and down must be contiguous; `tiles` overrides pick_tiles."""
    from engine.kernels import triton_moe

    num_tokens, top_k = experts.shape
    num_experts = gate_up.shape[0]
    num_pairs = num_tokens * top_k
    tiles = tiles or pick_tiles(num_pairs, num_experts)
    size = padded_size(num_pairs, num_experts, tiles.block_m)
    pair_of_row, block_expert = triton_moe.align_rows(experts, num_experts, tiles.block_m, size)
    launch = dataclasses.asdict(tiles)
    hidden = triton_moe.grouped_gemm(
        x, gate_up, pair_of_row, block_expert, top_k, None, gated=True, **launch
    )
    route = weights.reshape(-1)
    pair_out = triton_moe.grouped_gemm(hidden, down, pair_of_row, block_expert, 1, route, **launch)
    return combine(pair_out, num_tokens, x.dtype, None)
