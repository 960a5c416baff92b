"""SamplingRows on the device from per-row host lists: what the runner builds from the
persistent batch, made directly for the sampler's own tests."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from engine.core.sampler import SamplingRows
from engine.sampling_params import SamplingParams


def sampling_tensors(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    banned_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
    counters: Sequence[int] | None = None,
    allowed: np.ndarray | None = None,
) -> SamplingRows[torch.Tensor]:
    """counters default to len(output_ids): each row has sampled its outputs so far."""
    counters = [len(o) for o in output_ids] if counters is None else counters
    rows = SamplingRows.build(params, seeds, counters, banned_ids, vocab_size, allowed)
    uploaded = [torch.from_numpy(a).to(device) for a in rows.arrays()]
    seen = counted = None
    if rows.penalty_rows is not None:
        picked = rows.penalty_rows.tolist()
        seen = _padded([[*prompt_ids[r], *output_ids[r]] for r in picked], vocab_size, device)
        counted = _padded([list(output_ids[r]) for r in picked], vocab_size, device)
    return rows.on_device(uploaded, seen, counted)


def _padded(rows: list[list[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    width = max(map(len, rows), default=0)
    padded = [row + [pad] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(rows), width)
