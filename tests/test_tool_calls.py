"""Tool-call parsers: content and calls out of a model's text, the same however it streams."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from engine.text.tool_use import detect_format
from service.tool_calls import (
    HermesParser,
    Llama3JsonParser,
    NamedCallParser,
    assemble,
    forced_calls_parser,
)

HERMES = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris \\"}\\" <tool_call>", "days": [1, {"a": 2}]}}'
    "\n</tool_call>\n<tool_call>"
    '{"arguments": {"q": "x"}, "name": "search"}</tool_call>'
)
LLAMA3 = '<|python_tag|>{"name": "f", "parameters": {"x": 1.5}}; {"name": "g", "parameters": {}}'


def parse(parser, text: str, cuts: list[int]):
    """Feed text in the pieces `cuts` makes; returns (content, calls, deltas)."""
    pieces, last = [], 0
    for cut in sorted(set(cuts)) + [len(text)]:
        pieces.append(text[last:cut])
        last = cut
    content, deltas = "", []
    for piece in [*pieces, None]:
        parsed = parser.finish() if piece is None else parser.feed(piece)
        content += parsed.content
        deltas += parsed.tool_calls
    return content, [(c.name, c.arguments) for c in assemble(deltas)], deltas


def cuts_in(text: str):
    return st.lists(st.integers(min_value=0, max_value=len(text)), max_size=len(text))


@given(cuts=cuts_in(HERMES))
def test_hermes_calls_and_content_do_not_depend_on_how_the_text_streams(cuts) -> None:
    content, calls, deltas = parse(HermesParser(), HERMES, cuts)
    assert content.strip() == "Let me look."
    arguments = '{"city": "Paris \\"}\\" <tool_call>", "days": [1, {"a": 2}]}'
    assert calls == [("get_weather", arguments), ("search", '{"q": "x"}')]
    assert json.loads(calls[0][1]) == {"city": 'Paris "}" <tool_call>', "days": [1, {"a": 2}]}
    first = [d for d in deltas if d.id is not None]
    assert [d.index for d in first] == [0, 1] and len({d.id for d in first}) == 2
    # A call's first delta comes before its other pieces, each call's before the next's.
    assert [d.index for d in deltas] == sorted(d.index for d in deltas)


@given(cuts=cuts_in(LLAMA3))
def test_llama3_json_calls_do_not_depend_on_how_the_text_streams(cuts) -> None:
    content, calls, _ = parse(Llama3JsonParser(), LLAMA3, cuts)
    assert content == ""
    assert calls == [("f", '{"x": 1.5}'), ("g", "{}")]


def test_text_without_calls_is_content_to_the_last_character() -> None:
    text = "Plain answer that mentions <tool and {braces} but calls nothing <"
    assert parse(HermesParser(), text, [5, 30, len(text) - 1])[:2] == (text, [])
    assert parse(Llama3JsonParser(), text, [3])[:2] == (text, [])


def test_an_object_without_a_name_is_no_call() -> None:
    text = (
        '<tool_call>{"arguments": {"x": 1}}</tool_call> then <tool_call>{"name": "f"}</tool_call>'
    )
    _, calls, _ = parse(HermesParser(), text, [])
    assert calls == [("f", "")]


@given(cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=20))
def test_forced_calls_read_an_array_of_calls(cuts) -> None:
    text = '[{"name": "f", "arguments": {"s": "]}[{"}}, {"name": "g", "arguments": {"n": null}}]'
    assert parse(forced_calls_parser(), text, cuts)[1] == [
        ("f", '{"s": "]}[{"}'),
        ("g", '{"n": null}'),
    ]


def test_a_named_call_is_the_whole_answer_even_an_empty_one() -> None:
    _, calls, deltas = parse(NamedCallParser("lookup"), '{"id": 7}', [2, 5])
    assert calls == [("lookup", '{"id": 7}')]
    assert deltas[0].id.startswith("call_") and deltas[0].name == "lookup"
    assert parse(NamedCallParser("lookup"), "", [])[1] == [("lookup", "")]


def test_the_parser_is_picked_from_what_the_template_speaks_of() -> None:
    assert (
        detect_format("{{ '<|python_tag|>' }}{% if message.role == 'ipython' %}") == "llama3_json"
    )
    assert detect_format("{{ '<tool_call>' }}") == "hermes"
    assert detect_format(None) == "hermes"
