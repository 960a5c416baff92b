"""Batched sampling: one row of logits per sequence -> next token id (+ logprobs).

Per row, in order: repetition / presence / frequency penalties -> min_tokens ban (-inf)
-> temperature -> top-k -> top-p -> min-p (one descending sort shared by the three)
-> sample. Greedy rows take the argmax of the penalised, banned logits and skip the rest.

Everything is vectorized on whatever device the logits live on, with no host<->device
sync: the decisions that depend on the batch's parameters (skip penalties, skip filters,
all greedy, skip logprobs) are made on the host from the SamplingParams when the tensors
are built. The logits come in the model's dtype; each stage that needs float32 makes it.
In the common case (no penalty, ban or filter) a CUDA step is one Triton pass over the
logits: temperature, noise, race and the greedy rows' argmax together.

Randomness is counter-based, not a torch.Generator: row r's uniform for token v is a
32-bit integer hash of (seed_r, counter_r, v), where counter_r is how many tokens the row
has generated. A row's draw therefore depends only on its own seed, step and logits, never
on its batch-mates or its position in the batch; the integer hash gives bit-identical
uniforms on every device. The draw itself is an
exponential race: argmax_v(p_v / E_v) with E_v = -log(u_v) ~ Exp(1) picks v with
probability exactly p_v.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.kernels.dispatch import use_triton
from engine.sampling_params import SamplingParams

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # 2^32 / golden ratio: the Weyl step between vocab entries
_SEED_SALT = 0x5BD1E995  # keeps seed 0 away from the hash's fixed point at 0
_UNIFORM_BITS = 23  # (k + 0.5) / 2^23 is exact in float32 and strictly inside (0, 1)
_PROMPT_ROWS_PER_PASS = 1024  # prompt logprobs: float32 copies of at most 1024 x vocab


# The per-row numbers of a sampled row, in _row_numbers' order.
_ROW_NUMBERS = (
    "temperature",
    "greedy",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass
class SamplingRows:
    """A step's sampling parameters on the host, one row per token to sample: what the
    runner uploads. Decisions that depend on the whole batch (skip penalties, filters,
    logprobs; all greedy) are made here, so the device never has to report back."""

    numbers: np.ndarray  # float32 [len(_ROW_NUMBERS), R]
    seeds: np.ndarray  # int64 [R]
    counters: np.ndarray  # int64 [R]: output tokens sampled before this one
    # int64 [R, N], padded with vocab_size: ids a row may not pick (EOS and stop ids while
    # below min_tokens); None when no row bans any.
    banned_ids: np.ndarray | None
    # The logits mask hook: int32 [R, ceil(vocab / 32)], bit v % 32 of word v // 32 set
    # where token v may be picked (all ones on rows without a mask); None: no row has one.
    allowed: np.ndarray | None
    penalty_rows: np.ndarray | None  # int64 [P]: rows with a penalty, whose history is read
    logprob_counts: list[int | None]  # per row, its params' logprobs (None: not asked)
    vocab_size: int
    uses_repetition: bool  # some row has a repetition penalty
    uses_counts: bool  # some row has a presence or frequency penalty
    needs_logprobs: bool  # some row asks for logprobs (its chosen token's, at least)
    max_num_logprobs: int  # K of the top-logprob tensors; 0 = none requested
    all_greedy: bool
    needs_filters: bool  # some sampled row uses top-k, top-p or min-p

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        counters: Sequence[int],
        banned_ids: Sequence[Sequence[int]],
        vocab_size: int,
        allowed: np.ndarray | None = None,
    ) -> SamplingRows:
        # One row of numbers per row, one table for the batch: a single pass over the params
        # (this runs every step, on the host, for every running sequence).
        table = np.array([_row_numbers(p, vocab_size) for p in params], dtype=np.float32)
        table = np.ascontiguousarray(table.reshape(len(params), len(_ROW_NUMBERS)).T)
        column = dict(zip(_ROW_NUMBERS, table, strict=True))
        repetition = column["repetition_penalty"] != 1.0
        counts = (column["presence_penalty"] != 0.0) | (column["frequency_penalty"] != 0.0)
        penalised = np.flatnonzero(repetition | counts)
        is_greedy = column["greedy"] != 0.0
        return cls(
            numbers=table,
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
            all_greedy=bool(is_greedy.all()),
            # Greedy rows ignore the filters (_row_numbers turns theirs off), so a filtered
            # batch leaves their logits as they are and their argmax is the plain one.
            needs_filters=bool(
                (
                    (column["top_k"] < vocab_size)
                    | (column["top_p"] < 1.0)
                    | (column["min_p"] > 0.0)
                ).any()
            ),
        )

    def arrays(self) -> list[np.ndarray]:
        """The arrays to upload, in the order on_device() takes them back."""
        optional = (self.banned_ids, self.allowed, self.penalty_rows)
        return [self.numbers, self.seeds, self.counters, *(a for a in optional if a is not None)]

    def on_device(
        self,
        uploaded: list[torch.Tensor],
        seen_ids: torch.Tensor | None = None,
        output_ids: torch.Tensor | None = None,
    ) -> SamplingTensors:
        """The tensors, from arrays() uploaded, and the penalty rows' token histories."""
        numbers, seeds, counters, *rest = uploaded
        optional = iter(rest)
        banned, allowed, penalty_rows = (
            next(optional) if a is not None else None
            for a in (self.banned_ids, self.allowed, self.penalty_rows)
        )
        column = dict(zip(_ROW_NUMBERS, numbers, strict=True))
        return SamplingTensors(
            temperature=column["temperature"],
            is_greedy=column["greedy"] != 0.0,
            top_k=column["top_k"].long(),
            top_p=column["top_p"],
            min_p=column["min_p"],
            repetition_penalty=column["repetition_penalty"],
            presence_penalty=column["presence_penalty"],
            frequency_penalty=column["frequency_penalty"],
            seeds=seeds,
            counters=counters,
            banned_token_ids=banned,
            allowed=allowed,
            penalty_rows=penalty_rows,
            seen_token_ids=seen_ids if self.uses_repetition else None,
            output_token_ids=output_ids if self.uses_counts else None,
            vocab_size=self.vocab_size,
            needs_logprobs=self.needs_logprobs,
            max_num_logprobs=self.max_num_logprobs,
            all_greedy=self.all_greedy,
            needs_filters=self.needs_filters,
        )


@dataclass
class SamplingTensors:
    """The batch's sampling parameters as device tensors, one row per token to sample."""

    temperature: torch.Tensor  # float32 [R]; 1.0 on greedy rows so dividing is harmless
    is_greedy: torch.Tensor  # bool [R]
    top_k: torch.Tensor  # int64 [R]; vocab_size where top-k is off
    top_p: torch.Tensor  # float32 [R]
    min_p: torch.Tensor  # float32 [R]
    repetition_penalty: torch.Tensor  # float32 [R]
    presence_penalty: torch.Tensor  # float32 [R]
    frequency_penalty: torch.Tensor  # float32 [R]
    seeds: torch.Tensor  # int64 [R]
    counters: torch.Tensor  # int64 [R]: tokens this row has generated so far
    banned_token_ids: torch.Tensor | None  # int64 [R, N], pad vocab_size
    allowed: torch.Tensor | None  # int32 [R, ceil(V / 32)]: SamplingRows.allowed
    # The rows with a penalty, and their token histories: int64 [P, L] padded with the
    # pad id vocab_size, a scratch column dropped after scattering. None skips the stage.
    penalty_rows: torch.Tensor | None  # int64 [P]
    seen_token_ids: torch.Tensor | None  # prompt + output, for repetition
    output_token_ids: torch.Tensor | None  # output, for presence / frequency
    vocab_size: int
    needs_logprobs: bool
    max_num_logprobs: int
    all_greedy: bool
    needs_filters: bool


def _row_numbers(p: SamplingParams, vocab_size: int) -> tuple[float, ...]:
    """A row's sampling numbers. A greedy row gets temperature 1.0 (dividing is harmless)
    and every filter off; top-k off is vocab_size."""
    if p.greedy:
        return (1.0, 1.0, vocab_size, 1.0, 0.0, *_penalties(p))
    top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
    return (p.temperature, 0.0, top_k, p.top_p, p.min_p, *_penalties(p))


def _penalties(p: SamplingParams) -> tuple[float, float, float]:
    return (p.repetition_penalty, p.presence_penalty, p.frequency_penalty)


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
    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        """logits [B, vocab] in any float dtype (the model's); they are not modified."""
        assert logits.dim() == 2 and logits.shape[1] == t.vocab_size, logits.shape
        adjusted = _penalise_and_ban(logits, t)
        if t.all_greedy:
            token_ids = adjusted.argmax(dim=-1)
        elif t.needs_filters:
            scaled = adjusted.float() / t.temperature[:, None]
            scaled = _apply_top_k_top_p_min_p(scaled, t.top_k, t.top_p, t.min_p)
            token_ids = exponential_race(scaled, None, t.is_greedy, t.seeds, t.counters)
        else:
            token_ids = exponential_race(adjusted, t.temperature, t.is_greedy, t.seeds, t.counters)
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
    parts = [
        _prompt_logprobs(rows, ids, k)
        for rows, ids in zip(
            logits.split(_PROMPT_ROWS_PER_PASS),
            next_token_ids.split(_PROMPT_ROWS_PER_PASS),
            strict=True,
        )
    ]
    if len(parts) == 1:
        return parts[0]
    chosen, top_ids, top_lps = (torch.cat(column) for column in zip(*parts, strict=True))
    return chosen, top_ids, top_lps


def _prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, next_token_ids[:, None].long()).squeeze(1)
    top_lps, top_ids = logprobs.topk(k, dim=-1)
    return chosen, top_ids, top_lps


def exponential_race(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    is_greedy: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
) -> torch.Tensor:
    """Per row of logits [B, V] (any float dtype): the argmax on greedy rows; on the others
    argmax_v(softmax(scaled)_v / E_v), scaled = logits / temperature (temperature None: the
    logits are already scaled) and E from exponential_noise: a draw from softmax(scaled).

    On CUDA one Triton pass over the logits does it all (the noise never exists in memory,
    and the race runs in log space: argmax(scaled_v - log E_v)); the same tokens either way.
    """
    if use_triton(logits):
        from engine.kernels import triton_kernels

        return triton_kernels.exponential_race(logits, temperature, is_greedy, seeds, counters)
    return exponential_race_torch(logits, temperature, is_greedy, seeds, counters)


def exponential_race_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    is_greedy: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
) -> torch.Tensor:
    logits = logits.float()
    scaled = logits if temperature is None else logits / temperature[:, None]
    noise = exponential_noise(seeds, counters, logits.shape[-1])
    sampled = (scaled.softmax(dim=-1) / noise).argmax(dim=-1)
    return torch.where(is_greedy, logits.argmax(dim=-1), sampled)


def row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Each row's 32-bit key (int64 [B]): its seed and counter, hashed together."""
    seed_lo = seeds & _MASK32
    seed_hi = (seeds >> 32) & _MASK32  # arithmetic shift; the mask makes negatives fine
    key = _fmix32(seed_lo ^ _SEED_SALT)
    key = _fmix32(key ^ seed_hi)
    return _fmix32(key ^ (counters & _MASK32))


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws [B, V], a pure function of (seed, counter, vocab index) per entry."""
    # SplitMix-style: walk a Weyl sequence from the row key, then finalise each step.
    vocab_offsets = _mul32(torch.arange(vocab_size, device=seeds.device), _GOLDEN32)
    bits = _fmix32((row_keys(seeds, counters)[:, None] + vocab_offsets[None, :]) & _MASK32)
    uniform = ((bits >> (32 - _UNIFORM_BITS)).float() + 0.5) * 2.0**-_UNIFORM_BITS
    return -torch.log(uniform)


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for x in [0, 2^32), without overflowing int64."""
    low_half, high_half = constant & 0xFFFF, constant >> 16
    return (x * low_half + (((x * high_half) & 0xFFFF) << 16)) & _MASK32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: a bijection on [0, 2^32) with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _scatter_count(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-row occurrence counts [B, V] of padded ids (pad = vocab_size, dropped)."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _row_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return _scatter_count(ids, vocab_size) > 0


def _penalise_and_ban(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The logits as they are when no row has a penalty, a ban or a mask; else a float32
    copy with the penalties applied and every id a row may not pick at -inf."""
    if t.penalty_rows is None and t.banned_token_ids is None and t.allowed is None:
        return logits
    logits = logits.float()  # a copy, or a new tensor: the caller's logits stay as they are
    if t.penalty_rows is not None:
        rows = t.penalty_rows
        logits = logits.index_copy(0, rows, _apply_penalties(logits[rows], t))
    if t.banned_token_ids is not None:
        logits = logits.masked_fill(_row_mask(t.banned_token_ids, t.vocab_size), float("-inf"))
    if t.allowed is not None:
        logits = logits.masked_fill(~unpack_bitmask(t.allowed, t.vocab_size), float("-inf"))
    return logits


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size] from int32 [R, ceil(vocab_size / 32)]: bit v % 32 of word v // 32."""
    vocab = torch.arange(vocab_size, device=words.device)
    return (words[:, vocab // 32] >> (vocab % 32).to(torch.int32)) & 1 == 1


def _apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The penalty rows' logits (float32 [P, V]) with their penalties applied."""
    rows = t.penalty_rows
    if t.seen_token_ids is not None:
        # HF / CTRL style: push every seen token towards "less likely" whatever its sign.
        seen = _row_mask(t.seen_token_ids, t.vocab_size)
        penalty = t.repetition_penalty[rows][:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if t.output_token_ids is not None:
        # OpenAI style: subtract per generated occurrence (frequency) and once if any (presence).
        counts = _scatter_count(t.output_token_ids, t.vocab_size)
        logits = (
            logits
            - t.frequency_penalty[rows][:, None] * counts
            - t.presence_penalty[rows][:, None] * (counts > 0).float()
        )
    return logits


def _apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set filtered-out logits to -inf. Each filter always keeps the most likely token."""
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
