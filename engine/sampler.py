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


@dataclass
class SamplingTensors:
    """The batch's sampling parameters as device tensors, one row per sequence."""

    temperature: torch.Tensor  # float32 [B]; 1.0 on greedy rows so dividing is harmless
    is_greedy: torch.Tensor  # bool [B]
    top_k: torch.Tensor  # int64 [B]; vocab_size where top-k is off
    top_p: torch.Tensor  # float32 [B]
    min_p: torch.Tensor  # float32 [B]
    repetition_penalty: torch.Tensor  # float32 [B]
    presence_penalty: torch.Tensor  # float32 [B]
    frequency_penalty: torch.Tensor  # float32 [B]
    seeds: torch.Tensor  # int64 [B]
    counters: torch.Tensor  # int64 [B]: tokens this row has generated so far
    # Padded id lists; the pad id is vocab_size, a scratch column dropped after scattering.
    # None when no row in the batch needs them, which also skips that stage.
    seen_token_ids: torch.Tensor | None  # int64 [B, S]: prompt + output, for repetition
    output_token_ids: torch.Tensor | None  # int64 [B, O]: output, for presence / frequency
    banned_token_ids: torch.Tensor | None  # int64 [B, N]: ids a row may not pick this step
    vocab_size: int
    needs_logprobs: bool  # some row asks for logprobs (its chosen token's, at least)
    max_num_logprobs: int  # K of the top-logprob tensors; 0 = none requested
    all_greedy: bool
    needs_filters: bool  # some sampled row uses top-k, top-p or min-p

    @classmethod
    def from_rows(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        prompt_ids: Sequence[Sequence[int]],
        output_ids: Sequence[Sequence[int]],
        banned_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device | str,
        counters: Sequence[int] | None = None,
    ) -> SamplingTensors:
        """Build from per-row host data. counters: per row, the output tokens it has sampled
        before this one (default: len(output_ids), when the host has them all). banned_ids:
        per row, the ids it may not pick now (EOS and stop_token_ids while it has fewer than
        min_tokens outputs; else empty)."""
        assert len(params) == len(seeds) == len(prompt_ids) == len(output_ids) == len(banned_ids)

        # One row of numbers per row, one table for the batch: a single pass over the params
        # (this runs every step, on the host, for every running sequence).
        table = np.array([_row_numbers(p, vocab_size) for p in params], dtype=np.float64).reshape(
            len(params), len(_ROW_NUMBERS)
        )
        column = dict(zip(_ROW_NUMBERS, table.T, strict=True))

        def floats(name: str) -> torch.Tensor:
            return torch.from_numpy(column[name].astype(np.float32)).to(device)

        def ints(values: np.ndarray | Sequence[int]) -> torch.Tensor:
            return torch.from_numpy(np.asarray(values, dtype=np.int64)).to(device)

        uses_repetition = column["repetition_penalty"] != 1.0
        uses_counts = (column["presence_penalty"] != 0.0) | (column["frequency_penalty"] != 0.0)
        is_greedy = column["greedy"] != 0.0
        # Greedy rows ignore the filters (_row_numbers turns theirs off), so a filtered batch
        # leaves their logits as they are and their argmax is the plain one.
        needs_filters = bool(
            (
                (column["top_k"] < vocab_size) | (column["top_p"] < 1.0) | (column["min_p"] > 0.0)
            ).any()
        )
        # Only rows that use a penalty ship their token history to the device.
        seen = counted = None
        if uses_repetition.any():
            seen = [
                [*prompt, *output] if used else []
                for prompt, output, used in zip(
                    prompt_ids, output_ids, uses_repetition, strict=True
                )
            ]
        if uses_counts.any():
            counted = [
                list(output) if used else []
                for output, used in zip(output_ids, uses_counts, strict=True)
            ]
        return cls(
            temperature=floats("temperature"),
            is_greedy=torch.from_numpy(is_greedy).to(device),
            top_k=ints(column["top_k"]),
            top_p=floats("top_p"),
            min_p=floats("min_p"),
            repetition_penalty=floats("repetition_penalty"),
            presence_penalty=floats("presence_penalty"),
            frequency_penalty=floats("frequency_penalty"),
            seeds=ints(seeds),
            counters=ints([len(o) for o in output_ids] if counters is None else counters),
            seen_token_ids=_padded_ids(seen, vocab_size, device) if seen is not None else None,
            output_token_ids=(
                _padded_ids(counted, vocab_size, device) if counted is not None else None
            ),
            banned_token_ids=(
                _padded_ids(banned_ids, vocab_size, device) if any(banned_ids) else None
            ),
            vocab_size=vocab_size,
            needs_logprobs=any(p.logprobs is not None for p in params),
            max_num_logprobs=max((p.logprobs or 0 for p in params), default=0),
            all_greedy=bool(is_greedy.all()),
            needs_filters=needs_filters,
        )


# The per-row numbers of SamplingTensors, in _row_numbers' order.
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


def _row_numbers(p: SamplingParams, vocab_size: int) -> tuple[float, ...]:
    """A row's sampling numbers. A greedy row gets temperature 1.0 (dividing is harmless)
    and every filter off; top-k off is vocab_size."""
    if p.greedy:
        return (1.0, 1.0, vocab_size, 1.0, 0.0, *_penalties(p))
    top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
    return (p.temperature, 0.0, top_k, p.top_p, p.min_p, *_penalties(p))


def _penalties(p: SamplingParams) -> tuple[float, float, float]:
    return (p.repetition_penalty, p.presence_penalty, p.frequency_penalty)


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


def _padded_ids(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str
) -> torch.Tensor:
    width = max((len(row) for row in rows), default=0)
    padded = [[*row, *([pad_id] * (width - len(row)))] for row in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(rows), width)


def _scatter_count(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-row occurrence counts [B, V] of padded ids (pad = vocab_size, dropped)."""
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def _row_mask(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return _scatter_count(ids, vocab_size) > 0


def _penalise_and_ban(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The logits as they are when no row has a penalty or a ban; else a float32 copy with
    the penalties applied and the banned ids at -inf."""
    if t.seen_token_ids is None and t.output_token_ids is None and t.banned_token_ids is None:
        return logits
    logits = _apply_penalties(logits.float(), t)
    if t.banned_token_ids is not None:
        logits = logits.masked_fill(_row_mask(t.banned_token_ids, t.vocab_size), float("-inf"))
    return logits


def _apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    if t.seen_token_ids is not None:
        # HF / CTRL style: push every seen token towards "less likely" whatever its sign.
        seen = _row_mask(t.seen_token_ids, t.vocab_size)
        penalty = t.repetition_penalty[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if t.output_token_ids is not None:
        # OpenAI style: subtract per generated occurrence (frequency) and once if any (presence).
        counts = _scatter_count(t.output_token_ids, t.vocab_size)
        logits = (
            logits
            - t.frequency_penalty[:, None] * counts
            - t.presence_penalty[:, None] * (counts > 0).float()
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
