"""Tools offered to a chat model: how the chat template gets them (and the calls in earlier
messages), and what a request that forces a call asks of the answer (its constraint).

A model writes its calls in the format it was trained on (TOOL_FORMATS):
  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, with
               content around them (Hermes, Qwen 2.5 / 3 and most ChatML tool templates);
  llama3_json  the whole answer is {"name": ..., "parameters": {...}} (after an optional
               <|python_tag|>), several joined by ';' (Llama 3.1 - 3.3).
A template that knows nothing of tools gets them in the text, in that format. Reading the
calls back out of what the model writes is the server's (service/tool_calls.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from engine.errors import ValidationError
from engine.sampling_params import SamplingParams
from engine.structured.constraints import Constraint
from engine.text.tokenizer import Tokenizer

TOOL_FORMATS = ("hermes", "llama3_json")
MAX_TOOLS = 128
# What a function may be called (OpenAI's rule).
FUNCTION_NAME = "[A-Za-z0-9_-]{1,64}"


def detect_format(chat_template: str | None) -> str:
    """The format a chat template teaches its model: llama3_json where it speaks of
    <|python_tag|> or ipython, else hermes (also the fallback for templates without tools)."""
    if chat_template and ("<|python_tag|>" in chat_template or "ipython" in chat_template):
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolUse:
    """A chat request's tools and what it asks of them."""

    # OpenAI function tools, as the chat template gets them:
    # {"type": "function", "function": {"name", "description", "parameters"}}
    tools: tuple[dict[str, Any], ...]
    choice: Literal["auto", "none", "required", "function"] = "auto"
    function: str | None = None  # the function a named choice forces
    parallel: bool = True  # several calls in one answer
    call_format: str = "hermes"  # the format the model writes its calls in (TOOL_FORMATS)

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

    def _parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or {"type": "object"}


def template_messages(
    messages: list[dict[str, Any]], tools: ToolUse | None, tokenizer: Tokenizer
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and tools as the chat template gets them. An assistant's calls get their
    arguments as objects (templates write them with tojson). A template that knows nothing
    of tools gets them in the text instead, in the format it writes calls in: the tools in the
    system message, each call in its assistant message."""
    messages = [_with_parsed_arguments(m) for m in messages]
    if tools is None or not tools.tools:
        return messages, None
    if "tool_calls" not in (tokenizer.chat_template or ""):
        messages = [_calls_as_text(m, tools.call_format) for m in messages]
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


def _calls_as_text(message: dict[str, Any], call_format: str) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    written = []
    for call in calls:
        function = call.get("function") or {}
        key = "parameters" if call_format == "llama3_json" else "arguments"
        body = json.dumps({"name": function.get("name"), key: function.get("arguments")})
        written.append(
            body if call_format == "llama3_json" else f"<tool_call>\n{body}\n</tool_call>"
        )
    text = "; ".join(written) if call_format == "llama3_json" else "\n".join(written)
    content = message.get("content") or ""
    plain = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**plain, "content": f"{content}\n{text}" if content else text}


def _tool_instructions(tools: ToolUse) -> str:
    """The tools and how to call them, for a model whose template does not say."""
    listed = "\n".join(json.dumps(tool["function"]) for tool in tools.tools)
    if tools.call_format == "llama3_json":
        how = 'answer with only {"name": <function name>, "parameters": <arguments object>}'
    else:
        how = (
            "write each call as <tool_call>\n"
            '{"name": <function name>, "arguments": <arguments object>}\n</tool_call>'
        )
    return f"These functions can be called:\n{listed}\nTo call one, {how}."
