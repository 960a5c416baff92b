"""LLMEngine: the synchronous core. add_request / abort_request / step, nothing else.

One step = schedule -> a StepPlan of arrays -> the runner queues the model and the sampler
on the device -> (a step later) append tokens, detokenize, check stops -> events. The
offline LLM class and the async engine both drive it; none of them knows gRPC or HTTP.
"""

from __future__ import annotations

import atexit
import collections
import functools
import gc
import itertools
import logging
import random
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from engine.config import EngineConfig
from engine.core.batch import SlotBook
from engine.core.request import Request, Sequence, TokenMask
from engine.core.runner import ForwardStep, LaunchedStep, StepOutput, StepPlan
from engine.core.sampler import SamplingRows
from engine.core.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from engine.core.startup import start_up
from engine.errors import DuplicateRequest, ValidationError
from engine.kv.block_manager import BlockManager
from engine.outputs import CandidateEvent, FinishReason, TokenLogprob, Usage
from engine.sampling_params import SamplingParams, candidate_seed, validate_request
from engine.stats import EngineStats
from engine.structured.grammar import GrammarCompiler, MaskFill, start_filling
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.prompts import PromptEncoder
from engine.text.stop_strings import StopStringMatcher

log = logging.getLogger(__name__)

# LLMEngine freezes what it builds at start-up out of the garbage collector's passes; the
# interpreter's last collection at exit must see it again (triton's bindings report what
# they find uncollected as leaks).
atexit.register(gc.unfreeze)


class Proposer(Protocol):
    """Guesses a running sequence's next tokens; the next step verifies them."""

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """At most max_tokens guesses of the tokens that follow seq.token_ids."""
        ...


# Per sequence of a step that samples: (the sequence, its sample rows, the proposed tokens
# they verify).
_Samplers = list[tuple[Sequence, int, list[int]]]


@dataclass
class _StepInFlight:
    """A step queued on the device, until its results are collected. One sampled under
    token masks has its forward queued and its sampling not (launched None) while they
    fill; a step's results may be read (result) before its events are made."""

    chunks: list[ScheduledChunk]
    samplers: _Samplers
    forward: ForwardStep
    filling: MaskFill | None  # the masks, when it has any
    launched: LaunchedStep | None = None
    result: StepOutput | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        parts = start_up(config)
        self.tokenizer, self.model_config = parts.tokenizer, parts.model_config
        self.runner, self.info = parts.runner, parts.info  # the warm-up adds its time to info
        self.workers = parts.workers
        self.eos_token_ids = frozenset(self.info.eos_token_ids)
        caching = config.cache.enable_prefix_caching
        # What the prefix cache publishes and evicts is recorded for routers to follow.
        self.block_manager = BlockManager(
            self.info.kv_num_blocks, config.block_size, caching, record_events=True
        )
        # The persistent batch's host record, shared with the scheduler, which places and
        # releases sequences in it; the engine writes the tokens it adds unsampled (proposals,
        # forced tokens), follows a rollback's blocks and takes each step's changes.
        num_slots, runner = config.scheduler.max_num_seqs, self.runner
        self.slots = SlotBook(num_slots, runner.token_width, runner.block_width)
        self.scheduler = Scheduler(
            config.scheduler, self.block_manager, self.slots, config.target_step_seconds
        )
        self.requests: dict[str, Request] = {}
        # Async scheduling: the step queued on the device and not collected yet.
        self._in_flight: _StepInFlight | None = None
        self.proposer: Proposer | None = None  # set one to verify its guesses each step
        self._start_counting()
        # What start-up built (the model, the tokenizer, the block manager's blocks) lives
        # as long as the engine: keep it out of the collector's full passes, which would
        # otherwise walk it all again and again, a pause of ~0.3 s each on a GPU host.
        gc.freeze()  # (until exit: see the atexit hook at the top)

    # ---- admission -------------------------------------------------------------------

    @functools.cached_property
    def prompts(self) -> PromptEncoder:
        """Prompts to token ids, checked against this engine's vocabulary and context."""
        info, model_len = self.info, self.model_config.max_position_embeddings
        bounds = f" (model {model_len}, KV pool {info.kv_capacity_tokens})"
        return PromptEncoder(self.tokenizer, info.vocab_size, info.max_model_len, bounds)

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        """Compiles constraints for this engine's tokenizer; built by the warm-up (reading
        the vocabulary takes ~0.3 s)."""
        info, config = self.info, self.config
        return GrammarCompiler(
            self.tokenizer,
            info.vocab_size,
            info.eos_token_ids,
            config.grammar_compile_timeout,
            config.grammar_step_timeout,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        token_mask: Callable[[], TokenMask] | None = None,
    ) -> Request:
        """Admit a request: its n candidates wait to be scheduled. token_mask, when given,
        makes each candidate's mask of the tokens it may sample; else params.constraint's
        is compiled here, waiting (the engine loop compiles before it admits)."""
        if request_id in self.requests:
            raise DuplicateRequest("request_id", "another request with this id is running")
        validate_request(params, priority, self.model_config.vocab_size)
        # Here for every request: a caller may hand over ids it built itself.
        max_tokens = self.prompts.check(prompt_token_ids, params.max_tokens)
        if token_mask is None and params.constraint is not None:
            constraint = params.constraint
            token_mask = self.grammars.masks(constraint, self.grammars.compile(constraint))

        request = Request(
            request_id=request_id,
            prompt_token_ids=tuple(prompt_token_ids),
            params=params,
            max_tokens=max_tokens,
            priority=priority,
            arrival_order=next(self._arrivals),
        )
        base_seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        for index in range(params.n):
            seq = Sequence(
                request=request,
                index=index,
                seed=candidate_seed(base_seed, index),
                token_ids=array("q", request.prompt_token_ids),
                detokenizer=IncrementalDetokenizer(
                    self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
                ),
                stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output),
                token_mask=token_mask() if token_mask is not None else None,
            )
            request.sequences.append(seq)
            self.scheduler.add(seq)
        self.requests[request_id] = request
        return request

    def abort_request(self, request_id: str, door: str = "api") -> list[CandidateEvent]:
        """Cancel a request; returns its final CANCELLED events (empty if unknown/finished).
        Counted in stats().aborts under door (who asked) and the stage the request was at."""
        if request_id in self.requests:
            self.aborts[door, self.requests[request_id].stage] += 1
        return self._finish_request(request_id, FinishReason.CANCELLED, None)

    @property
    def has_unfinished_requests(self) -> bool:
        """Requests are running, or a step is still in flight (step() collects it)."""
        return bool(self.requests) or self._in_flight is not None

    def check_ranks(self) -> None:
        """Raise WorkerLost if a tensor-parallel worker has exited (a cheap poll)."""
        if self.workers is not None:
            self.workers.check()

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any; the engine cannot step after this."""
        if self.workers is not None:
            self.workers.stop()

    def reset_state(self) -> None:
        """Forget all that ran, as if just built: after a warm-up, so that metrics and the
        prefix cache see only real traffic, and unseeded requests draw the seeds a fresh
        engine would. The engine must be idle."""
        if self.has_unfinished_requests:
            raise RuntimeError("reset_state needs an idle engine")
        self.block_manager.reset()
        self.scheduler.num_preemptions = 0
        self.grammars.reset()
        self._start_counting()

    def _start_counting(self) -> None:
        """Arrival order, unseeded requests' seeds and the work counters (EngineStats) from
        their beginning. Prompt tokens count what was computed: not prefix-cache hits, a
        prompt recomputed after preemption again, recomputed output tokens in neither."""
        self._arrivals = itertools.count()
        self._seed_rng = random.Random(self.config.engine_seed)
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self.num_forced_tokens = 0
        self.aborts: collections.Counter[tuple[str, str]] = collections.Counter()

    def stats(self) -> EngineStats:
        """A snapshot of load and counters; call it on the thread that steps the engine."""
        num_running = len({id(seq.request) for seq in self.scheduler.running})
        bm = self.block_manager
        return EngineStats(
            num_running_requests=num_running,
            num_waiting_requests=len(self.requests) - num_running,
            num_kv_blocks_used=bm.num_used_blocks,
            num_kv_blocks_total=bm.num_blocks,
            kv_block_size=bm.block_size,
            prefix_cache_queried_tokens=bm.queried_tokens,
            prefix_cache_hit_tokens=bm.hit_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generated_tokens=self.num_generated_tokens,
            num_forced_tokens=self.num_forced_tokens,
            num_steps=self.num_steps,
            aborts=tuple((door, stage, n) for (door, stage), n in sorted(self.aborts.items())),
            grammar=self.grammars.stats(),
        )

    # ---- one step ---------------------------------------------------------------------

    def step(self) -> list[CandidateEvent]:
        """Schedule and queue a step; return the events of the steps that finished. With
        async scheduling the device runs a step ahead: this call queues step t+1, then
        waits for step t and turns its tokens into events, so the host's work overlaps the
        device's. Without it (the CPU), each call runs its own step.

        A step sampled under token masks reads step t's tokens back before its forward is
        queued (its masks follow them), and its masks fill on llguidance's threads from
        then on, while this thread queues the forward, makes t's events and schedules and
        plans the next step. Its sampling waits for the next call, right before the next
        forward. Where a grammar may force the tokens after step t's (grammar_fast_forward),
        step t is read back and its events made before step t+1 is scheduled: the forced
        tokens are appended then (_append_forced), and t+1 computes them.

        The call's time goes to the scheduler's StepBudget, with the tokens it scheduled:
        where steps are timed (the CPU), it runs the step whole."""
        started = time.monotonic()
        # Where step t+1 builds on step t's tokens, the host reads them first: a proposer
        # guesses from them, and a grammar appends the tokens it forces after them.
        in_flight = self._in_flight
        fast_forward = self.config.grammar_fast_forward
        masked = in_flight is not None and in_flight.filling is not None
        reads_first = self.proposer is not None or (masked and fast_forward)
        events = self._collect_in_flight() if reads_first else []
        sched = self.scheduler.schedule()
        launched = self._launch(sched, events)
        events += self._collect_in_flight()
        if launched is not None and not self.config.uses_async_scheduling:
            events += self._collect(launched)
        else:
            self._in_flight = launched
        seconds = time.monotonic() - started
        self.scheduler.budget.record(sched.num_tokens, sched.budget, seconds)
        return events

    def _collect_in_flight(self) -> list[CandidateEvent]:
        step, self._in_flight = self._in_flight, None
        return self._collect(step) if step is not None else []

    def _launch(self, sched: SchedulerOutput, events: list[CandidateEvent]) -> _StepInFlight | None:
        """Queue a scheduled step on the device; on a failure its requests end (events)."""
        if sched.is_empty:
            return None
        self.num_steps += 1
        try:
            plan, samplers, masks = self._plan(sched.chunks)
            # The step before goes first: this forward reads the tokens it samples.
            if self._in_flight is not None and not self._sample(self._in_flight, events):
                self._in_flight = None
            filling = None
            if masks:  # they follow the tokens of the step before: those are read first
                if self._in_flight is not None and not self._read(self._in_flight, events):
                    self._in_flight = None
                rows, vocab_size = int(plan.num_samples.sum()), self.model_config.vocab_size
                filling = start_filling(masks, rows, vocab_size)
            step = _StepInFlight(sched.chunks, samplers, self.runner.forward(plan), filling)
            if not masks:
                step.launched = self.runner.sample(step.forward)
        except Exception as exc:  # an engine fault fails this step's requests, not the engine
            events += self._fail_step(sched.chunks, exc)
            return None

        for chunk in sched.chunks:
            seq = chunk.seq
            if seq.is_finished:  # by the step before, collected while this one was queued
                continue
            seq.num_computed_tokens = chunk.end
            prompt_end = min(chunk.end, seq.num_prompt_tokens)
            self.num_prompt_tokens_computed += max(0, prompt_end - chunk.start)
            # Blocks are published once the host knows all their tokens; a block whose
            # tokens are still on the device follows with a later step.
            known = min(chunk.end, len(seq.token_ids))
            self.block_manager.register_full_blocks(seq.block_table, seq.token_ids, known)
        for seq, num_rows, _ in samplers:
            seq.num_tokens += num_rows  # those past the accepted proposals go at collect
        return step

    def _plan(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[StepPlan, _Samplers, list[tuple[int, TokenMask]]]:
        """The step's arrays for the runner, its samplers, and the first row and mask of
        each sequence sampled under a mask."""
        # Runs for every sequence of every step: plain loops over plain values.
        size = len(chunks)
        slots, query_lens, seq_lens, num_samples, num_prompt = (
            np.zeros(size, dtype=np.int32) for _ in range(5)
        )
        # Per sampled row: its params, seed, counter and the ids it may not pick.
        params, seeds, counters, banned = [], [], [], []
        samplers: _Samplers = []
        masks: list[tuple[int, TokenMask]] = []  # (its first row, the mask)
        prompt_logprobs: dict[int, int] = {}
        book, vocab_size = self.slots, self.model_config.vocab_size
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            request = seq.request
            slots[i], seq_lens[i] = seq.slot, chunk.end
            query_lens[i], num_prompt[i] = chunk.end - chunk.start, seq.num_prompt_tokens
            if seq.index == 0 and chunk.start < seq.num_prompt_tokens:
                if request.prompt_logprobs_pending:
                    prompt_logprobs[i] = request.params.prompt_logprobs
            if not chunk.samples:
                continue
            proposed = seq.proposed[: chunk.end - seq.num_tokens]  # those past its end
            seq.proposed = []
            if proposed:
                book.write_tokens(seq.slot, seq.num_tokens, proposed)
            rows = num_samples[i] = len(proposed) + 1
            samplers.append((seq, rows, proposed))
            if seq.token_mask is not None:
                masks.append((len(params), seq.token_mask))
            # Row j's token goes to position chunk.end - rows + 1 + j; its counter is the
            # number of output tokens before it.
            first = chunk.end - rows + 1 - seq.num_prompt_tokens
            for sampled_before in range(first, first + rows):
                params.append(request.params)
                seeds.append(seq.seed)
                counters.append(sampled_before)
                banned.append(request.params.banned_ids(sampled_before, self.eos_token_ids))
        plan = StepPlan(
            slots=slots,
            query_lens=query_lens,
            seq_lens=seq_lens,
            num_samples=num_samples,
            num_prompt_tokens=num_prompt,
            sampling=SamplingRows.build(params, seeds, counters, banned, vocab_size),
            prompt_logprobs=prompt_logprobs,
            changes=book.take_changes(),
        )
        return plan, samplers, masks

    def _sample(self, step: _StepInFlight, events: list[CandidateEvent]) -> bool:
        """Queue a step's sampling, under its masks once they are filled, unless queued;
        on a failure its requests end (events) and it is dropped (False)."""
        try:
            if step.launched is None:
                allowed = None
                if step.filling is not None:
                    allowed = step.filling.result()
                    if failures := step.filling.failures():
                        events += self._fail_constraints(step, failures)
                step.launched = self.runner.sample(step.forward, allowed)
        except Exception as exc:  # an engine fault fails this step's requests, not the engine
            events += self._fail_step(step.chunks, exc)
            return False
        return True

    def _fail_constraints(
        self, step: _StepInFlight, failures: dict[int, ValidationError]
    ) -> list[CandidateEvent]:
        """End the requests whose masks cannot go on after the step's fill (by first row);
        the step samples on, for the others."""
        events, row = [], 0
        for seq, rows, _ in step.samplers:
            if row in failures and not seq.is_finished:
                events += self._constraint_failed(seq, failures[row])
            row += rows
        return events

    def _read(self, step: _StepInFlight, events: list[CandidateEvent]) -> bool:
        """Wait for a sampled step's results, unless read, and move each masked sequence's
        matcher past its token; on a failure its requests end (events) and it is dropped
        (False)."""
        if step.result is not None:
            return True
        try:
            step.result = self.runner.collect(step.launched)
        except Exception as exc:  # e.g. a device error surfacing at the sync
            events += self._fail_step(step.chunks, exc)
            return False
        if step.filling is None:  # no sequence of it has a mask
            return True
        row = 0
        for seq, rows, _ in step.samplers:  # a masked sequence samples one row: no proposals
            if seq.token_mask is not None and not seq.is_finished:
                token_id = step.result.token_ids[row]
                try:
                    seq.token_mask.accept(token_id)
                except ValidationError as exc:
                    failure: Exception = exc
                    if not _allows(step.filling.allowed[row], token_id):  # not the grammar's
                        failure = RuntimeError("a token its mask did not allow was sampled")
                    events += self._constraint_failed(seq, failure)
            row += rows
        return True

    def _collect(self, step: _StepInFlight) -> list[CandidateEvent]:
        """Wait for a launched step and turn its results into events."""
        events: list[CandidateEvent] = []
        if not (self._sample(step, events) and self._read(step, events)):
            return events
        result = step.result
        for i, lps in result.prompt_logprobs.items():
            chunk = step.chunks[i]
            chunk.seq.request.add_prompt_logprobs(chunk.start + 1, lps)
        row, spare = 0, self._graph_rows_spare()
        for seq, rows, proposed in step.samplers:
            tokens = result.token_ids[row : row + rows]
            logprobs = result.logprobs[row : row + rows]
            row += rows
            if seq.is_finished:  # it ended while the step ran (a stop, an abort)
                continue
            kept = self._roll_back(seq, tokens, proposed) if proposed else 1
            for token_id, logprob in zip(tokens[:kept], logprobs):
                events.append(self._append_token(seq, token_id, logprob))
                if seq.is_finished:
                    break
            if self.proposer is not None and not seq.is_finished and seq.token_mask is None:
                room = seq.request.max_tokens - seq.num_sampled_tokens - 1
                seq.proposed = self.proposer.propose(seq, room)[: max(0, room)]
            if seq.token_mask is not None and not seq.is_finished:
                forced = self._append_forced(seq, spare)
                events += forced
                spare = None if spare is None else spare - len(forced)
        return events

    def _graph_rows_spare(self) -> int | None:
        """The rows the largest CUDA graph has beyond one for each running sequence: room
        for forced tokens in the next step. None where every step runs eagerly."""
        rows = self.runner.max_graph_rows
        return None if rows is None else max(0, rows - len(self.scheduler.running))

    def _append_forced(self, seq: Sequence, spare: int | None) -> list[CandidateEvent]:
        """Append the tokens seq's grammar forces next, unsampled: the next step computes
        them with the token before them, in one chunk, and samples after them. Not where a
        token of seq is still in flight (it would come first), nor for logprobs (a forced
        token has none). Where steps replay CUDA graphs, no more than keep the next step
        in one (spare rows in all, taken in scheduling order; runner.graph_room for seq):
        an eager step costs several replays, and the tokens left out come as usual."""
        if (
            not self.config.grammar_fast_forward
            or seq.num_tokens != len(seq.token_ids)
            or seq.request.params.logprobs is not None
        ):
            return []
        room = seq.request.max_tokens - seq.num_sampled_tokens
        if spare is not None:
            room = min(room, spare, self.runner.graph_room(seq.num_tokens))
        events, appended = [], []
        try:
            forced = seq.token_mask.forced()[:room]
        except ValidationError as exc:
            return self._constraint_failed(seq, exc)
        for token_id in forced:
            try:
                seq.token_mask.accept(token_id)
            except ValidationError as exc:  # its own forced token: the grammar's fault
                return events + self._constraint_failed(seq, exc)
            seq.num_tokens += 1
            self.num_forced_tokens += 1
            events.append(self._append_token(seq, token_id, None))
            appended.append(token_id)
            if seq.is_finished:  # a stop string, EOS or its length: nothing computes them
                return events
        if appended and seq.slot is not None:  # the device's copy (a waiting one has none)
            self.slots.write_tokens(seq.slot, seq.num_tokens - len(appended), appended)
        return events

    def _roll_back(self, seq: Sequence, tokens: list[int], proposed: list[int]) -> int:
        """How many sampled tokens to keep: up to the first that differs from its proposal
        (a matched proposal is the token the plain path samples there, so the first
        mismatch is too). The rest go: their counts, their KV, the blocks only they needed."""
        accepted = 0
        while accepted < len(proposed) and tokens[accepted] == proposed[accepted]:
            accepted += 1
        rejected = len(proposed) - accepted
        seq.num_tokens -= rejected
        seq.num_computed_tokens -= rejected
        self.block_manager.shrink(seq.block_table, seq.num_tokens)
        self.slots.sync_blocks(seq.slot, seq.block_table.block_ids)
        return accepted + 1

    def _append_token(
        self, seq: Sequence, token_id: int, logprob: TokenLogprob | None
    ) -> CandidateEvent:
        request = seq.request
        seq.token_ids.append(token_id)
        self.num_generated_tokens += 1
        if request.timing.first_token is None:
            request.timing.first_token = time.monotonic()

        text, reason = seq.next_text(token_id, self.eos_token_ids)
        logprobs = [logprob] if logprob is not None else None
        event = CandidateEvent(request.request_id, seq.index, text, [token_id], logprobs)
        if seq.index == 0 and request.prompt_logprobs is not None and seq.num_output_tokens == 1:
            event.prompt_logprobs = request.prompt_logprobs
        if reason is not None:
            self._finish_sequence(seq, reason, None, event)
        return event

    # ---- endings ----------------------------------------------------------------------

    def _finish_sequence(
        self,
        seq: Sequence,
        reason: FinishReason,
        error: str | None,
        event: CandidateEvent,
        error_field: str | None = None,
    ) -> None:
        request = seq.request
        self.scheduler.remove(seq)
        seq.finish_reason, seq.error = reason, error
        event.finish_reason, event.matched_stop, event.error = reason, seq.matched_stop, error
        event.error_field = error_field
        cached = request.sequences[0].num_cached_tokens
        event.usage = Usage(request.num_prompt_tokens, seq.num_output_tokens, cached)
        if request.finished:
            request.timing.finished = time.monotonic()
            self.requests.pop(request.request_id, None)
        event.timing = request.timing

    def _finish_request(
        self,
        request_id: str,
        reason: FinishReason,
        error: str | None,
        error_field: str | None = None,
    ) -> list[CandidateEvent]:
        request = self.requests.get(request_id)
        if request is None:
            return []
        events = []
        for seq in [s for s in request.sequences if not s.is_finished]:
            event = CandidateEvent(request_id, seq.index, "", [])
            self._finish_sequence(seq, reason, error, event, error_field)
            events.append(event)
        return events

    def _constraint_failed(self, seq: Sequence, exc: Exception) -> list[CandidateEvent]:
        """End the request of a candidate whose token mask cannot go on: a ValidationError
        is its constraint's fault (the events name the field), anything else the engine's.
        The log has the request id and no content: llguidance's words quote the grammar."""
        request_id = seq.request.request_id
        if isinstance(exc, ValidationError):
            log.warning(
                "request %s failed: its constraint (%s) could not go on", request_id, exc.field
            )
            return self._finish_request(request_id, FinishReason.ERROR, str(exc), exc.field)
        log.error("request %s failed: its token mask: %s", request_id, exc)
        error = f"engine error: {type(exc).__name__}: {exc}"
        return self._finish_request(request_id, FinishReason.ERROR, error)

    def _fail_step(self, chunks: list[ScheduledChunk], exc: Exception) -> list[CandidateEvent]:
        """End the requests of a step that raised exc (call from its except block). Under
        tensor parallelism the ranks may no longer agree: the engine ends (WorkerLost)."""
        if self.workers is not None:
            raise self.workers.failure(exc) from exc
        log.exception("step failed; failing %d requests", len(chunks))
        error = f"engine error: {type(exc).__name__}: {exc}"
        events: list[CandidateEvent] = []
        for rid in dict.fromkeys(c.seq.request.request_id for c in chunks):
            events.extend(self._finish_request(rid, FinishReason.ERROR, error))
        return events


def _allows(row: np.ndarray, token_id: int) -> bool:
    """Whether a mask row (bit v % 32 of word v // 32) allows token_id."""
    return bool(int(row[token_id // 32]) >> (token_id % 32) & 1)
