"""Tool calls in what a model writes: its text as content and OpenAI-shaped call deltas.

One parser per call format (engine/text/tool_use.py's TOOL_FORMATS) reads the text as it
streams, a delta at a time, and says which part is content and which is a call: a call's
first delta carries its index, id and function name, the later ones the next pieces of its
arguments' JSON text. A whole answer is assembled from the same deltas (assemble()), so a
stream always adds up to the whole answer, by either door. For a call the request forces
(tool_choice "required" or a named function; a JSON schema constraint makes the model
write it), forced_calls_parser reads a JSON array of {"name", "arguments"} objects and
NamedCallParser the named function's arguments alone.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from engine.outputs import FinishReason
from engine.text.tool_use import ToolUse


@dataclass
class ToolCallDelta:
    index: int  # the call's place among the answer's calls
    id: str | None = None  # set on the call's first delta, with its name
    name: str | None = None
    arguments: str = ""  # the next piece of the arguments' JSON text


@dataclass
class ParsedText:
    """What a piece of the model's text turned out to be."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the model wrote it

    def openai(self) -> dict[str, object]:
        """The call in OpenAI's shape, as answers carry it and chat templates read it."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def assemble(deltas: list[ToolCallDelta]) -> list[ToolCall]:
    """The calls the deltas of one answer add up to, in index order."""
    calls: dict[int, ToolCall] = {}
    for delta in deltas:
        if delta.index not in calls:
            calls[delta.index] = ToolCall(delta.id or "", delta.name or "", "")
        calls[delta.index].arguments += delta.arguments
    return [calls[i] for i in sorted(calls)]


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


class _CallObject:
    """One call written as a JSON object, read a character at a time: its name once the
    name's value is complete, the raw text of its arguments' value as it arrives. The
    object's structure is tracked (depth, strings, escapes), not parsed, so a piece of the
    arguments is known to be one the moment it is seen."""

    def __init__(self, arguments_key: str):
        self.arguments_key = arguments_key
        self.depth = 0
        self.in_string = self.escaped = False
        self.reading_value = False  # after a top-level key's ':', until its ',' or '}'
        self.key: str | None = None  # the top-level key last read
        self.text = ""  # the key being read, or the name's value being read
        self.name: str | None = None
        self.closed = False

    def feed(self, ch: str) -> str:
        """Read one character; returns it if it is part of the arguments' value, else ''."""
        depth, in_string = self.depth, self.in_string
        self._track(ch)
        at_top = depth == 1 and self.depth <= 1 and not (in_string or self.in_string)
        if not self.reading_value:
            if depth == 1 and in_string and self.in_string:  # inside a key, quotes excluded
                self.text += ch
            elif at_top and ch == ":":
                self.key, self.text, self.reading_value = self.text, "", True
            return ""
        if at_top and ch in " \t\r\n":
            return ""
        if at_top and ch in ",}":
            if self.key == "name":
                try:
                    value = json.loads(self.text)
                except ValueError:
                    value = None
                self.name = value if isinstance(value, str) else None
            self.reading_value, self.text = False, ""
            return ""
        if self.key == "name":
            self.text += ch
        return ch if self.key == self.arguments_key else ""

    def _track(self, ch: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
        elif ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            self.closed = self.depth == 0


class _Calls:
    """Call objects in a row: numbers them, and emits each one's first delta (id and
    name) as soon as its name is known, holding back arguments read before it."""

    def __init__(self, arguments_key: str):
        self.arguments_key = arguments_key
        self.count = 0
        self.current: _CallObject | None = None
        self.held = ""  # arguments read before the name
        self.named = False

    def start(self) -> None:
        self.current, self.held, self.named = _CallObject(self.arguments_key), "", False

    def feed(self, ch: str, out: list[ToolCallDelta]) -> bool:
        """Read one character of the current call; True once the call's object closed."""
        call = self.current
        self.held += call.feed(ch)
        if not self.named and call.name is not None:
            out.append(ToolCallDelta(self.count, new_call_id(), call.name, self.held))
            self.named, self.held = True, ""
        elif self.named and self.held:
            _append(out, self.count, self.held)
            self.held = ""
        if call.closed:
            self.count += self.named
            self.current = None
        return call.closed


def _append(out: list[ToolCallDelta], index: int, piece: str) -> None:
    """Add an arguments piece, merged into the delta before it when that one is the same
    call's."""
    if out and out[-1].index == index:
        out[-1].arguments += piece
    else:
        out.append(ToolCallDelta(index, arguments=piece))


class HermesParser:
    """<tool_call>{...}</tool_call> blocks inside content."""

    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.calls = _Calls("arguments")
        self.pending = ""  # text that may be the start of a tag
        self.state = "content"  # content | call (reading the object) | after (until END)

    def feed(self, text: str) -> ParsedText:
        parsed = ParsedText()
        text, self.pending = self.pending + text, ""
        i = 0
        while i < len(text):
            if self.state == "call":
                if self.calls.current is None and text[i] != "{":
                    i += 1  # whitespace before the object
                    continue
                if self.calls.current is None:
                    self.calls.start()
                if self.calls.feed(text[i], parsed.tool_calls):
                    self.state = "after"
                i += 1
                continue
            tag = self.START if self.state == "content" else self.END
            found = text.find(tag, i)
            if found < 0:
                keep = _partial_suffix(text, tag, i)
                if self.state == "content":
                    parsed.content += text[i : len(text) - keep]
                self.pending = text[len(text) - keep :]
                break
            if self.state == "content":
                parsed.content += text[i:found]
            self.state = "call" if self.state == "content" else "content"
            i = found + len(tag)
        return parsed

    def finish(self) -> ParsedText:
        """What is left at the end of the answer."""
        content = self.pending if self.state == "content" else ""
        self.pending = ""
        return ParsedText(content)


class Llama3JsonParser:
    """An answer that is calls alone, {"name": ..., "parameters": {...}}, ';' between them;
    any other answer is content."""

    TAG = "<|python_tag|>"

    def __init__(self, arguments_key: str = "parameters", tag: str | None = TAG):
        self.calls = _Calls(arguments_key)
        self.tag = tag
        self.pending = ""
        self.mode: str | None = None  # None until the answer's start decides: calls | content

    def feed(self, text: str) -> ParsedText:
        parsed = ParsedText()
        if self.mode is None:
            self.pending += text
            start = self.pending.lstrip()
            if self.tag and self.tag.startswith(start):
                return parsed  # it may still become the tag
            if self.tag and start.startswith(self.tag):
                start = start[len(self.tag) :].lstrip()
            if not start:
                return parsed
            self.mode = "calls" if start[0] in "{[" else "content"
            text, self.pending = (start if self.mode == "calls" else self.pending), ""
        if self.mode == "content":
            parsed.content = text
            return parsed
        for ch in text:
            if self.calls.current is None:
                if ch != "{":
                    continue  # '[', ',', ';', ']' and whitespace between the calls
                self.calls.start()
            self.calls.feed(ch, parsed.tool_calls)
        return parsed

    def finish(self) -> ParsedText:
        content = self.pending if self.mode is None else ""
        self.pending = ""
        return ParsedText(content)


def forced_calls_parser() -> Llama3JsonParser:
    """For tool_choice "required": a JSON array of {"name", "arguments"} objects."""
    return Llama3JsonParser(arguments_key="arguments", tag=None)


class NamedCallParser:
    """For a named tool_choice: the whole answer is that function's arguments."""

    def __init__(self, name: str):
        self.name = name
        self.started = False

    def feed(self, text: str) -> ParsedText:
        if not text:
            return ParsedText()
        if self.started:
            return ParsedText(tool_calls=[ToolCallDelta(0, arguments=text)])
        self.started = True
        return ParsedText(tool_calls=[ToolCallDelta(0, new_call_id(), self.name, text)])

    def finish(self) -> ParsedText:
        if self.started:
            return ParsedText()
        self.started = True  # an empty answer is still the call the request forced
        return ParsedText(tool_calls=[ToolCallDelta(0, new_call_id(), self.name, "")])


ToolCallParser = HermesParser | Llama3JsonParser | NamedCallParser


def new_parser(tools: ToolUse) -> ToolCallParser | None:
    """A parser for one candidate's answer; None when no call is wanted."""
    if tools.choice == "none" or not tools.tools:
        return None
    if tools.choice == "function":
        return NamedCallParser(tools.function)
    if tools.choice == "required":
        return forced_calls_parser()
    return HermesParser() if tools.call_format == "hermes" else Llama3JsonParser()


def _partial_suffix(text: str, tag: str, start: int) -> int:
    """How many characters at the end of text[start:] could begin `tag`."""
    for keep in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[len(text) - keep :]):
            return keep
    return 0


class ToolCallReader:
    """The tool calls in each candidate's answer to one request, read as its text comes."""

    def __init__(self, tools: ToolUse | None):
        self.tools = tools
        self._parsers: dict[int, ToolCallParser | None] = {}
        self._called: set[int] = set()  # candidates a call was found in

    def parse(self, index: int, text: str, finished: bool) -> ParsedText:
        """Candidate `index`'s next text as content and call deltas (all content when no
        call is wanted); `finished`: it is the candidate's last."""
        if index not in self._parsers:
            self._parsers[index] = new_parser(self.tools) if self.tools else None
        parser = self._parsers[index]
        if parser is None:
            return ParsedText(text)
        parsed = parser.feed(text)
        if finished:
            rest = parser.finish()
            parsed.content += rest.content
            parsed.tool_calls += rest.tool_calls
        if not self.tools.parallel:  # the first call only
            parsed.tool_calls = [d for d in parsed.tool_calls if d.index == 0]
        if parsed.tool_calls:
            self._called.add(index)
        return parsed

    def finish_reason(self, index: int, reason: FinishReason) -> str:
        """Why candidate `index` ended, in both doors' words: "tool_calls" where it called
        tools and ended as a model ends (not cut off), else the engine's reason."""
        called = index in self._called and reason in (FinishReason.EOS, FinishReason.STOP)
        return "tool_calls" if called else reason.value
