"""The sampler's draw: an exponential race on counter-based random numbers.

Row r's uniform for token v is a 32-bit integer hash of (seed_r, counter_r, v), where
counter_r is how many tokens the row has generated: a row's draw depends only on its own
seed, step and logits, never on its batch-mates or its place in the batch, and the
integer hash gives bit-identical uniforms on every device. argmax_v(p_v / E_v) with
E_v = -log(u_v) ~ Exp(1) picks v with probability exactly p_v.

A row may come with a token mask (structured output's): a bitmask of the tokens it may
pick, which the race applies itself, in the same pass on CUDA.
"""

from __future__ import annotations

import torch

from engine.kernels.dispatch import use_triton

_MASK32 = 0xFFFFFFFF
_GOLDEN32 = 0x9E3779B9  # 2^32 / golden ratio: the Weyl step between vocab entries
_SEED_SALT = 0x5BD1E995  # keeps seed 0 away from the hash's fixed point at 0
_UNIFORM_BITS = 23  # (k + 0.5) / 2^23 is exact in float32 and strictly inside (0, 1)


def exponential_race(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    is_greedy: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row of logits [B, V] (any float dtype): the argmax on greedy rows; on the others
    argmax_v(softmax(scaled)_v / E_v), scaled = logits / temperature (temperature None: the
    logits are already scaled) and E from exponential_noise: a draw from softmax(scaled).
    With `allowed` (int32 [B, ceil(V / 32)], unpack_bitmask's layout) a row picks only
    among the tokens whose bit is set.

    On CUDA one Triton pass over the logits does it all (the noise never exists in memory,
    and the race runs in log space: argmax(scaled_v - log E_v)); the same tokens either way.
    """
    race = (logits, temperature, is_greedy, seeds, counters, allowed)
    if use_triton(logits):
        from engine.kernels import triton_kernels

        return triton_kernels.exponential_race(*race)
    return exponential_race_torch(*race)


def exponential_race_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor | None,
    is_greedy: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    logits = logits.float()
    if allowed is not None:
        logits = logits.masked_fill(~unpack_bitmask(allowed, logits.shape[-1]), float("-inf"))
    scaled = logits if temperature is None else logits / temperature[:, None]
    noise = exponential_noise(seeds, counters, logits.shape[-1])
    sampled = (scaled.softmax(dim=-1) / noise).argmax(dim=-1)
    return torch.where(is_greedy, logits.argmax(dim=-1), sampled)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size] from int32 [R, ceil(vocab_size / 32)]: bit v % 32 of word v // 32."""
    # Each word shifted by 0..31 at once: on the CPU a tenth of the time of gathering a
    # word per token (benchmarks/RESULTS.md, "Structured output").
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = ((words[:, :, None] >> shifts) & 1).bool()
    return bits.view(words.shape[0], -1)[:, :vocab_size]


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
