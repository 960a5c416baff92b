"""AsyncEngine: LLMEngine on its own thread, driven from asyncio.

The engine thread owns every piece of engine state. asyncio callers talk to it
through one bounded inbox (submit, cancel) and get events back through a per-request
RequestStream that the thread fills with loop.call_soon_threadsafe. A full inbox is
refused at once (EngineOverloaded), so a burst can never grow memory without bound.
Load and counters go the other way as an immutable EngineStats that the thread publishes
by swapping one reference (`AsyncEngine.stats`), so readers need no lock.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engine.engine import LLMEngine
from engine.errors import EngineError
from engine.outputs import CandidateEvent, FinishReason
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

log = logging.getLogger(__name__)


class EngineOverloaded(EngineError):
    """The bounded request queue is full; retry later."""


class EngineStopped(EngineError):
    """The engine is shutting down or its loop has died."""


class StreamOverflow(EngineError):
    """A consumer fell so far behind that a candidate's mailbox filled up."""


@dataclass
class RequestStream:
    """Events of one request, each candidate's in order; iteration ends when every candidate
    has finished.

    Each candidate has a bounded mailbox for its step events and a separate slot for its
    final event, so a full mailbox can never swallow how a candidate ended. A step event
    that finds its mailbox full means the consumer stopped keeping up: the request is
    cancelled and iteration raises StreamOverflow. Only this request pays; the engine never
    waits for a consumer. A consumer that stops iterating before the end (it left the loop,
    was cancelled, hit its deadline) cancels the request too.
    """

    request_id: str
    n: int
    mailbox_size: int = 256
    cancel: Callable[[], None] = lambda: None  # aborts the request in the engine
    _mailboxes: list[deque[CandidateEvent]] = field(default_factory=list)
    _finals: dict[int, CandidateEvent] = field(default_factory=dict)
    _done: set[int] = field(default_factory=set)
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    _overflowed: bool = False

    def __post_init__(self) -> None:
        self._mailboxes = [deque() for _ in range(self.n)]

    def _push(self, events: list[CandidateEvent]) -> None:
        for event in events:
            if event.finished:
                self._finals.setdefault(event.index, event)  # a late duplicate is ignored
            elif len(self._mailboxes[event.index]) < self.mailbox_size:
                self._mailboxes[event.index].append(event)
            elif not self._overflowed:
                self._overflowed = True
                self.cancel()
        self._wakeup.set()

    def _next_event(self) -> CandidateEvent | None:
        """The next event to hand out: a candidate's step events, then its final one."""
        if self._overflowed:  # checked before every event: what is left was never read
            raise StreamOverflow(
                f"request {self.request_id}: the consumer fell behind by "
                f"{self.mailbox_size} events; the request was cancelled"
            )
        for index, mailbox in enumerate(self._mailboxes):
            if mailbox:
                return mailbox.popleft()
            if index in self._finals and index not in self._done:
                self._done.add(index)
                return self._finals[index]
        return None

    def __aiter__(self) -> AsyncIterator[CandidateEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[CandidateEvent]:
        try:
            while len(self._done) < self.n:
                event = self._next_event()
                if event is None:
                    self._wakeup.clear()  # no await since the check: no push can be missed
                    await self._wakeup.wait()
                else:
                    yield event
        finally:
            if len(self._done) < self.n:
                self.cancel()  # idempotent: a finished or unknown request is left alone


@dataclass
class _Submit:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    stream: RequestStream
    admitted: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass
class _Cancel:
    request_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queued_requests: int = 1024, mailbox_size: int = 256):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.mailbox_size = mailbox_size
        # Unbounded so a cancel is never refused; submit() bounds the requests it lets in.
        self._inbox: queue.Queue[_Submit | _Cancel] = queue.Queue()
        self._streams: dict[str, tuple[RequestStream, asyncio.AbstractEventLoop]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.fatal_error: BaseException | None = None
        self.stats: EngineStats = engine.stats()  # replaced, never mutated, by the engine thread

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float | None = None) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.fatal_error is None

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> RequestStream:
        """Queue a request; returns once the engine accepted it (or raises its ValidationError)."""
        if self._stop.is_set() or self.fatal_error is not None:
            raise EngineStopped("the engine loop is stopped")
        loop = asyncio.get_running_loop()
        stream = RequestStream(
            request_id, params.n, self.mailbox_size, lambda: self.cancel(request_id)
        )
        if self.num_queued >= self.max_queued_requests:
            raise EngineOverloaded(
                f"request queue is full ({self.max_queued_requests} waiting); retry later"
            )
        admitted = loop.create_future()
        self._inbox.put(
            _Submit(request_id, prompt_token_ids, params, priority, stream, admitted, loop)
        )
        await admitted
        return stream

    @property
    def num_queued(self) -> int:
        """Requests accepted but not running yet: in the inbox (cancels counted too, which
        errs on the safe side) or admitted and waiting for the scheduler. The waiting count
        is the engine thread's last snapshot, republished after every inbox drain."""
        return self._inbox.qsize() + self.stats.num_waiting_requests

    def cancel(self, request_id: str) -> None:
        """Abort a request from any thread; its final events say CANCELLED. Idempotent."""
        self._inbox.put(_Cancel(request_id))  # never refused: a cancel only frees work

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> AsyncIterator[CandidateEvent]:
        """Submit and iterate; leaving the loop early (or being cancelled) aborts the request."""
        stream = await self.submit(request_id, prompt_token_ids, params, priority)
        async for event in stream:
            yield event

    # ---- the engine thread -------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished_requests)
                events = self.engine.step() if self.engine.has_unfinished_requests else []
                # Published before dispatch: who saw a step's events sees stats at least as new.
                self.stats = self.engine.stats()
                self._dispatch(events)
        except BaseException as exc:  # the loop died: fail everyone still waiting
            log.exception("engine loop died")
            self.fatal_error = exc
            self._fail_all(f"engine loop died: {type(exc).__name__}: {exc}")

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                self.stats = self.engine.stats()  # admitted requests now count as waiting
                return

    def _handle(self, item: _Submit | _Cancel) -> None:
        if isinstance(item, _Cancel):
            self._dispatch(self.engine.abort_request(item.request_id))
            return
        try:
            self.engine.add_request(
                item.request_id, item.prompt_token_ids, item.params, item.priority
            )
        except Exception as exc:
            _resolve(item.loop, item.admitted, exc)
            return
        self._streams[item.request_id] = (item.stream, item.loop)
        _resolve(item.loop, item.admitted, None)

    def _dispatch(self, events: list[CandidateEvent]) -> None:
        by_request: dict[str, list[CandidateEvent]] = {}
        for event in events:
            by_request.setdefault(event.request_id, []).append(event)
        for request_id, batch in by_request.items():
            entry = self._streams.get(request_id)
            if entry is None:
                continue
            stream, loop = entry
            if request_id not in self.engine.requests:
                del self._streams[request_id]
            _call_soon(loop, stream._push, batch)

    def _fail_all(self, error: str) -> None:
        for request_id, (stream, loop) in list(self._streams.items()):
            events = [
                CandidateEvent(request_id, i, "", [], finish_reason=FinishReason.ERROR, error=error)
                for i in range(stream.n)
            ]
            _call_soon(loop, stream._push, events)
        self._streams.clear()


def _resolve(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future, exc: BaseException | None
) -> None:
    def settle() -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    _call_soon(loop, settle)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed; nobody is listening
        pass
