"""SamplingParams.validate: every bad field is rejected by name, good values pass."""

from __future__ import annotations

import math

import pytest

from engine.errors import ValidationError
from engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

INVALID = [
    ("n", 0),
    ("n", -1),
    ("n", MAX_N + 1),
    ("n", 1.0),
    ("n", True),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1"),
    ("temperature", True),
    ("temperature", None),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", False),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", math.inf),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.nan),
    ("frequency_penalty", 3),
    ("frequency_penalty", -math.inf),
    ("seed", 2**63),
    ("seed", -(2**63) - 1),
    ("seed", 1.0),
    ("seed", True),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.0),
    ("min_tokens", -1),
    ("min_tokens", 17),  # above the default max_tokens of 16
    ("min_tokens", None),
    ("stop", "a bare string"),
    ("stop", [""]),
    ("stop", ["ok", 3]),
    ("stop", ["x" * (MAX_STOP_STRING_CHARS + 1)]),
    ("stop", ["s"] * (MAX_STOP_STRINGS + 1)),
    ("stop", None),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", list(range(MAX_STOP_TOKEN_IDS + 1))),
    ("stop_token_ids", 5),
    ("ignore_eos", 1),
    ("include_stop_str_in_output", "yes"),
    ("skip_special_tokens", None),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("logprobs", 1.0),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", MAX_LOGPROBS + 1),
    ("prompt_logprobs", False),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}"[:40] for f, v in INVALID])
def test_invalid_field_is_named(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(ValidationError) as caught:
        params.validate()
    assert caught.value.field == field
    assert field in str(caught.value)


def test_message_states_the_allowed_range() -> None:
    with pytest.raises(ValidationError, match=r"top_p: must be in \(0.0, 1.0\], got 1.5"):
        SamplingParams(top_p=1.5).validate()
    with pytest.raises(ValidationError, match=r"n: must be in \[1, 64\], got 0"):
        SamplingParams(n=0).validate()


def test_stop_token_ids_checked_against_vocab_only_when_known() -> None:
    params = SamplingParams(stop_token_ids=[0, 99])
    params.validate()
    params.validate(vocab_size=100)
    with pytest.raises(ValidationError) as caught:
        params.validate(vocab_size=99)
    assert caught.value.field == "stop_token_ids"
    assert "token 1 is 99, expected an integer in [0, 99)" in str(caught.value)


def test_defaults_are_valid() -> None:
    SamplingParams().validate(vocab_size=10)


def test_boundary_values_are_valid() -> None:
    SamplingParams(
        n=MAX_N,
        temperature=0,
        top_k=0,
        top_p=1,
        min_p=1.0,
        repetition_penalty=0.01,
        presence_penalty=-2.0,
        frequency_penalty=2,
        seed=-(2**63),
        max_tokens=None,
        min_tokens=1000,
        stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)),
        ignore_eos=True,
        include_stop_str_in_output=True,
        logprobs=0,
        prompt_logprobs=MAX_LOGPROBS,
        skip_special_tokens=False,
    ).validate(vocab_size=MAX_STOP_TOKEN_IDS)
    SamplingParams(top_k=-1, seed=2**63 - 1, max_tokens=1, min_tokens=1, stop=("a",)).validate()


def test_min_tokens_may_equal_max_tokens() -> None:
    SamplingParams(max_tokens=5, min_tokens=5).validate()
    with pytest.raises(ValidationError) as caught:
        SamplingParams(max_tokens=5, min_tokens=6).validate()
    assert caught.value.field == "min_tokens"


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (1e-7, True), (0.01, False), (1.0, False)]
)
def test_greedy_property(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


def test_stop_lists_are_not_shared_between_instances() -> None:
    first, second = SamplingParams(), SamplingParams()
    first.stop.append("x")
    assert second.stop == []
