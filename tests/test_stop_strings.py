"""Stop strings matched across streamed deltas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import ValidationError
from engine.text.stop_strings import StopStringMatcher

# A small alphabet so stops actually occur, overlap, and straddle deltas.
ALPHABET = "ab<|>é🙂"


def expected_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(start, stop) of the stop that completes first in `text`; ties go to the earlier start."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return None
    _, start, stop = min(found)
    return start, stop


def split_at(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted({c % (len(text) + 1) for c in cuts}), len(text)]
    return [text[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]


def run(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, str | None, list[str]]:
    """Feeds every delta; returns (everything emitted, the matched stop, per-delta outputs)."""
    outputs, matched = [], None
    for delta in deltas:
        emitted, stop = matcher.feed(delta)
        outputs.append(emitted)
        if stop is not None:
            assert matched is None  # matches once
            matched = stop
    if matched is None:
        outputs.append(matcher.flush())
    return "".join(outputs), matched, outputs


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=30),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 1000), max_size=10),
    include_stop_str=st.booleans(),
)
def test_streaming_matches_whole_text_reference(text, stops, cuts, include_stop_str) -> None:
    matcher = StopStringMatcher(stops, include_stop_str=include_stop_str)
    emitted, matched, _ = run(matcher, split_at(text, cuts))
    expected = expected_stop(text, stops)
    if expected is None:
        assert matched is None
        assert emitted == text  # flush returned whatever was held back
    else:
        start, stop = expected
        assert matched == stop
        assert emitted == (text[: start + len(stop)] if include_stop_str else text[:start])
        # the match ends the sequence: nothing after it, not even held-back text
        assert matcher.feed("more text") == ("", None)
        assert matcher.flush() == ""


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=30), cuts=st.lists(st.integers(0, 1000)))
def test_emitted_text_is_always_a_prefix_of_the_answer(text, cuts) -> None:
    stops = ["<|>", "ab", "é🙂é"]
    matcher = StopStringMatcher(stops, include_stop_str=False)
    expected = expected_stop(text, stops)
    answer = text if expected is None else text[: expected[0]]
    emitted = ""
    for delta in split_at(text, cuts):
        out, stop = matcher.feed(delta)
        emitted += out
        assert answer.startswith(emitted)
        if stop is not None:
            break
    else:
        emitted += matcher.flush()
    assert emitted == answer


def test_stop_straddling_deltas_is_held_back_then_matched() -> None:
    matcher = StopStringMatcher(["<|end|>"], include_stop_str=False)
    assert matcher.feed("Hello <|") == ("Hello ", None)
    assert matcher.feed("en") == ("", None)
    assert matcher.feed("d|> ignored") == ("", "<|end|>")
    assert matcher.feed("later") == ("", None)


def test_held_back_text_released_when_it_stops_looking_like_a_stop() -> None:
    matcher = StopStringMatcher(["<|end|>"], include_stop_str=False)
    assert matcher.feed("a <") == ("a ", None)
    assert matcher.feed("b") == ("<b", None)
    assert matcher.feed("<|en") == ("", None)
    assert matcher.flush() == "<|en"


def test_include_stop_str() -> None:
    matcher = StopStringMatcher(["STOP"], include_stop_str=True)
    assert matcher.feed("abcST") == ("abc", None)
    assert matcher.feed("OPxyz") == ("STOP", "STOP")
    assert matcher.matched == "STOP"


def test_overlapping_stops_first_to_complete_wins() -> None:
    # "bc" completes before "abcd" does, whether the text arrives whole or char by char.
    for deltas in (["abcd"], list("abcd")):
        emitted, matched, _ = run(StopStringMatcher(["abcd", "bc"], False), deltas)
        assert (emitted, matched) == ("a", "bc")
    # Same end: the longer stop, which starts earlier, wins.
    emitted, matched, _ = run(StopStringMatcher(["cd", "bcd"], False), ["abcde"])
    assert (emitted, matched) == ("a", "bcd")


def test_stop_whose_prefix_repeats() -> None:
    emitted, matched, _ = run(StopStringMatcher(["aab"], False), list("aaab"))
    assert (emitted, matched) == ("a", "aab")


def test_no_stops_passes_everything_through() -> None:
    matcher = StopStringMatcher([], include_stop_str=False)
    assert matcher.feed("anything <|") == ("anything <|", None)
    assert matcher.flush() == ""


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValidationError) as info:
        StopStringMatcher(["ok", ""], include_stop_str=False)
    assert info.value.field == "stop"
