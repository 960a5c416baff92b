"""Batched sampling: one row of logits per sampled token -> its token id (+ logprobs).

Per row, in order: repetition / presence / frequency penalties -> min_tokens ban (-inf)
-> token mask (-inf) -> temperature -> top-k -> top-p -> min-p (one descending sort shared
by the three) -> sample. Greedy rows take the argmax of the penalised, banned, masked
logits and skip the rest.

No host<->device sync: what depends on the batch's parameters (skip penalties, skip
filters, all greedy, skip logprobs) is decided on the host when SamplingRows.build makes
the rows. A stage that needs float32 makes it from the model's dtype. Without penalties,
bans or filters a CUDA step is one Triton pass over the logits (masks, temperature, the
counter-based noise and the race: engine/kernels/race.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

import numpy as np
import torch

from engine.kernels.race import exponential_race, unpack_bitmask
from engine.sampling_params import SamplingParams

_PROMPT_ROWS_PER_PASS = 1024  # prompt logprobs: float32 copies of at most 1024 x vocab


# A sampled row's numbers, in this order after the greedy flag _row_numbers puts first.
_ROW_NUMBERS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
# The arrays a SamplingRows uploads, in this order where they are not None.
_UPLOADED = ("numbers", "greedy", "seeds", "counters", "banned_ids", "allowed", "penalty_rows")

# What the uploaded fields hold: numpy arrays on the host, where build() makes them; tensors
# on the device in the copy on_device() returns, which the sampler reads.
Array = TypeVar("Array", np.ndarray, torch.Tensor)


@dataclass
class SamplingRows(Generic[Array]):
    """A step's sampling parameters, one row per token to sample: what the runner uploads,
    and then what the sampler reads."""

    numbers: Array  # float32 [len(_ROW_NUMBERS), R]
    greedy: Array  # bool [R]
    seeds: Array  # int64 [R]
    counters: Array  # int64 [R]: output tokens sampled before this one
    # int64 [R, N], padded with vocab_size: ids a row may not pick (EOS and stop ids while
    # below min_tokens); None when no row bans any.
    banned_ids: Array | None
    # The logits mask hook: int32 [R, ceil(vocab / 32)], bit v % 32 of word v // 32 set
    # where token v may be picked (all ones on rows without a mask); None: no row has one.
    allowed: Array | None
    penalty_rows: Array | None  # int64 [P]: rows with a penalty, whose history is read
    logprob_counts: list[int | None]  # per row, its params' logprobs (None: not asked)
    vocab_size: int
    uses_repetition: bool  # some row has a repetition penalty
    uses_counts: bool  # some row has a presence or frequency penalty
    needs_logprobs: bool  # some row asks for logprobs (its chosen token's, at least)
    max_num_logprobs: int  # K of the top-logprob tensors; 0 = none requested
    all_greedy: bool
    needs_filters: bool  # some sampled row uses top-k, top-p or min-p
    # On the device, where penalty_rows is set: the penalty rows' token histories, int64
    # [P, L] padded with the pad id vocab_size, a scratch column dropped after scattering.
    seen_token_ids: torch.Tensor | None = None  # prompt + output, for repetition
    output_token_ids: torch.Tensor | None = None  # output, for presence / frequency

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        counters: Sequence[int],
        banned_ids: Sequence[Sequence[int]],
        vocab_size: int,
        allowed: np.ndarray | None = None,
    ) -> SamplingRows[np.ndarray]:
        # One row of numbers per row, one table for the batch: a single pass over the params
        # (this runs every step, on the host, for every running sequence).
        table = np.array([_row_numbers(p, vocab_size) for p in params], dtype=np.float32)
        table = table.reshape(len(params), 1 + len(_ROW_NUMBERS))
        greedy = table[:, 0] != 0.0
        numbers = np.ascontiguousarray(table[:, 1:].T)
        column = dict(zip(_ROW_NUMBERS, numbers, strict=True))
        repetition = column["repetition_penalty"] != 1.0
        counts = (column["presence_penalty"] != 0.0) | (column["frequency_penalty"] != 0.0)
        penalised = np.flatnonzero(repetition | counts)
        # Greedy rows ignore the filters (_row_numbers turns theirs off), so a filtered
        # batch leaves their logits as they are and their argmax is the plain one.
        filters = (column["top_k"] < vocab_size) | (column["top_p"] < 1.0) | (column["min_p"] > 0.0)
        return cls(
            numbers=numbers,
            greedy=greedy,
            seeds=np.asarray(seeds, dtype=np.int64),
            counters=np.asarray(counters, dtype=np.int64),
            banned_ids=_padded(banned_ids, vocab_size) if any(banned_ids) else None,
            allowed=allowed,
            penalty_rows=penalised.astype(np.int64) if len(penalised) else None,
            logprob_counts=[p.logprobs for p in params],
            vocab_size=vocab_size,
            uses_repetition=bool(repetition.any()),
            uses_counts=bool(counts.any()),
            needs_logprobs=any(p.logprobs is not None for p in params),
            max_num_logprobs=max((p.logprobs or 0 for p in params), default=0),
            all_greedy=bool(greedy.all()),
            needs_filters=bool(filters.any()),
        )

    def arrays(self) -> list[np.ndarray]:
        """The arrays to upload, in the order on_device() takes them back."""
        return [a for a in (getattr(self, name) for name in _UPLOADED) if a is not None]

    def on_device(
        self, uploaded: list[torch.Tensor], seen: torch.Tensor | None, output: torch.Tensor | None
    ) -> SamplingRows[torch.Tensor]:
        """These rows with arrays() uploaded in place of the arrays, and the penalty rows'
        token histories."""
        tensors = iter(uploaded)
        moved = {n: next(tensors) for n in _UPLOADED if getattr(self, n) is not None}
        return replace(self, **moved, seen_token_ids=seen, output_token_ids=output)

    def column(self, name: str) -> Array:
        """One of _ROW_NUMBERS, per row, as _row_numbers makes them."""
        return self.numbers[_ROW_NUMBERS.index(name)]


def _row_numbers(p: SamplingParams, vocab_size: int) -> tuple[float, ...]:
    """A row's greedy flag (1.0 or 0.0), then its _ROW_NUMBERS. A greedy row gets
    temperature 1.0 (dividing is harmless) and every filter off; top-k off is vocab_size."""
    penalties = (p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
    if p.greedy:
        return (1.0, 1.0, vocab_size, 1.0, 0.0, *penalties)
    top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
    return (0.0, p.temperature, top_k, p.top_p, p.min_p, *penalties)


def _padded(rows: Sequence[Sequence[int]], pad_id: int) -> np.ndarray:
    width = max(len(row) for row in rows)
    padded = np.full((len(rows), width), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    return padded


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [B]
    # float32 [B]: logprob of the chosen token; None when no row asked for logprobs.
    logprobs: torch.Tensor | None
    # K = the batch's largest logprobs request; a row asking for k <= K reads its first k.
    top_token_ids: torch.Tensor | None  # int64 [B, K], most likely first
    top_logprobs: torch.Tensor | None  # float32 [B, K]


class Sampler:
    def __call__(self, logits: torch.Tensor, t: SamplingRows[torch.Tensor]) -> SamplerOutput:
        """logits [B, vocab] in any float dtype (the model's); they are not modified."""
        assert logits.dim() == 2 and logits.shape[1] == t.vocab_size, logits.shape
        adjusted = _penalise_and_ban(logits, t)
        temperature = t.column("temperature")
        if t.all_greedy and t.allowed is None:
            token_ids = adjusted.argmax(dim=-1)
        elif t.needs_filters:
            scaled = _apply_top_k_top_p_min_p(adjusted.float() / temperature[:, None], t)
            token_ids = exponential_race(scaled, None, t.greedy, t.seeds, t.counters)
        else:  # the race applies the token masks itself
            race = (adjusted, temperature, t.greedy, t.seeds, t.counters, t.allowed)
            token_ids = exponential_race(*race)
        if not t.needs_logprobs:
            return SamplerOutput(token_ids, None, None, None)

        # Logprobs describe the model's own distribution (log_softmax of the raw logits),
        # not the penalised / filtered / tempered one we sampled from: that is what the
        # OpenAI API reports, and it stays comparable across sampling settings.
        raw_logits = logits.float()
        log_normalizer = raw_logits.logsumexp(dim=-1)
        chosen = raw_logits.gather(1, token_ids[:, None]).squeeze(1) - log_normalizer
        top_ids = top_lps = None
        if t.max_num_logprobs > 0:
            top_values, top_ids = raw_logits.topk(t.max_num_logprobs, dim=-1)
            top_lps = top_values - log_normalizer[:, None]
        return SamplerOutput(token_ids, chosen, top_ids, top_lps)


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logprobs of a prompt: row i of logits (any float dtype) predicts next_token_ids[i].
    Returns (logprob of next_token_ids [L], top-k ids [L, k], their logprobs [L, k]).
    Rows go through float32 _PROMPT_ROWS_PER_PASS at a time: a long prefill's logits stay
    in the model's dtype, and its float32 copies small beside them (the step's memory peak)."""
    chosen, top_ids, top_lps = [], [], []
    per_pass = _PROMPT_ROWS_PER_PASS
    for rows, ids in zip(logits.split(per_pass), next_token_ids.split(per_pass), strict=True):
        logprobs = rows.float().log_softmax(dim=-1)
        chosen.append(logprobs.gather(1, ids[:, None].long()).squeeze(1))
        values, indices = logprobs.topk(k, dim=-1)
        top_lps.append(values)
        top_ids.append(indices)
    return torch.cat(chosen), torch.cat(top_ids), torch.cat(top_lps)


def _scatter_count(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-row occurrence counts [B, V] of padded ids (pad = vocab_size, dropped)."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _penalise_and_ban(logits: torch.Tensor, t: SamplingRows[torch.Tensor]) -> torch.Tensor:
    """The logits as they are when no row has a penalty, a ban or a mask the filters must
    see (without filters the race applies the masks); else a float32 copy with the
    penalties applied and every id a row may not pick at -inf."""
    masks_here = t.allowed is not None and t.needs_filters
    if t.penalty_rows is None and t.banned_ids is None and not masks_here:
        return logits
    logits = logits.float()  # a copy, or a new tensor: the caller's logits stay as they are
    vocab, rows = t.vocab_size, t.penalty_rows
    if rows is not None:
        penalised = logits[rows]
        if t.uses_repetition:
            # HF / CTRL style: push every seen token towards "less likely" whatever its sign.
            seen = _scatter_count(t.seen_token_ids, vocab) > 0
            penalty = t.column("repetition_penalty")[rows][:, None]
            pushed = torch.where(penalised > 0, penalised / penalty, penalised * penalty)
            penalised = torch.where(seen, pushed, penalised)
        if t.uses_counts:
            # OpenAI style: minus per generated occurrence (frequency), once if any (presence).
            counts = _scatter_count(t.output_token_ids, vocab)
            penalised = penalised - t.column("frequency_penalty")[rows][:, None] * counts
            penalised = penalised - t.column("presence_penalty")[rows][:, None] * (counts > 0)
        logits = logits.index_copy(0, rows, penalised)
    if t.banned_ids is not None:
        logits = logits.masked_fill(_scatter_count(t.banned_ids, vocab) > 0, float("-inf"))
    if masks_here:
        logits = logits.masked_fill(~unpack_bitmask(t.allowed, vocab), float("-inf"))
    return logits


def _apply_top_k_top_p_min_p(logits: torch.Tensor, t: SamplingRows[torch.Tensor]) -> torch.Tensor:
    """Set filtered-out logits to -inf. Each filter always keeps the most likely token."""
    top_k, top_p, min_p = t.column("top_k").long(), t.column("top_p"), t.column("min_p")
    # Stable, so ties at the top-k boundary are cut the same way on every device.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(logits.shape[1], device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
    # top-p and min-p act on the distribution left after top-k (min-p is a ratio to the
    # top probability, so renormalising does not change it).
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # top_p == 1 keeps everything, even where the float32 cumsum creeps up to 1 early.
    outside_top_p = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    below_min_p = sorted_probs < min_p[:, None] * sorted_probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(outside_top_p | below_min_p, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
