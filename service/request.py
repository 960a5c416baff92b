"""One generation request as a caller asked for it, whichever door it came by.

A door parses its wire format (a GenerateRequest, an OpenAI body) into a GenerationRequest
and nothing more; the converter (service/convert.py) makes the engine's inputs of it. So a
new request field touches this record, the converter and each door's parser.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.structured.constraints import Constraint

ToolChoice = Literal["auto", "none", "required", "function"]


@dataclass
class Prompt:
    """One prompt as sent: exactly one of text, chat messages or token ids."""

    text: str | None = None
    # Chat messages in the door's own type; as_dict makes each the template's dict, after
    # they were counted (a request can carry millions).
    messages: Sequence[Any] | None = None
    as_dict: Callable[[Any], dict[str, Any]] = lambda message: message
    token_ids: Sequence[int] | None = None


@dataclass
class GenerationRequest:
    """What a caller asked of one generation call: its prompts (a REST completion may send
    several, each its own engine request) and how to answer them."""

    prompts: list[Prompt]
    # The SamplingParams fields the caller set, by the engine's names (convert.SAMPLING_FIELDS
    # says where each door carries each); unset ones keep the engine's defaults.
    sampling: dict[str, Any] = field(default_factory=dict)
    constraint: Constraint | None = None
    # Functions the model may call, in OpenAI's shape as the chat template gets them:
    # {"type": "function", "function": {"name", "description", "parameters"}}.
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: ToolChoice = "auto"
    tool_function: str | None = None  # the function tool_choice "function" forces
    parallel_tool_calls: bool = True
    priority: int = 0
    model: str = ""  # empty: whichever model is served
    # The engine's names of fields (SamplingParams', the prompt checks') -> the names this
    # caller sent them under, so that an error names the caller's field.
    field_names: dict[str, str] = field(default_factory=dict)
