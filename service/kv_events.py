"""The prefix cache's KV events (engine/kv/events.py), out to the routers that follow them.

Two roads, one numbering. `KvEventHub.publish` takes each batch the engine loop reports
(on the engine's thread, or the thread receiving from its process), numbers it (1, 2, ...)
and hands it to:

- the ZMQ publisher, where `kv_events_endpoint` is set: multipart messages
  [topic, sequence number as 8 bytes big-endian, msgpack payload], the payload
  [timestamp, events, data-parallel rank (None)] with each event a positional array tagged
  by its name, the layout vLLM's publisher sends and llm-d's KV-cache indexer reads:
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium],
  ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"];
- every open subscription (the gateway's SubscribeKvEvents streams), which can resume
  from a sequence number while the hub still holds the batches after it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from engine.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent

log = logging.getLogger(__name__)

HISTORY_BATCHES = 4096  # the batches kept for a subscriber that resumes
# ... and at most this many token ids in them (what takes their memory: a step that stores
# a 16k-token prefill's blocks carries its 16k ids), so a long prompt stream holds ~100 MB.
HISTORY_TOKENS = 1 << 20
SUBSCRIBER_BACKLOG = 4096  # batches a subscription may have unread before it is cut off


@dataclass(frozen=True)
class KvEventBatch:
    sequence_number: int
    timestamp: float  # time.time() when published
    events: tuple[KvEvent, ...]


class ResumeTooOld(Exception):
    """The batches after the sequence number asked for are no longer held."""


class SubscriberFellBehind(Exception):
    """A subscription left more than SUBSCRIBER_BACKLOG batches unread: some are lost."""


class KvEventHub:
    """Set `topic` (the ZMQ messages' first frame) before the first batch: it names the
    model, which is known once it has loaded, while the socket is taken at start."""

    def __init__(self, zmq_endpoint: str | None = None) -> None:
        self.topic = ""
        self._lock = threading.Lock()
        self._last_sequence = 0
        self._history: deque[tuple[KvEventBatch, int]] = deque()  # each with its token count
        self._history_tokens = 0
        self._subscriptions: set[KvEventSubscription] = set()
        self._zmq = ZmqPublisher(zmq_endpoint) if zmq_endpoint else None

    def publish(self, events: list[KvEvent]) -> None:
        """Number `events` as one batch and send it on; any thread."""
        if not events:
            return
        with self._lock:
            self._last_sequence += 1
            batch = KvEventBatch(self._last_sequence, time.time(), tuple(events))
            self._remember(batch)
            subscriptions = list(self._subscriptions)
        if self._zmq is not None:
            self._zmq.send(self.topic, batch)
        for subscription in subscriptions:
            subscription.offer(batch)

    def subscribe(self, after: int = 0) -> KvEventSubscription:
        """A subscription to the batches numbered above `after`; 0: from the next one on.
        Call it on the event loop that will read it. ResumeTooOld where the hub no longer
        holds the batch after `after`, or never published `after` (the reader followed an
        earlier process: this one's cache began empty)."""
        subscription = KvEventSubscription(self, asyncio.get_running_loop())
        with self._lock:
            if after > self._last_sequence:
                raise ResumeTooOld(f"batch {after} was never published here")
            if after:  # the history is numbered without gaps, up to the last batch
                oldest = self._history[0][0].sequence_number
                if oldest > after + 1:
                    raise ResumeTooOld(f"batches after {after} are gone (held from {oldest} on)")
                for batch, _ in itertools.islice(self._history, after + 1 - oldest, None):
                    subscription.offer(batch)
            self._subscriptions.add(subscription)
        return subscription

    def _remember(self, batch: KvEventBatch) -> None:
        """Keep batch for resuming readers, forgetting the oldest beyond the bounds (the
        last batch is always kept). Under the lock."""
        tokens = sum(len(e.token_ids) for e in batch.events if isinstance(e, BlockStored))
        self._history.append((batch, tokens))
        self._history_tokens += tokens
        while len(self._history) > 1 and (
            len(self._history) > HISTORY_BATCHES or self._history_tokens > HISTORY_TOKENS
        ):
            self._history_tokens -= self._history.popleft()[1]

    def unsubscribe(self, subscription: KvEventSubscription) -> None:
        with self._lock:
            self._subscriptions.discard(subscription)

    def close(self) -> None:
        if self._zmq is not None:
            self._zmq.close()


class KvEventSubscription:
    """One reader's batches, in order; iterate it on its event loop. It raises
    SubscriberFellBehind once its reader is SUBSCRIBER_BACKLOG batches behind."""

    def __init__(self, hub: KvEventHub, loop: asyncio.AbstractEventLoop) -> None:
        self._hub, self._loop = hub, loop
        self._batches: asyncio.Queue[KvEventBatch | None] = asyncio.Queue()
        self._lost = False

    def offer(self, batch: KvEventBatch) -> None:
        """From any thread."""
        self._loop.call_soon_threadsafe(self._put, batch)

    def _put(self, batch: KvEventBatch) -> None:
        if self._lost:
            return
        if self._batches.qsize() >= SUBSCRIBER_BACKLOG:
            self._lost = True
            batch = None  # the reader learns of the loss when it gets here
        self._batches.put_nowait(batch)

    async def __aiter__(self) -> AsyncIterator[KvEventBatch]:
        try:
            while True:
                batch = await self._batches.get()
                if batch is None:
                    raise SubscriberFellBehind(
                        f"the reader fell {SUBSCRIBER_BACKLOG} batches behind; resubscribe"
                    )
                yield batch
        finally:
            self._hub.unsubscribe(self)


def zmq_payload(batch: KvEventBatch) -> bytes:
    """The batch as vLLM's KV-event publisher encodes it (positional arrays)."""
    events = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            events.append(
                [
                    "BlockStored",
                    list(event.block_hashes),
                    event.parent_block_hash,
                    list(event.token_ids),
                    event.block_size,
                    None,  # lora_id
                    None,  # medium: the reader's default tier, the engine's own memory
                ]
            )
        elif isinstance(event, BlockRemoved):
            events.append(["BlockRemoved", list(event.block_hashes), None])
        else:
            assert isinstance(event, AllBlocksCleared)
            events.append(["AllBlocksCleared"])
    return msgspec.msgpack.encode([batch.timestamp, events, None])


def binds(endpoint: str) -> bool:
    """Whether the publisher binds `endpoint` (a wildcard or local address: subscribers
    come to it) or connects to it (a subscriber that binds, such as a central picker)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """A PUB socket on a thread of its own (a socket is not to be shared between threads):
    batches queue to it and go out in order; a subscriber that is slow or absent loses
    messages, as PUB sockets do, and the numbering tells it."""

    def __init__(self, endpoint: str) -> None:
        import zmq  # only where the events are published

        self._queue: queue.SimpleQueue[tuple[str, KvEventBatch] | None] = queue.SimpleQueue()
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        if binds(endpoint):
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def send(self, topic: str, batch: KvEventBatch) -> None:
        self._queue.put((topic, batch))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                topic, batch = item
                sequence = batch.sequence_number.to_bytes(8, "big")
                self._socket.send_multipart([topic.encode(), sequence, zmq_payload(batch)])
        except Exception:  # the events stop; serving goes on
            log.exception("KV events: the ZMQ publisher stopped")
        finally:
            self._socket.close()
