"""Request and per-candidate sequence state, as small dataclasses of counters.

A Request owns its `n` candidates from admission on, one Sequence each. Candidate 0
prefills the prompt; the others wait until it has, or has ended (Sequence.waits_for_prompt),
and then start from the prompt's blocks in the prefix cache, so the prompt is computed once.

KV regions of a sequence's num_tokens tokens (prompt + output sampled so far):

    [0, num_cached_tokens)                   KV reused from the prefix cache at admission
    [0, num_computed_tokens)                 KV present in the blocks of block_table
    [num_computed_tokens, num_tokens)        still to compute; a step schedules a chunk of it

num_tokens counts every token sampled, also those of a step still running on the device
whose ids the host has not read back yet; token_ids holds the ids the host has. The
device has them all: a running sequence owns a slot of the persistent batch
(engine/core/batch.py), whose token row the sampler writes. A sequence samples its next token
in the step whose chunk reaches num_tokens. Preemption by recompute frees the blocks and
the slot and sets num_computed_tokens back to 0.

Token ids live where Python's garbage collector does not walk them: a prompt in a tuple
(untracked after the collector first sees it), a sequence's ids in an int64 array. In
lists, every full pass of the collector visits each id: in an offline batch of 256
requests, ~600k of them, 10-25 ms a pass with the GPU waiting for the next step.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import numpy as np

from engine.kv.block_manager import BlockTable
from engine.outputs import FinishReason, RequestTiming, TokenLogprob
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance

    from engine.text.detokenizer import IncrementalDetokenizer
    from engine.text.stop_strings import StopStringMatcher


class TokenMask(Protocol):
    """Which tokens a candidate may sample next (structured output fills one per sequence).

    A step fills its masks one of two ways (engine/structured/grammar.py: start_filling): a
    grammar's mask (GrammarMask) has its llguidance matcher, which llguidance fills on
    threads of its own with the step's other grammar masks, beside the engine thread; any
    other mask has none and fills its row itself (fill_next), on the engine thread."""

    matcher: llguidance.LLMatcher | None  # None: fill_next fills the row

    def fill_next(self, bitmask: np.ndarray) -> None:
        """Write the allowed set into bitmask (int32 [ceil(vocab / 32)], bit v % 32 of
        word v // 32 set = token v allowed); it arrives all ones."""
        ...

    def accept(self, token_id: int) -> None:
        """token_id was sampled: advance to the next position."""
        ...

    def forced(self) -> list[int]:
        """The tokens from here on that the mask would allow alone, one after another (a
        grammar's fixed text): the engine appends them unsampled, accepting each."""
        ...


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int  # params.max_tokens resolved against the context limit
    priority: int = 0  # higher runs first; FCFS among equals
    arrival_order: int = 0  # tie-breaker, assigned by the engine
    timing: RequestTiming = field(default_factory=lambda: RequestTiming(time.monotonic()))
    sequences: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled during prefill if asked

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.sequences)

    @property
    def stage(self) -> str:
        """Where it is in its life: waiting (never run), prefill, decode, or preempted
        (waiting to be recomputed). With a candidate running, its stage is the request's."""
        live = [s for s in self.sequences if s.status is not SequenceStatus.FINISHED]
        running = [s for s in live if s.status is SequenceStatus.RUNNING]
        if running:
            prefilling = any(s.num_computed_tokens < s.num_prompt_tokens for s in running)
            return "prefill" if prefilling else "decode"
        return "preempted" if any(s.num_preemptions for s in live) else "waiting"

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt logprobs were asked for and not all prompt positions have them yet."""
        if self.params.prompt_logprobs is None:
            return False
        return self.prompt_logprobs is None or len(self.prompt_logprobs) < self.num_prompt_tokens

    def add_prompt_logprobs(self, first_position: int, logprobs: list[TokenLogprob]) -> None:
        """Logprobs of the prompt tokens from first_position on. A prefill recomputed after
        preemption covers positions that already have theirs."""
        if self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob
        self.prompt_logprobs.extend(logprobs[len(self.prompt_logprobs) - first_position :])


@dataclass(eq=False)
class Sequence:
    request: Request
    index: int  # candidate index within the request
    seed: int  # drives this candidate's sampling, independent of its batch-mates
    token_ids: array[int]  # int64 ("q"): prompt + the output the host has read back
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    token_mask: TokenMask | None = None
    block_table: BlockTable = field(default_factory=lambda: BlockTable([]))
    slot: int | None = None  # its rows in the persistent batch, while running
    proposed: list[int] = field(default_factory=list)  # guessed next tokens, to verify
    num_tokens: int = 0  # prompt + every output token sampled, read back or not
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    num_preemptions: int = 0
    # The request's prompt length, kept here: every step reads it for every sequence.
    num_prompt_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.request.num_prompt_tokens
        self.num_tokens = len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the host has read back."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens sampled so far, read back or not."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def has_all_tokens(self) -> bool:
        """It has sampled max_tokens: whatever the unread ones are, it finishes with them."""
        return self.num_sampled_tokens >= self.request.max_tokens

    @property
    def waits_for_prompt(self) -> bool:
        """A later candidate waits until candidate 0 has computed the prompt they share, or
        has finished: it may finish preempted, by a token that was in flight."""
        first = self.request.sequences[0]
        computing = first.num_computed_tokens < first.num_prompt_tokens and not first.is_finished
        return self.index > 0 and computing

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Scheduling order: higher priority first, then arrival, then candidate index."""
        return (-self.request.priority, self.request.arrival_order, self.index)

    def next_text(
        self, token_id: int, eos_token_ids: frozenset[int]
    ) -> tuple[str, FinishReason | None]:
        """The text to show now that token_id (appended to token_ids) was sampled, and why
        the candidate ends here (None: it goes on): a stop string, a stop id or EOS once it
        has min_tokens, or its length limit. A matched stop is kept in matched_stop."""
        params = self.request.params
        text, matched = self.stop_matcher.feed(self.detokenizer.add(token_id))
        n_out = self.num_output_tokens
        reason: FinishReason | None = None
        if matched is not None:
            reason, self.matched_stop = FinishReason.STOP, matched
        elif token_id in params.stop_token_ids and n_out >= params.min_tokens:
            reason, self.matched_stop = FinishReason.STOP, token_id
        elif token_id in eos_token_ids and not params.ignore_eos and n_out >= params.min_tokens:
            reason = FinishReason.EOS
        elif n_out >= self.request.max_tokens:
            limited = params.max_tokens is not None
            reason = FinishReason.LENGTH if limited else FinishReason.CONTEXT_LIMIT
        if reason is not None and matched is None:
            # Held-back text that might still have begun a stop string is settled now.
            tail, matched = self.stop_matcher.feed(self.detokenizer.flush())
            text += tail
            if matched is not None:
                reason, self.matched_stop = FinishReason.STOP, matched
            else:
                text += self.stop_matcher.flush()
        return text, reason
