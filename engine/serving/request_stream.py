"""RequestStream: one request's events on their way to its caller."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engine.errors import EngineError
from engine.outputs import CandidateEvent


class StreamOverflow(EngineError):
    """A consumer fell so far behind that a candidate's mailbox filled up."""


@dataclass
class RequestStream:
    """Events of one request, each candidate's in order; iteration ends when every candidate
    has finished.

    Each candidate has a bounded mailbox for its step events and a separate slot for its
    final event, so a full mailbox can never swallow how a candidate ended. Step events
    that piled up by the time the consumer asks come out merged into one delta, so a
    consumer that fell behind (a busy event loop) catches up in fewer stream writes. A step event
    that finds its mailbox full means the consumer stopped keeping up: the request is
    cancelled and iteration raises StreamOverflow. Only this request pays; the engine never
    waits for a consumer. A consumer that stops iterating before the end (it left the loop,
    was cancelled, hit its deadline) cancels the request too, as does cancel(), which a front
    door calls the moment its caller is gone, wherever its handler is.
    """

    request_id: str
    n: int
    mailbox_size: int = 256
    # Aborts this request (and no later one with its id) in the engine, counted under a door.
    abort: Callable[[str], None] = lambda door: None
    door: str = "api"  # the front door the request came in by: its callers' aborts count here
    _mailboxes: list[deque[CandidateEvent]] = field(default_factory=list)
    _finals: dict[int, CandidateEvent] = field(default_factory=dict)
    _done: set[int] = field(default_factory=set)
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    _overflowed: bool = False

    def __post_init__(self) -> None:
        self._mailboxes = [deque() for _ in range(self.n)]

    def push(self, events: list[CandidateEvent]) -> None:
        """Take the engine's next events for this request: a step event into its
        candidate's mailbox, a final one into its slot. Call it on the event loop that
        iterates the stream."""
        for event in events:
            if event.finished:
                self._finals.setdefault(event.index, event)  # a late duplicate is ignored
            elif len(self._mailboxes[event.index]) < self.mailbox_size:
                self._mailboxes[event.index].append(event)
            elif not self._overflowed:
                self._overflowed = True
                self.abort("slow_reader")
        self._wakeup.set()

    def cancel(self) -> None:
        """The consumer is gone: abort the request unless every candidate has ended.
        Idempotent; the engine ignores the abort of a request that ended meanwhile."""
        if len(self._done) < self.n:
            self.abort(self.door)

    def _next_event(self) -> CandidateEvent | None:
        """The next event to hand out: a candidate's step events, then its final one."""
        if self._overflowed:  # checked before every event: what is left was never read
            raise StreamOverflow(
                f"request {self.request_id}: the consumer fell behind by "
                f"{self.mailbox_size} events; the request was cancelled"
            )
        for index, mailbox in enumerate(self._mailboxes):
            if len(mailbox) > 1:
                events = list(mailbox)
                mailbox.clear()
                return CandidateEvent.merge(events)
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
            self.cancel()
