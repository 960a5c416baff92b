"""Per-request sampling and stopping parameters, validated once when a request arrives."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.errors import ValidationError
from engine.structured.constraints import Constraint

MAX_N = 64  # candidates per request
MAX_LOGPROBS = 20  # top alternatives per position, as in the OpenAI API
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_PENALTY = 2.0  # presence / frequency penalties live in [-MAX_PENALTY, MAX_PENALTY]
# Below this temperature a row is sampled greedily: the distribution is a point mass in all
# but name, and dividing logits by a tiny number can overflow float32.
GREEDY_TEMPERATURE = 1e-5
_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_FLOAT32_MAX = 3.4028234663852886e38
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1  # gRPC's int32; REST is held to the same


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # below GREEDY_TEMPERATURE (e.g. 0) = greedy
    top_k: int = -1  # -1 or 0 = off
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1]
    repetition_penalty: float = 1.0  # > 0; HF semantics over prompt + output tokens
    presence_penalty: float = 0.0  # OpenAI semantics over output tokens
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)  # stop strings, matched on the text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # 0..20 top alternatives (0 = only the chosen token's logprob)
    prompt_logprobs: int | None = None  # 0..20
    skip_special_tokens: bool = True
    constraint: Constraint | None = None  # what the output must match (structured output)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        """Some penalty reads the token history (repetition, presence or frequency)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def banned_ids(self, num_sampled: int, eos_token_ids: frozenset[int]) -> list[int]:
        """Ids the next token may not be, num_sampled tokens in: EOS and the stop ids while
        below min_tokens."""
        if num_sampled >= self.min_tokens:
            return []
        return [*self.stop_token_ids, *(() if self.ignore_eos else eos_token_ids)]

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValidationError naming the first invalid field and its allowed range."""
        _check_int("n", self.n, low=1, high=MAX_N)
        _check_float("temperature", self.temperature, low=0.0)
        _check_int("top_k", self.top_k, low=-1, hint="-1 or 0 turns it off")
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _check_float("presence_penalty", self.presence_penalty, low=-MAX_PENALTY, high=MAX_PENALTY)
        _check_float(
            "frequency_penalty", self.frequency_penalty, low=-MAX_PENALTY, high=MAX_PENALTY
        )
        if self.seed is not None:
            _check_int("seed", self.seed, low=_INT64_MIN, high=_INT64_MAX)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int(
            "min_tokens", self.min_tokens, low=0, high=self.max_tokens, hint="up to max_tokens"
        )
        _check_stop(self.stop)
        _check_stop_token_ids(self.stop_token_ids, vocab_size)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValidationError(name, "must be a boolean")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0, high=MAX_LOGPROBS)
        if self.constraint is not None:
            self.constraint.validate()
            # A constrained output ends with EOS where its grammar ends: nothing may hold
            # EOS back past that point.
            if self.ignore_eos:
                raise ValidationError("ignore_eos", "cannot be set with a constraint")
            if self.min_tokens:
                raise ValidationError("min_tokens", "cannot be set with a constraint")


def validate_request(
    params: SamplingParams,
    priority: object,
    vocab_size: int | None,
    prompt_tokens: int | None = None,
    context: int | None = None,
) -> None:
    """What a request brings besides its prompt's ids: its SamplingParams, its priority,
    and (given the context) whether a prompt of prompt_tokens leaves room to generate."""
    params.validate(vocab_size)
    _check_int("priority", priority, low=PRIORITY_MIN, high=PRIORITY_MAX)
    if prompt_tokens is not None and context is not None:
        check_prompt_length(prompt_tokens, context)


def check_prompt_length(count: int, context: int, bounds: str = "") -> None:
    """A prompt of `count` tokens leaves room for at least one more in the context; bounds
    says what limits the context, " (model 2048, KV pool 4096)", when the caller knows."""
    if count >= context:
        raise ValidationError(
            "prompt",
            f"{count} tokens leave no room to generate: the context limit is {context} tokens"
            + bounds,
        )


def check_count(name: str, count: int, limit: int, what: str) -> None:
    """At most `limit` entries: checked on a list's length before it is copied or walked."""
    if count > limit:
        raise ValidationError(name, f"at most {limit} {what}, got {count}")


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but True is never a meaningful count or seed.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, low: int, high: int | None = None, hint: str = "") -> None:
    allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
    if not _is_int(value):
        raise ValidationError(name, f"must be an integer {allowed}, got {value!r}")
    if value < low or (high is not None and value > high):
        suffix = f" ({hint})" if hint else ""
        raise ValidationError(name, f"must be {allowed}{suffix}, got {value}")


def _check_float(
    name: str,
    value: object,
    low: float,
    high: float | None = None,
    low_open: bool = False,
) -> None:
    opening = "(" if low_open else "["
    allowed = (
        f"in {opening}{low}, {high}]" if high is not None else f"{'>' if low_open else '>='} {low}"
    )
    if not (_is_int(value) or isinstance(value, float)):
        raise ValidationError(name, f"must be a number {allowed}, got {value!r}")
    # The sampler works in float32: a larger value (1e308 from JSON) would be infinite there.
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise ValidationError(name, f"must be a finite number {allowed}, got {value}")
    below = value <= low if low_open else value < low
    if below or (high is not None and value > high):
        raise ValidationError(name, f"must be {allowed}, got {value}")


def _check_stop(stop: object) -> None:
    # A bare string is iterable and would silently become one stop string per character.
    if not isinstance(stop, (list, tuple)):
        raise ValidationError("stop", f"must be a list of strings, got {type(stop).__name__}")
    check_count("stop", len(stop), MAX_STOP_STRINGS, "stop strings")
    for i, text in enumerate(stop):
        if not isinstance(text, str):
            raise ValidationError("stop", f"entry {i} must be a string, got {text!r}")
        if not text:
            raise ValidationError("stop", f"entry {i} is empty")
        if len(text) > MAX_STOP_STRING_CHARS:
            raise ValidationError(
                "stop", f"entry {i} has {len(text)} characters, at most {MAX_STOP_STRING_CHARS}"
            )


def _check_stop_token_ids(ids: object, vocab_size: int | None) -> None:
    if not isinstance(ids, (list, tuple)):
        raise ValidationError("stop_token_ids", f"must be a list of integers, got {ids!r}")
    check_count("stop_token_ids", len(ids), MAX_STOP_TOKEN_IDS, "ids")
    check_token_ids("stop_token_ids", ids, vocab_size)


def check_token_ids(field: str, token_ids: Sequence[object], vocab_size: int | None) -> None:
    """ValidationError naming the first entry of token_ids that is not a token id: an
    integer (not a bool) in [0, vocab_size), or >= 0 where the vocabulary is not known. One
    pass in C over ids that are all good; only a list that fails it is walked in Python."""
    high = vocab_size if vocab_size is not None else _INT64_MAX + 1
    if not token_ids or (
        set(map(type, token_ids)) == {int} and 0 <= min(token_ids) and max(token_ids) < high
    ):
        return
    allowed = f"in [0, {vocab_size})" if vocab_size is not None else ">= 0"
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < high:
            raise ValidationError(field, f"token {i} is {t!r}, expected an integer {allowed}")


_MASK64 = (1 << 64) - 1


def candidate_seed(seed: int, index: int) -> int:
    """Candidate 0 keeps the request's seed; the others get well-mixed distinct seeds."""
    if index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 29
    return x - (1 << 64) if x >= 1 << 63 else x
