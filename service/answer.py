"""A call's answer as it is gathered, the same by either door: each prompt's events into
its RequestOutput (engine/outputs.py), the tool calls read out of the text, and the usage
and finish reasons both doors report."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import CandidateEvent, FinishReason, RequestOutputBuilder, Usage
from service.tool_calls import ToolCallReader


@dataclass
class Answer:
    """The answer to one call: a RequestOutputBuilder per prompt (each an engine request).
    Candidate i of prompt p is the call's choice p * n + i."""

    outputs: list[RequestOutputBuilder]
    n: int  # candidates per prompt
    tool_calls: ToolCallReader
    finals: list[CandidateEvent] = field(default_factory=list)  # each candidate's last event

    def add(self, prompt: int, event: CandidateEvent) -> None:
        self.outputs[prompt].add(event)
        if event.finished:
            self.finals.append(event)

    def choice(self, prompt: int, event: CandidateEvent) -> int:
        """The call's index of the candidate `event` is of."""
        return prompt * self.n + event.index

    def finish_reason(self, choice: int, reason: FinishReason) -> str:
        """Why a choice ended: the engine's reason, or "tool_calls" (ToolCallReader)."""
        return self.tool_calls.finish_reason(choice, reason)

    def usage(self) -> Usage:
        """The tokens of all of the call's requests."""
        usages = [output.usage for output in self.outputs]
        return Usage(
            prompt_tokens=sum(u.prompt_tokens for u in usages),
            completion_tokens=sum(u.completion_tokens for u in usages),
            cached_tokens=sum(u.cached_tokens for u in usages),
        )

    def texts(self) -> list[str]:
        """Every candidate's text so far, for the request log."""
        return [text for output in self.outputs for text in output.texts_so_far()]
