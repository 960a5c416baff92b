"""What the engine hands back: one event per candidate per step, and finished results."""

from __future__ import annotations

from array import array
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    LENGTH = "length"  # max_tokens reached
    EOS = "eos"  # the model's end-of-sequence token
    STOP = "stop"  # a stop string or stop token id matched
    CONTEXT_LIMIT = "context_limit"  # max_model_len (or the whole KV pool) reached
    CANCELLED = "cancelled"  # aborted by the caller
    ERROR = "error"  # the engine failed this request


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


@dataclass
class RequestTiming:
    """Monotonic timestamps (time.monotonic) of a request's milestones."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass
class CandidateEvent:
    """New output of one candidate since its previous event. The last one has finish_reason."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # first event of candidate 0 only
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    # With finish_reason ERROR: the request field whose value failed it (a constraint whose
    # grammar its parser could not follow), the caller's fault (INVALID_ARGUMENT, 400);
    # None: the engine's (INTERNAL, 500).
    error_field: str | None = None
    usage: Usage | None = None  # on the final event
    timing: RequestTiming | None = None  # on the final event

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def merge(cls, events: list[CandidateEvent]) -> CandidateEvent:
        """One event carrying consecutive events of one candidate; the last one's ending."""
        first, last = events[0], events[-1]
        logprobs = None
        if any(e.logprobs is not None for e in events):
            logprobs = [lp for e in events for lp in e.logprobs or []]
        return cls(
            request_id=first.request_id,
            index=first.index,
            text="".join(e.text for e in events),
            token_ids=[t for e in events for t in e.token_ids],
            logprobs=logprobs,
            prompt_logprobs=first.prompt_logprobs,
            finish_reason=last.finish_reason,
            matched_stop=last.matched_stop,
            error=last.error,
            error_field=last.error_field,
            usage=last.usage,
            timing=last.timing,
        )


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    matched_stop: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


@dataclass
class RequestOutput:
    """A whole request's result: what the offline LLM API returns, and what a door's
    whole (not streamed) answer is formatted from."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[TokenLogprob | None] | None = None
    usage: Usage | None = None
    timing: RequestTiming | None = None


@dataclass
class RequestOutputBuilder:
    """A request's RequestOutput, gathered event by event as the events come: the offline
    API's result, and what each door formats a whole answer and its usage from.

    It keeps a few lists per candidate, not the events: an offline batch of 256 requests of
    ~500 tokens each would otherwise hold ~270k event objects until the end, which every
    full pass of Python's garbage collector walks (~30 ms a pass on the GPU host, with the
    GPU waiting). For the same reason the token ids wait in int64 arrays, and the prompt in
    the request's tuple (engine/core/request.py): build() makes the lists."""

    request_id: str
    prompt_token_ids: SequenceOf[int]
    outputs: list[CompletionOutput]
    texts: list[list[str]]  # per candidate, the text pieces, joined by build()
    token_ids: list[array[int]]  # per candidate, the ids so far
    prompt_logprobs: list[TokenLogprob | None] | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    timing: RequestTiming | None = None  # the latest final event's

    @classmethod
    def start(
        cls, request_id: str, prompt_token_ids: SequenceOf[int], n: int
    ) -> RequestOutputBuilder:
        outputs = [CompletionOutput(i, "", [], None) for i in range(n)]
        token_ids = [array("q") for _ in range(n)]
        return cls(request_id, prompt_token_ids, outputs, [[] for _ in range(n)], token_ids)

    def add(self, ev: CandidateEvent) -> None:
        out = self.outputs[ev.index]
        self.texts[ev.index].append(ev.text)
        self.token_ids[ev.index].extend(ev.token_ids)
        if ev.logprobs is not None:
            out.logprobs = out.logprobs or []
            out.logprobs += ev.logprobs
        if ev.prompt_logprobs is not None:
            self.prompt_logprobs = ev.prompt_logprobs
        if ev.finished:
            out.finish_reason, out.matched_stop, out.error = (
                ev.finish_reason,
                ev.matched_stop,
                ev.error,
            )
            if ev.usage is not None:
                self.completion_tokens += ev.usage.completion_tokens
                self.cached_tokens = max(self.cached_tokens, ev.usage.cached_tokens)
            if ev.timing is not None:
                self.timing = ev.timing

    @property
    def finished(self) -> bool:
        return all(out.finish_reason is not None for out in self.outputs)

    @property
    def usage(self) -> Usage:
        return Usage(len(self.prompt_token_ids), self.completion_tokens, self.cached_tokens)

    def texts_so_far(self) -> list[str]:
        """Each candidate's text up to now (a request may end early: the caller left)."""
        return ["".join(pieces) for pieces in self.texts]

    def build(self) -> RequestOutput:
        for out, text, ids in zip(self.outputs, self.texts_so_far(), self.token_ids, strict=True):
            out.text = text
            out.token_ids = ids.tolist()
        return RequestOutput(
            self.request_id,
            list(self.prompt_token_ids),
            self.outputs,
            self.prompt_logprobs,
            self.usage,
            self.timing,
        )
