"""Constraints (engine/structured/constraints.py) as token masks, with llguidance.

GrammarCompiler turns a constraint into a grammar for the engine's tokenizer on threads of
its own (llguidance releases the interpreter lock while it builds one), so neither the
engine loop nor the event loop waits for it; the grammars built last are kept, a bounded
number, keyed by the constraint. A build has the time limit to begin and as long again to
finish. One that runs past it is refused as the constraint's fault (ValidationError) and
left to finish on its thread (llguidance's own limits bound it); one that never got a
thread is refused as the server's (EngineOverloaded: retry). So a flood of pathological
schemas costs constrained requests a wait and a retry, never the server, and never an
answer that blames a simple schema.

A compiled constraint is a matcher at its start; each candidate gets a copy of its own
(GrammarMask, a TokenMask of engine/core/request.py) that fills the candidate's row of the
step's bitmask and advances on each sampled token. JSON is generated compactly (one space
after ',' and ':', no free whitespace), which keeps a small model from filling max_tokens
with blank lines.

A grammar that compiled may still be more than its parser can follow: one too ambiguous
or too wide for llguidance's limits (its matcher then stops, in an error state), or one
whose work for a token grows with every token (an ambiguous grammar's masks: milliseconds
at first, seconds a hundred tokens on). Either is the constraint's fault, never an answer
outside it: the candidate's mask raises a ValidationError naming the constraint's field
where its matcher stopped, or where its work for one token (its mask, or moving past a
token) took more CPU time than the step time limit, and the engine fails that request
alone.
llguidance's own errors stay out of the log: they quote the grammar and the tokens.

A model whose tokenizer llguidance cannot read (one without a decoder) has no structured
output: the compiler says why once, and refuses every constraint with that reason.

llguidance rather than xgrammar (0.2.9): xgrammar's rule for a string with a maxLength
admits raw control characters, which no JSON parser takes; llguidance needs no
transformers, builds a grammar in about a millisecond and fills a mask in microseconds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import llguidance
import llguidance.numpy
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from engine.core.request import TokenMask
from engine.errors import EngineOverloaded, ValidationError
from engine.stats import GRAMMAR_BUILD_SECONDS_BOUNDS, GrammarStats
from engine.structured.constraints import Constraint
from engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Compact JSON, the way models are trained to write it.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's default limits, but errors without the parser's state and the grammar (they
# quote the request: its grammar and the tokens generated).
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        time_limit: float = 10.0,
        step_time_limit: float = math.inf,
        cache_size: int = 256,
        threads: int = 2,
    ):
        """vocab_size: the model's, the width of its logits (may exceed the tokenizer's).
        time_limit bounds a build; step_time_limit a candidate's work for one token."""
        self.time_limit, self.step_time_limit = time_limit, step_time_limit
        # Why constraints cannot be served on this model; None: they can.
        self.unavailable: str | None = None
        try:
            self._tokenizer = llguidance.LLTokenizer(
                tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(stop_token_ids)
            )
        except Exception as exc:  # llguidance reads each tokenizer kind its own way
            self.unavailable = _unreadable_tokenizer(tokenizer, exc)
            log.warning(
                "structured output is not available for this model: %s; constrained "
                "requests and forced tool calls will be refused",
                self.unavailable,
            )
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the cache and stats change on several threads
        self._stats = GrammarStats()  # replaced, never changed: a reader needs no lock

    def start(self, constraint: Constraint) -> PendingGrammar:
        """Compile on the pool (refused at once where this model has no structured output)."""
        pending = PendingGrammar(constraint, self.time_limit)
        if self.unavailable is not None:
            pending.future = Future()
            pending.future.set_exception(
                ValidationError(
                    constraint.field,
                    f"structured output is not available for this model: {self.unavailable}",
                )
            )
            return pending
        pending.future = self._pool.submit(self._build, pending)
        return pending

    def compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """Compile and wait, up to the time limit."""
        return self.start(constraint).matcher(wait=True)

    def stats(self) -> GrammarStats:
        return self._stats

    def reset(self) -> None:
        """Forget the grammars built and their counts (the tokenizer is kept)."""
        with self._lock:
            self._cache.clear()
            self._stats = GrammarStats()

    def masks(self, constraint: Constraint, start: llguidance.LLMatcher) -> Callable[[], TokenMask]:
        """Makes one candidate's mask each call, from a compiled constraint."""
        field, limit = constraint.field, self.step_time_limit
        return lambda: GrammarMask(start.deep_copy(), field, limit)

    def _build(self, pending: PendingGrammar) -> llguidance.LLMatcher:
        pending.began = time.monotonic()
        return self._compile(pending.constraint)

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        with self._lock:
            if constraint in self._cache:
                self._cache.move_to_end(constraint)
                self._stats = dataclasses.replace(
                    self._stats, cache_hits=self._stats.cache_hits + 1
                )
                return self._cache[constraint]
        started = time.perf_counter()
        try:
            matcher = llguidance.LLMatcher(
                self._tokenizer, _grammar(constraint), log_level=0, limits=_LIMITS
            )
        finally:
            self._count_build(time.perf_counter() - started)
        if matcher.is_error():
            raise ValidationError(
                constraint.field, f"cannot be compiled: {_one_line(matcher.get_error())}"
            )
        with self._lock:
            self._cache[constraint] = matcher
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def _count_build(self, seconds: float) -> None:
        with self._lock:
            stats = self._stats
            within = zip(stats.builds_within, GRAMMAR_BUILD_SECONDS_BOUNDS, strict=True)
            self._stats = dataclasses.replace(
                stats,
                builds_within=tuple(n + (seconds <= bound) for n, bound in within),
                builds=stats.builds + 1,
                build_seconds=stats.build_seconds + seconds,
            )


@dataclass
class PendingGrammar:
    """A constraint compiling on the pool, until it is built, refused or out of time."""

    constraint: Constraint
    time_limit: float
    queued: float = field(default_factory=time.monotonic)
    began: float | None = None  # when a pool thread began the build (set on that thread)
    future: Future[llguidance.LLMatcher] = field(init=False)

    @property
    def deadline(self) -> float:
        """The time limit counts from the build's start, or from the queueing until then."""
        return (self.queued if self.began is None else self.began) + self.time_limit

    @property
    def settled(self) -> bool:
        """matcher() answers at once: built, refused, or past its deadline."""
        return self.future.done() or time.monotonic() > self.deadline

    def matcher(self, wait: bool = False) -> llguidance.LLMatcher:
        """The compiled constraint (with `wait`, waiting up to its deadline), or the error
        that refuses it: a ValidationError (it cannot be compiled, or its build ran out of
        time) or EngineOverloaded (it waited its time for a thread)."""
        if wait:  # to the start's deadline, then (if it began) to the build's
            for _ in range(2):
                futures.wait([self.future], timeout=max(0.0, self.deadline - time.monotonic()))
        if self.future.done():
            return self.future.result()
        began = self.began
        if self.future.cancel() or began is None or time.monotonic() - began <= self.time_limit:
            raise EngineOverloaded(
                f"{self.constraint.field}: no grammar compile thread was free for "
                f"{self.time_limit:g} s (other constraints' builds hold them); retry later"
            )
        # The build runs on, unread: llguidance cannot be interrupted.
        raise ValidationError(
            self.constraint.field, f"did not compile within {self.time_limit:g} s; simplify it"
        )

    def cancel(self) -> None:
        """Its caller left: a build that has not begun never will."""
        self.future.cancel()


def _grammar(constraint: Constraint) -> str:
    """The constraint in llguidance's grammar language."""
    kind, spec = constraint.kind, constraint.spec
    try:
        if kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_STYLE)
        if kind == "json_object":
            schema = '{"type": "object"}'
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_STYLE)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "grammar":  # Lark, or GBNF (root ::= ...) turned into Lark
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec))
        # choice: each string a literal (JSON's escapes are Lark's)
        alternatives = " | ".join(json.dumps(s, ensure_ascii=False) for s in spec)
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    except Exception as exc:  # what the converters refuse, each in its own exception type
        raise ValidationError(constraint.field, f"cannot be compiled: {_one_line(exc)}") from None


def _one_line(message: object) -> str:
    """llguidance's messages draw a caret under the fault over several lines."""
    return " ".join(str(message).split())


def _unreadable_tokenizer(tokenizer: Tokenizer, exc: Exception) -> str:
    """Why llguidance cannot read the model's tokenizer, for the warning and the refusals."""
    if json.loads(tokenizer.backend.to_str()).get("decoder") is None:
        return (
            "its tokenizer has no decoder, so llguidance cannot tell the bytes each token "
            f"stands for ({_one_line(exc)})"
        )
    return f"llguidance cannot read its tokenizer ({_one_line(exc)})"


class GrammarMask:
    """One candidate's place in its grammar, and the request field its constraint came from.

    What moves it on (accept, forced) raises a ValidationError naming that field where its
    matcher stopped on the parser's limits, or where its work for one token took longer
    than time_limit: a fill's is read after the fill (fill_failure). The time that fails
    it is its own CPU time, which a busy machine does not stretch; the clock only tells
    which masks to time so, as CPU time costs more to read than the clock."""

    def __init__(self, matcher: llguidance.LLMatcher, field: str, time_limit: float = math.inf):
        self.matcher, self.field, self.time_limit = matcher, field, time_limit
        self.num_tokens = 0  # the tokens it has moved past
        # Fill it alone, its CPU time read, the next time: a fill of it (of several, or
        # alone on llguidance's threads) overran time_limit on the clock. Written by the
        # filling thread, as is fill_seconds, its last fill's CPU time where it was alone.
        self.fill_alone = False
        self.fill_seconds = 0.0
        # accept and forced read its CPU time from now on: one of them overran on the clock.
        self.cpu_timed = False

    def fill_next(self, bitmask: np.ndarray) -> None:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask[None], 0)

    def forced(self) -> list[int]:
        # llguidance's fast-forward tokens: empty unless the next token is the only one
        # allowed, and then each the only one allowed after those before it.
        clock = time.thread_time if self.cpu_timed else time.perf_counter
        started = clock()
        tokens = self.matcher.compute_ff_tokens()
        self._check(clock() - started)
        return tokens

    def accept(self, token_id: int) -> None:
        clock = time.thread_time if self.cpu_timed else time.perf_counter
        started = clock()
        self.matcher.consume_token(token_id)
        self.num_tokens += 1
        # A matcher stopped (by this token, or by the fill before it: its row then allows
        # EOS alone) still takes EOS: is_error tells.
        self._check(clock() - started)

    def fill_failure(self) -> ValidationError | None:
        """Why it cannot go on after a fill that filled it alone: it took longer than
        time_limit. None: it goes on. (A fill that stops its matcher is found by the
        accept of the token after it.)"""
        seconds = self.fill_seconds
        return self._too_slow(seconds) if seconds > self.time_limit else None

    def _check(self, seconds: float) -> None:
        """After a call of `seconds` (CPU time where cpu_timed, else on the clock)."""
        if self.matcher.is_error():
            # The first line, without the parser's state (_LIMITS): the limit it hit.
            line = self.matcher.get_error().splitlines()[0]
            reason = re.sub("^parser error: ", "", line, flags=re.I)
            raise ValidationError(
                self.field,
                f"the grammar's parser gave up after {self.num_tokens} tokens ({reason}); "
                "simplify it",
            )
        if seconds > self.time_limit:
            if self.cpu_timed:
                raise self._too_slow(seconds)
            self.cpu_timed = True

    def _too_slow(self, seconds: float) -> ValidationError:
        return ValidationError(
            self.field,
            f"the grammar took {seconds:.2f} s over one token after {self.num_tokens} "
            f"tokens, past the limit of {self.time_limit:g} s a token; simplify it",
        )


def start_filling(masks: Sequence[tuple[int, TokenMask]], rows: int, vocab_size: int) -> MaskFill:
    """Token masks as an int32 [rows, ceil(vocab_size / 32)] of all ones but row `row` of
    each (row, mask), which the mask fills. The grammar masks (those with a matcher: each a
    GrammarMask) fill together on llguidance's threads (those marked to fill alone, each
    alone: _MaskFiller), beside the caller, which goes on at once; any other mask is filled
    here, in turn."""
    fill = MaskFill(np.full((rows, -(-vocab_size // 32)), -1, dtype=np.int32))
    together, alone = [], []  # (matcher, row), (mask, row)
    try:
        for row, mask in masks:
            if mask.matcher is None:
                mask.fill_next(fill.allowed[row])
                continue
            fill.grammars.append((mask, row))
            if mask.fill_alone:
                alone.append((mask, row))
            else:
                together.append((mask.matcher, row))
    except Exception as exc:  # a fault of one step's masks, the caller's to report
        fill.error = exc
        return fill
    if fill.grammars:
        _mask_filler().start(fill, together, alone)
    return fill


@dataclass
class MaskFill:
    """A step's token masks, filled or filling."""

    allowed: np.ndarray
    grammars: list[tuple[GrammarMask, int]] = field(default_factory=list)  # (mask, its row)
    # Those it filled alone, their CPU time read.
    timed: list[tuple[GrammarMask, int]] = field(default_factory=list)
    error: Exception | None = None  # what a fill raised
    # Held while the masks fill: the filling thread releases it when they are done.
    filling: threading.Lock | None = None

    def result(self) -> np.ndarray:
        """The masks, once filled; or what a fill raised."""
        if self.filling is not None:
            self.filling.acquire()
            self.filling = None
        if self.error is not None:
            raise self.error
        return self.allowed

    def failures(self) -> dict[int, ValidationError]:
        """By row, the grammar masks that took longer than their time limit in this fill
        (their requests' fault, GrammarMask.fill_failure). Once, after result()."""
        failed = ((row, mask.fill_failure()) for mask, row in self.timed)
        return {row: error for row, error in failed if error is not None}


class _MaskFiller:
    """A thread that hands llguidance's parallel fills their arrays, so that the engine
    thread makes events and plans the next step while they fill.

    llguidance fills without the interpreter lock, but a thread needs the lock to begin
    and to end: one that asks for it while another runs Python gets it only after the
    switch interval (5 ms), far later than a fill takes. So the caller waits, lock
    released, until the fill has begun; the thread does nothing between that signal and
    the fill, and after it only releases the lock the caller waits on for the masks."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._began = threading.Lock()  # held but while a fill begins: the thread releases it
        self._began.acquire()
        self._executor = llguidance.LLExecutor()  # threads: 80% of the CPUs, up to 32
        threading.Thread(target=self._run, name="token-masks", daemon=True).start()

    def start(self, fill: MaskFill, together: list, alone: list) -> None:
        """Begin filling the grammars' rows of fill.allowed: `together`'s matchers on
        llguidance's threads, then `alone`'s masks each alone."""
        fill.filling = threading.Lock()
        fill.filling.acquire()
        allowed = fill.allowed
        where = (allowed.ctypes.data, allowed.strides[0], len(allowed))
        self._jobs.put((fill, together, alone, *where))
        self._began.acquire()

    def _run(self) -> None:
        while True:
            fill, *work = self._jobs.get()
            self._began.release()
            try:
                self._fill(fill, *work)
            except Exception as exc:
                fill.error = exc
            fill.filling.release()

    def _fill(
        self, fill: MaskFill, together: list, alone: list, base: int, stride: int, rows: int
    ) -> None:
        """Timing a fill on llguidance's threads tells only that one of its masks is slow
        (or the machine busy), and a position's mask, once computed, is kept: so where it
        overran the time limit, its masks are marked to fill alone the next time, on this
        thread, their CPU time read."""
        if together:
            started = time.perf_counter()
            self._executor.unsafe_compute_mask_ptr(together, base, stride, rows)
            if time.perf_counter() - started > fill.grammars[0][0].time_limit:  # one limit
                for mask, _ in fill.grammars:
                    mask.fill_alone = True
        for mask, row in alone:
            if not 0 <= row < rows:  # the executor checks its own
                raise ValueError(f"row {row} is out of bounds of {rows} rows")
            started = time.thread_time()
            mask.matcher.unsafe_compute_mask_ptr(base + row * stride, stride)
            mask.fill_seconds = time.thread_time() - started
            mask.fill_alone = False
            fill.timed.append((mask, row))


@functools.cache
def _mask_filler() -> _MaskFiller:
    return _MaskFiller()


# A forked child has none of its parent's threads: it starts its own at its first fill.
os.register_at_fork(after_in_child=_mask_filler.cache_clear)
