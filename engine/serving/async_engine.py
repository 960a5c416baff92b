"""AsyncEngine: LLMEngine's loop, driven from asyncio.

The loop (run_engine_loop) owns all engine state, on a thread of this process
(EngineThread) or in a child process (engine/serving/engine_process.py). Callers put Submit and
Cancel into its inbox and read a RequestStream per request; a submit beyond
max_queued_requests is refused at once (EngineOverloaded), so a burst cannot grow memory
without bound. Each LoopOutput (one per take of the inbox and per step) is handed out by
AsyncEngine.deliver on the core's thread: admissions settle submit() futures, events go
to their streams through call_soon_threadsafe, and the immutable EngineStats is published
by swapping one reference, so readers need no lock.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

from engine.core.engine import LLMEngine
from engine.core.warmup import warm_up
from engine.errors import EngineError, EngineOverloaded, ModelLoadError, ValidationError
from engine.kv.events import KvEvent
from engine.outputs import CandidateEvent, FinishReason
from engine.sampling_params import SamplingParams, validate_request
from engine.serving.request_stream import RequestStream
from engine.stats import EngineInfo, EngineStats
from engine.structured.grammar import PendingGrammar
from engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# How long an idle loop waits on a compiling constraint before it looks at its inbox again.
_COMPILE_POLL_SECONDS = 0.01


class EngineStopped(EngineError):
    """The engine is shutting down or its loop has died."""


# ---- what crosses between AsyncEngine and the loop (plain values: they may be pickled) ----


@dataclass
class Submit:
    ticket: int  # AsyncEngine's handle on the waiting submit(); request ids may repeat
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int


@dataclass
class Cancel:
    request_id: str
    door: str  # who asked: aborts are counted by door and stage (EngineStats.aborts)
    # Only the request Submit(ticket) admitted, not a later one that reuses its id; if that
    # Submit is in the same take of the inbox, it is never admitted. None: whatever has the id.
    ticket: int | None = None


@dataclass
class Stop:
    """Ends the loop; items queued behind it are dropped."""


@dataclass
class LoopOutput:
    """What one take of the inbox or one step produced."""

    admissions: list[tuple[int, EngineError | None]]  # (ticket, why it was refused)
    events: list[CandidateEvent]
    finished: set[str]  # request ids these events ended
    stats: EngineStats
    kv_events: list[KvEvent] = field(default_factory=list)  # the prefix cache's, since the last


@dataclass
class Failed:
    error: str  # why the engine could not start, or why its loop died


def run_engine_loop(
    engine: LLMEngine,
    take: Callable[[bool], list[Submit | Cancel | Stop]],
    deliver: Callable[[LoopOutput], None],
) -> None:
    """Take the inbox, step, report; until a Stop. take(block) returns the items waiting
    (block: wait a while for the first, there being nothing else to do). A cancel that
    arrives during step t takes its request out before step t + 1."""
    tickets: dict[str, int] = {}  # live request id -> the ticket of the Submit that admitted it
    compiling: dict[int, tuple[Submit, PendingGrammar]] = {}  # by ticket

    # The grammar counts last reported: a build ends on a thread of its own, maybe after its
    # caller heard, so an idle loop reports when they change.
    reported_grammar = None

    def report(admissions: list[tuple[int, EngineError | None]], events: list) -> None:
        nonlocal reported_grammar
        finished = {e.request_id for e in events if e.request_id not in engine.requests}
        for request_id in finished:
            tickets.pop(request_id, None)
        stats = engine.stats()
        reported_grammar = stats.grammar
        kv_events = engine.block_manager.take_events()
        deliver(LoopOutput(admissions, events, finished, stats, kv_events))

    while True:
        engine.check_ranks()  # a lost rank ends the loop even while it idles
        items = take(not engine.has_unfinished_requests and not compiling)
        admissions, events = [], []
        withdrawn = {i.ticket: i for i in items if isinstance(i, Cancel) and i.ticket is not None}
        for item in items:
            if isinstance(item, Stop):
                return
            if isinstance(item, Submit) and item.ticket in withdrawn:
                engine.aborts[withdrawn[item.ticket].door, "inbox"] += 1
                admissions.append((item.ticket, EngineError("cancelled before admission")))
            elif isinstance(item, Submit) and item.params.constraint is not None:
                compiling[item.ticket] = (item, engine.grammars.start(item.params.constraint))
            elif isinstance(item, Submit):
                admissions.append((item.ticket, _admit(engine, item, tickets)))
            else:
                for ticket, (submit, grammar) in list(compiling.items()):
                    if submit.request_id == item.request_id and item.ticket in (None, ticket):
                        del compiling[ticket]
                        grammar.cancel()
                        engine.aborts[item.door, "compiling"] += 1
                        admissions.append((ticket, EngineError("cancelled before admission")))
                if item.ticket is None or tickets.get(item.request_id) == item.ticket:
                    events += engine.abort_request(item.request_id, item.door)
        # A Submit is admitted once its constraint is compiled, refused once it cannot be.
        for ticket, (submit, grammar) in list(compiling.items()):
            if grammar.settled:
                del compiling[ticket]
                admissions.append((ticket, _admit(engine, submit, tickets, grammar)))
        # Reported before the step: a refused submit hears at once, and admitted
        # requests count as waiting while the step runs.
        if items or admissions or engine.grammars.stats() is not reported_grammar:
            report(admissions, events)
        if engine.has_unfinished_requests:
            report([], engine.step())
        elif compiling:  # nothing to step: wait for a compile, not in a busy loop
            futures.wait([g.future for _, g in compiling.values()], timeout=_COMPILE_POLL_SECONDS)


def _admit(
    engine: LLMEngine, item: Submit, tickets: dict[str, int], grammar: PendingGrammar | None = None
) -> EngineError | None:
    """Add the Submit's request to the engine (under its compiled constraint's masks); the
    error that refused it, or None."""
    try:
        token_mask = (
            engine.grammars.masks(grammar.constraint, grammar.matcher()) if grammar else None
        )
        engine.add_request(
            item.request_id, item.prompt_token_ids, item.params, item.priority, token_mask
        )
    except (ValidationError, EngineOverloaded) as exc:
        return exc
    except Exception as exc:  # as a plain EngineError, which pickles whatever it wrapped
        return EngineError(f"{type(exc).__name__}: {exc}")
    tickets[item.request_id] = item.ticket
    return None


def run_core(
    build: Callable[[], LLMEngine],
    warmup: bool,
    take: Callable[[bool], list[Submit | Cancel | Stop]],
    send: Callable[[EngineInfo | LoopOutput | Failed], None],
) -> bool:
    """An engine's life where its loop runs (there its kernels and torch's per-thread state
    such as the OpenMP pool must live): build it, warm it up, send its first stats and then
    its EngineInfo (it is ready), run the loop. A failure is sent as Failed; returns whether
    it ended by a Stop."""
    engine = None
    try:
        engine = build()
        if warmup:
            warm_up(engine)
        send(LoopOutput([], [], set(), engine.stats()))
        send(engine.info)
        run_engine_loop(engine, take, send)
        return True
    except BaseException as exc:
        log.exception("the engine failed to start, or its loop died")
        send(Failed(f"{type(exc).__name__}: {exc}"))
        return False
    finally:
        if engine is not None:
            engine.close()


class EngineCore:
    """Where the loop runs: _worker (a thread, or a child process) runs run_core over
    _inbox, and what it sends comes back to receive(). start() returns once the engine is
    ready and has delivered its first stats; `died` is called once if the loop ends other
    than by shutdown(). put() never blocks (AsyncEngine bounds what it lets in)."""

    name: str  # what errors call it
    info: EngineInfo
    tokenizer: Tokenizer
    _stopping = False  # set by shutdown(), after which the loop's end is no news

    def start(self, deliver: Callable[[LoopOutput], None], died: Callable[[str], None]) -> None:
        self._deliver, self._died = deliver, died
        self._started: Future[str | None] = Future()  # None, or why it did not start
        self._launch()
        if (error := self._started.result()) is not None:
            self.shutdown(5)
            raise ModelLoadError(f"the {self.name} failed to start: {error}")

    def _launch(self) -> None:
        self._worker.start()

    def receive(self, message: EngineInfo | LoopOutput | Failed) -> None:
        if isinstance(message, LoopOutput):
            self._deliver(message)
        elif isinstance(message, EngineInfo):  # the engine is ready
            self.info = message  # with the warm-up's time
            self._started.set_result(None)
        elif not self._started.done():
            self._started.set_result(message.error)
        elif not self._stopping:
            log.error("the %s died: %s", self.name, message.error)
            self._died(f"{self.name} died: {message.error}")

    def put(self, item: Submit | Cancel) -> None:
        self._inbox.put(item)

    def shutdown(self, timeout: float | None) -> None:
        self._stopping = True
        if self._worker.is_alive():
            self._inbox.put(Stop())
            self._worker.join(timeout)

    def is_alive(self) -> bool:
        return self._worker.is_alive()


class EngineThread(EngineCore):
    """The loop on a thread of this process, sharing its interpreter with the event loop."""

    name = "engine loop"

    def __init__(self, engine: LLMEngine, warmup: bool = True):
        self.engine = engine
        self.info = engine.info
        self.tokenizer = engine.tokenizer
        self._inbox = queue.Queue()
        args = (lambda: engine, warmup, partial(take_inbox, self._inbox), self.receive)
        self._worker = threading.Thread(target=run_core, args=args, name="engine-loop", daemon=True)


def take_inbox(inbox: queue.Queue, block: bool, timeout: float = 0.05) -> list:
    """Every item waiting in inbox; with block, waits up to timeout for the first."""
    items = []
    try:
        items.append(inbox.get(timeout=timeout) if block else inbox.get_nowait())
        while True:
            items.append(inbox.get_nowait())
    except queue.Empty:
        return items


# ---- the asyncio side --------------------------------------------------------------------


@dataclass
class _Caller:
    """A submit() on its event loop: waiting for admission (AsyncEngine._waiting, by ticket),
    then reading its stream (AsyncEngine._streams, by request id)."""

    stream: RequestStream
    admitted: asyncio.Future  # its result: None, or the error that refused the request

    def call_soon(self, fn: Callable, *args: object) -> None:
        try:
            self.admitted.get_loop().call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the caller's loop is closed; nobody is listening
            pass

    def hear(self, error: EngineError | None) -> None:
        if not self.admitted.done():  # the caller may have left already
            self.admitted.set_result(error)


class AsyncEngine:
    def __init__(self, core: EngineCore, max_queued_requests: int = 1024, mailbox_size: int = 256):
        self.core = core
        self.max_queued_requests = max_queued_requests
        self.mailbox_size = mailbox_size
        # Touched by submit() (the event loop) and by deliver() (the core's thread): dict
        # operations are atomic under the interpreter lock, and each key has one writer
        # at a time (submit adds, deliver moves and removes).
        self._waiting: dict[int, _Caller] = {}
        self._streams: dict[str, _Caller] = {}
        self._tickets = itertools.count()
        self._stopping = False
        self.fatal_error: str | None = None
        self.stats: EngineStats | None = None  # replaced, never mutated, by deliver()
        # Called with each step's KV events (engine/kv/events.py), on the thread that
        # delivers; None: they are dropped.
        self.kv_event_sink: Callable[[list[KvEvent]], None] | None = None
        self._last_progress = time.monotonic()  # the last LoopOutput, or work arriving idle

    @property
    def info(self) -> EngineInfo:
        return self.core.info

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    def start(self) -> None:
        self.core.start(self.deliver, self._died)

    def shutdown(self, timeout: float | None = None) -> None:
        self._stopping = True
        self.core.shutdown(timeout)
        self._died("the engine is shut down")  # nothing is left to answer what still waits

    @property
    def is_alive(self) -> bool:
        return self.core.is_alive() and self.fatal_error is None

    @property
    def has_work(self) -> bool:
        """Submits waiting for admission, or admitted requests not finished yet."""
        return bool(self._waiting or self._streams)

    @property
    def stalled_seconds(self) -> float:
        """How long work has been outstanding with no LoopOutput: about a step's time for a
        loop that steps, 0 for an idle one, growing for a stuck one (the watchdog's test)."""
        return time.monotonic() - self._last_progress if self.has_work else 0.0

    def is_running(self, request_id: str) -> bool:
        """Admitted and not finished yet."""
        return request_id in self._streams

    @property
    def num_queued(self) -> int:
        """Requests accepted but not running yet: submitted and not admitted, or admitted
        and waiting for the scheduler (the loop's last snapshot)."""
        waiting = self.stats.num_waiting_requests if self.stats else 0
        return len(self._waiting) + waiting

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        door: str = "api",
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it (or raises its ValidationError).
        door names the front door it came in by, under which its callers' aborts are counted.
        A caller cancelled while it waits takes the request back with it."""
        if self._stopping or self.fatal_error is not None:
            raise EngineStopped(self.fatal_error or "the engine loop is stopped")
        # Before anything is built from its sizes (n mailboxes, a copy for the engine's
        # process): an n of 10**9 is refused, not allocated. Admission checks again.
        vocab_size, max_model_len = self.info.vocab_size, self.info.max_model_len
        validate_request(params, priority, vocab_size, len(prompt_token_ids), max_model_len)
        if self.num_queued >= self.max_queued_requests:
            raise EngineOverloaded(
                f"request queue is full ({self.max_queued_requests} waiting); retry later"
            )
        ticket = next(self._tickets)

        def abort(by: str) -> None:
            self.core.put(Cancel(request_id, by, ticket))

        stream = RequestStream(request_id, params.n, self.mailbox_size, abort, door)
        admitted = asyncio.get_running_loop().create_future()
        if not self.has_work:  # an idle loop delivers nothing: the stall clock starts now
            self._last_progress = time.monotonic()
        self._waiting[ticket] = _Caller(stream, admitted)
        self.core.put(Submit(ticket, request_id, prompt_token_ids, params, priority))
        if self.fatal_error is not None and self._waiting.pop(ticket, None):
            raise EngineStopped(self.fatal_error)  # the loop died after the check above
        try:
            error = await admitted
        except asyncio.CancelledError:
            # The caller left before it heard back: the loop drops the Submit if it is still
            # in the inbox, or aborts what it admitted. Its stream is never handed out.
            stream.cancel()
            raise
        if error is not None:
            raise error
        return stream

    def cancel(self, request_id: str, door: str = "cancel_rpc") -> None:
        """Abort whatever request has this id, from any thread; its final events say
        CANCELLED. Idempotent. Counted under door."""
        self.core.put(Cancel(request_id, door))  # never refused: a cancel only frees work

    # ---- on the core's thread ------------------------------------------------------------

    def deliver(self, output: LoopOutput) -> None:
        # Published first: who saw a step's events sees stats at least as new.
        self.stats = output.stats
        self._last_progress = time.monotonic()
        if output.kv_events and self.kv_event_sink is not None:
            self.kv_event_sink(output.kv_events)
        for ticket, error in output.admissions:
            caller = self._waiting.pop(ticket)
            if error is None:
                self._streams[caller.stream.request_id] = caller
            caller.call_soon(caller.hear, error)
        by_request: dict[str, list[CandidateEvent]] = {}
        for event in output.events:
            by_request.setdefault(event.request_id, []).append(event)
        for request_id, batch in by_request.items():
            caller = self._streams.get(request_id)
            if caller is None:
                continue
            if request_id in output.finished:
                del self._streams[request_id]
            caller.call_soon(caller.stream.push, batch)

    def _died(self, error: str) -> None:
        """The loop is gone: every waiting submit and every open stream fails with error."""
        self.fatal_error = self.fatal_error or error
        for ticket in list(self._waiting):
            if caller := self._waiting.pop(ticket, None):  # unless its submit() took it back
                caller.call_soon(caller.hear, EngineStopped(error))
        for request_id, caller in list(self._streams.items()):
            events = [
                CandidateEvent(request_id, i, "", [], finish_reason=FinishReason.ERROR, error=error)
                for i in range(caller.stream.n)
            ]
            caller.call_soon(caller.stream.push, events)
        self._streams.clear()
