"""Tool calls in what a model writes: its text as content and OpenAI-shaped call deltas.

A model writes its calls in the format it was trained on; one parser per format reads the
text as it streams, a delta at a time, and says which part is content and which is a
call: a call's first delta carries its index, id and function name, the later ones the
next pieces of its arguments' JSON text. A unary answer is assembled from the same deltas
(assemble()), so a stream always adds up to the unary answer.

Formats:
  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, with
               content around them (Hermes, Qwen 2.5 / 3 and most ChatML tool templates);
  llama3_json  the whole answer is {"name": ..., "parameters": {...}} (after an optional
               <|python_tag|>), several joined by ';' (Llama 3.1 - 3.3);
and, for a call the request forces (tool_choice "required" or a named function; a JSON
schema constraint makes the model write it), forced_calls reads a JSON array of
{"name", "arguments"} objects and NamedCallParser the named function's arguments alone.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.errors import ValidationError
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from engine.structured.constraints import Constraint
from engine.text.tokenizer import Tokenizer

TOOL_PARSERS = ("hermes", "llama3_json")
MAX_TOOLS = 128
# What a function may be called (OpenAI's rule).
FUNCTION_NAME = "[A-Za-z0-9_-]{1,64}"


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


def parser_for(name: str) -> HermesParser | Llama3JsonParser:
    """A fresh parser of one of TOOL_PARSERS."""
    return HermesParser() if name == "hermes" else Llama3JsonParser()


def detect_parser(chat_template: str | None) -> str:
    """The format a chat template teaches its model: llama3_json where it speaks of
    <|python_tag|> or ipython, else hermes (also the fallback for templates without tools)."""
    if chat_template and ("<|python_tag|>" in chat_template or "ipython" in chat_template):
        return "llama3_json"
    return "hermes"


def _partial_suffix(text: str, tag: str, start: int) -> int:
    """How many characters at the end of text[start:] could begin `tag`."""
    for keep in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[len(text) - keep :]):
            return keep
    return 0


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and what it asks of them."""

    # OpenAI function tools, as the chat template gets them:
    # {"type": "function", "function": {"name", "description", "parameters"}}
    tools: tuple[dict[str, Any], ...]
    choice: Literal["auto", "none", "required", "function"] = "auto"
    function: str | None = None  # the function a named choice forces
    parallel: bool = True  # several calls in one answer
    parser: str = "hermes"  # the format the model writes its calls in (TOOL_PARSERS)

    def __post_init__(self) -> None:
        if len(self.tools) > MAX_TOOLS:
            raise ValidationError("tools", f"at most {MAX_TOOLS} tools, got {len(self.tools)}")
        names = [tool["function"]["name"] for tool in self.tools]
        if len(set(names)) != len(names):
            raise ValidationError("tools", "function names must be unique")
        if self.choice in ("required", "function") and not self.tools:
            raise ValidationError("tool_choice", f"{self.choice!r} needs tools")
        if self.choice == "function" and self.function not in names:
            raise ValidationError(
                "tool_choice", f"names the function {self.function!r}, which is not in tools"
            )

    def constraint(self) -> Constraint | None:
        """What the answer must be when the request forces a call: the named function's
        arguments, or an array of calls of the tools (one, unless parallel)."""
        if self.choice == "function":
            schema = self._parameters(self.function)
            return Constraint("json_schema", json.dumps(schema), field="tools.function.parameters")
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": self._parameters(name)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name in (tool["function"]["name"] for tool in self.tools)
        ]
        array = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return Constraint("json_schema", json.dumps(array), field="tools.function.parameters")

    def constrain(self, params: SamplingParams) -> None:
        """Give params the constraint of a forced call, if the request forces one."""
        forced = self.constraint()
        if forced is not None and params.constraint is not None:
            raise ValidationError(
                "tool_choice", "a forced call cannot be combined with another constraint"
            )
        params.constraint = params.constraint or forced

    def new_parser(self) -> ToolCallParser | None:
        """A parser for one candidate's answer; None when no call is wanted."""
        if self.choice == "none" or not self.tools:
            return None
        if self.choice == "function":
            return NamedCallParser(self.function)
        if self.choice == "required":
            return forced_calls_parser()
        return parser_for(self.parser)

    def _parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or {"type": "object"}


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
            self._parsers[index] = self.tools.new_parser() if self.tools else None
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

    def ended_calling(self, index: int, reason: FinishReason) -> bool:
        """The candidate called tools and ended as a model ends (not cut off): its
        finish reason is then "tool_calls"."""
        return index in self._called and reason in (FinishReason.EOS, FinishReason.STOP)


def template_messages(
    messages: list[dict[str, Any]], tools: ToolUse | None, tokenizer: Tokenizer
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and tools as the chat template gets them. An assistant's calls get their
    arguments as objects (templates write them with tojson). A template that knows nothing
    of tools gets them in the text instead, in the parser's own format: the tools in the
    system message, each call in its assistant message."""
    messages = [_with_parsed_arguments(m) for m in messages]
    if tools is None or not tools.tools:
        return messages, None
    if "tool_calls" not in (tokenizer.chat_template or ""):
        messages = [_calls_as_text(m, tools.parser) for m in messages]
    if "tools" in tokenizer.chat_template_variables:
        return messages, list(tools.tools)
    instructions = _tool_instructions(tools)
    if messages and messages[0].get("role") == "system":
        system = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{instructions}"}
        return [system, *messages[1:]], None
    return [{"role": "system", "content": instructions}, *messages], None


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # left as the text it is; the template writes what it gets
        parsed.append({**call, "function": function})
    return {**message, "tool_calls": parsed}


def _calls_as_text(message: dict[str, Any], parser: str) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = []
    for call in calls:
        function = call.get("function") or {}
        key = "parameters" if parser == "llama3_json" else "arguments"
        body = json.dumps({"name": function.get("name"), key: function.get("arguments")})
        written.append(body if parser == "llama3_json" else f"<tool_call>\n{body}\n</tool_call>")
    text = "; ".join(written) if parser == "llama3_json" else "\n".join(written)
    content = message.get("content") or ""
    plain = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**plain, "content": f"{content}\n{text}" if content else text}


def _tool_instructions(tools: ToolUse) -> str:
    """The tools and how to call them, for a model whose template does not say."""
    listed = "\n".join(json.dumps(tool["function"]) for tool in tools.tools)
    if tools.parser == "llama3_json":
        how = 'answer with only {"name": <function name>, "parameters": <arguments object>}'
    else:
        how = (
            "write each call as <tool_call>\n"
            '{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
        )
    return f"These functions can be called:\n{listed}\nTo call one, {how}."
