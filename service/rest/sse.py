"""Answering over a connection the caller may leave: OpenAI's server-sent events, a call's
work cut short when its client disconnects or the server stops, and the events of a
call's several requests merged as they come."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Coroutine
from enum import Enum
from typing import Any, TypeVar

from fastapi.responses import Response, StreamingResponse

from engine.outputs import CandidateEvent
from engine.serving.request_stream import RequestStream
from service.rest.errors import closing_error

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A StreamingResponse that stops the moment its client disconnects, whether or not it
    was writing (a request still waiting for its first token writes nothing), and always
    closes its body iterator, so the engine requests are cancelled at once, not at GC time.
    When the server closes it first, its last event is the 503 that says so, then [DONE]."""

    def __init__(self, content: AsyncIterator[str], closing: asyncio.Event, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.closing = closing

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def send_noting_start(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            streamed = self.stream_response(send_noting_start)
            ended = await unless_interrupted(streamed, receive, self.closing)
        finally:
            await self.body_iterator.aclose()
        if ended is Interrupted.CLOSING and started:
            last = sse_data(closing_error().body()) + DONE
            await send({"type": "http.response.body", "body": last.encode(), "more_body": False})
        elif ended is Interrupted.CLOSING:
            await closing_error().response()(scope, receive, send)


def sse_data(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class Interrupted(Enum):
    """Why a call's work stopped before its end."""

    LEFT = "left"  # the client disconnected
    CLOSING = "closing"  # the server is stopping


async def unless_interrupted(
    work: Coroutine[Any, Any, T], receive, closing: asyncio.Event
) -> T | Interrupted:
    """work's result; or, if the client disconnects or the server closes first, why, once
    work is cancelled. The request's body was read already: what comes next from receive
    is the disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    left = asyncio.ensure_future(disconnected())
    closed = asyncio.ensure_future(closing.wait())
    try:
        await asyncio.wait((task, left, closed), return_when=asyncio.FIRST_COMPLETED)
    finally:
        left.cancel()
        closed.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if not task.cancelled():
        return task.result()
    return Interrupted.CLOSING if closing.is_set() else Interrupted.LEFT


def interrupted_response(why: Interrupted) -> Response:
    """The answer to a call cut short: none for a client who left (499, logged only), 503
    when the server is stopping."""
    return Response(status_code=499) if why is Interrupted.LEFT else closing_error().response()


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, CandidateEvent]]:
    """(prompt index, event) from every stream as they come; leaving early cancels them all.
    The hand-over queue is bounded: a consumer that stops reading stops the pumps too, so
    each stream's own mailbox fills and cancels its request (a slow reader fails alone)."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, CandidateEvent | Exception | None]] = asyncio.Queue(
        maxsize=len(streams)
    )

    async def pump(i: int, stream: RequestStream) -> None:
        end: Exception | None = None
        try:
            async for event in stream:
                await queue.put((i, event))
        except Exception as exc:
            end = exc
        await queue.put((i, end))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()  # each stream's own cleanup cancels its engine request
