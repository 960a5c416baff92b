"""Constraints (engine/constraints.py) as token masks, with llguidance.

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
(GrammarMask, a TokenMask of engine/request.py) that fills the candidate's row of the
step's bitmask and advances on each sampled token. JSON is generated compactly (one space
after ',' and ':', no free whitespace), which keeps a small model from filling max_tokens
with blank lines.

llguidance rather than xgrammar (0.2.9): xgrammar's rule for a string with a maxLength
admits raw control characters, which no JSON parser takes; llguidance needs no
transformers, builds a grammar in about a millisecond and fills a mask in microseconds.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import queue
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

from engine.constraints import Constraint
from engine.errors import EngineOverloaded, ValidationError
from engine.request import TokenMask
from engine.stats import GRAMMAR_BUILD_SECONDS_BOUNDS, GrammarStats
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Compact JSON, the way models are trained to write it.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        time_limit: float = 10.0,
        cache_size: int = 256,
        threads: int = 2,
    ):
        """vocab_size: the model's, the width of its logits (may exceed the tokenizer's)."""
        self.time_limit = time_limit
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(stop_token_ids)
        )
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the cache and stats change on several threads
        self._stats = GrammarStats()  # replaced, never changed: a reader needs no lock

    def start(self, constraint: Constraint) -> PendingGrammar:
        """Compile on the pool."""
        pending = PendingGrammar(constraint, self.time_limit)
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

    def masks(self, start: llguidance.LLMatcher) -> Callable[[], TokenMask]:
        """Makes one candidate's mask each call, from a compiled constraint."""
        return lambda: GrammarMask(start.deep_copy())

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
            matcher = llguidance.LLMatcher(self._tokenizer, _grammar(constraint), log_level=0)
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


class GrammarMask:
    """One candidate's place in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def fill_next(self, bitmask: np.ndarray) -> None:
        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask[None], 0)

    def forced(self) -> list[int]:
        # llguidance's fast-forward tokens: empty unless the next token is the only one
        # allowed, and then each the only one allowed after those before it.
        return self.matcher.compute_ff_tokens()

    def accept(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            log.warning(
                "token %d is outside its constraint: %s", token_id, self.matcher.get_error()
            )


def start_filling(masks: Sequence[tuple[int, TokenMask]], rows: int, vocab_size: int) -> MaskFill:
    """Token masks as an int32 [rows, ceil(vocab_size / 32)] of all ones but row `row` of
    each (row, mask), which the mask fills. The grammar masks fill together on llguidance's
    threads, beside the caller, which goes on at once; any other mask is filled here, in
    turn."""
    fill = MaskFill(np.full((rows, -(-vocab_size // 32)), -1, dtype=np.int32))
    grammars = []
    try:
        for row, mask in masks:
            if isinstance(mask, GrammarMask):
                grammars.append((mask.matcher, row))
            else:
                mask.fill_next(fill.allowed[row])
    except Exception as exc:  # a fault of one step's masks, the caller's to report
        fill.error = exc
        return fill
    if grammars:
        _mask_filler().start(fill, grammars)
    return fill


@dataclass
class MaskFill:
    """A step's token masks, filled or filling."""

    allowed: np.ndarray
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

    def start(self, fill: MaskFill, grammars: list) -> None:
        """Begin filling the grammars' rows of fill.allowed."""
        fill.filling = threading.Lock()
        fill.filling.acquire()
        allowed = fill.allowed
        self._jobs.put((fill, grammars, allowed.ctypes.data, allowed.strides[0], len(allowed)))
        self._began.acquire()

    def _run(self) -> None:
        compute = self._executor.unsafe_compute_mask_ptr
        while True:
            fill, grammars, *where = self._jobs.get()
            self._began.release()
            try:
                compute(grammars, *where)
            except Exception as exc:
                fill.error = exc
            fill.filling.release()


@functools.cache
def _mask_filler() -> _MaskFiller:
    return _MaskFiller()


# A forked child has none of its parent's threads: it starts its own at its first fill.
os.register_at_fork(after_in_child=_mask_filler.cache_clear)
