"""The prefix cache's KV events over ZMQ, read as a router reads them: `pagedserve serve`
with --kv-events-endpoint, a SUB socket written here from the published format
(multipart [topic, 8-byte big-endian sequence number, msgpack [ts, events, rank]], each
event a positional array tagged by its name), and requests over gRPC.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import msgspec
import pytest
import zmq
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2_grpc

from engine.kv.events import BlockStored
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service import kv_events
from tests.server_process import free_port, running_server

BLOCK_SIZE = 16
TOPIC = "kv@10.1.2.3:8000@smollm2"


class Follower:
    """A router's view of one pod's prefix cache, from its KV events."""

    def __init__(self, port: int) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.last_sequence: int | None = None
        self.batches: dict[int, list] = {}  # events by sequence number
        self.stored: list[list] = []  # every BlockStored, in order
        self.removed: set[int] = set()

    def read(self, seconds: float) -> int:
        """Take what arrives within `seconds`; the number of events."""
        count = 0
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if not self.socket.poll(int(left * 1000)):
                break
            topic, sequence, payload = self.socket.recv_multipart()
            assert topic.decode() == TOPIC
            number = int.from_bytes(sequence, "big")
            if self.last_sequence is not None:
                assert number == self.last_sequence + 1, "a batch was skipped"
            self.last_sequence = number
            timestamp, events, rank = msgspec.msgpack.decode(payload)
            assert abs(timestamp - time.time()) < 60 and rank is None
            self.batches[number] = events
            for event in events:
                count += 1
                if event[0] == "BlockStored":
                    self.stored.append(event)
                elif event[0] == "BlockRemoved":
                    self.removed.update(event[1])
                else:
                    assert event == ["AllBlocksCleared"], event
        return count


def prompt_ids(stub, text: str) -> list[int]:
    return list(stub.Tokenize(pb.TokenizeRequest(text=text)).token_ids)


def generate(stub, text: str) -> None:
    request = pb.GenerateRequest(
        text=text,
        sampling=pb.SamplingOptions(temperature=0),
        stopping=pb.StoppingOptions(max_tokens=2),
    )
    stub.Generate(request)


@pytest.fixture(scope="module")
def served(smollm2_gguf):
    port = free_port()
    args = ["--kv-events-endpoint", f"tcp://*:{port}", "--kv-events-topic", TOPIC]
    # A pool of 24 blocks: a few long prompts evict the first.
    args += ["--num-blocks", "24", "--block-size", str(BLOCK_SIZE), "--max-model-len", "256"]
    with running_server(smollm2_gguf, *args) as server:
        follower = Follower(port)
        with grpc.insecure_channel(server.target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            # A SUB socket hears only what is sent after it has joined: distinct prompts
            # until one's events arrive.
            for attempt in range(50):
                generate(stub, f"Warm up number {attempt}: " + "one two three " * 8)
                if follower.read(0.2):
                    break
            else:
                pytest.fail("no KV event reached the subscriber")
            yield stub, follower, server
        follower.socket.close()


def test_a_prompts_full_blocks_are_stored_with_their_tokens_and_chain(served):
    stub, follower, _ = served
    text = "The quick brown fox jumps over the lazy dog. " * 5
    ids = prompt_ids(stub, text)
    assert len(ids) >= 3 * BLOCK_SIZE
    follower.read(0.5)
    before = len(follower.stored)
    generate(stub, text)
    follower.read(1.0)
    stored = follower.stored[before:]
    assert stored, "no BlockStored for the prompt"
    hashes = [h for event in stored for h in event[1]]
    tokens = [t for event in stored for t in event[3]]
    full = len(ids) // BLOCK_SIZE * BLOCK_SIZE
    assert tokens[:full] == ids[:full]  # the prompt's full blocks, in order
    assert all(event[4] == BLOCK_SIZE for event in stored)
    assert all(len(event[3]) == BLOCK_SIZE * len(event[1]) for event in stored)
    assert stored[0][2] is None  # the first block has no parent
    for event, previous in zip(stored[1:], stored, strict=False):
        assert event[2] == previous[1][-1], "a block's parent is the one before it"
    assert len(set(hashes)) == len(hashes) and 0 not in hashes

    # Asked again, it is served from the cache: nothing new is stored.
    generate(stub, text)
    follower.read(0.5)
    assert follower.stored[before + len(stored) :] == []


def test_evicted_blocks_are_removed(served):
    stub, follower, _ = served
    text = "Eviction test: " + "alpha beta gamma delta " * 12
    follower.read(0.5)
    before = len(follower.stored)
    generate(stub, text)
    follower.read(1.0)
    mine = {h for event in follower.stored[before:] for h in event[1]}
    assert mine
    # Other long prompts need the pool's blocks: the oldest cached ones go first.
    for i in range(8):
        generate(stub, f"Filler {i}: " + f"word{i} " * 60)
        follower.read(0.3)
        if mine <= follower.removed:
            break
    assert mine <= follower.removed, "the evicted prompt's blocks were not all removed"


def as_zmq(event: common_pb2.KvCacheEvent) -> list:
    """A SubscribeKvEvents event in the ZMQ layout, to compare the two roads."""
    kind = event.WhichOneof("data")
    if kind == "stored":
        blocks = event.stored.blocks
        parent = (
            event.stored.parent_block_hash if event.stored.HasField("parent_block_hash") else None
        )
        tokens = [t for block in blocks for t in block.token_ids]
        return ["BlockStored", [b.block_hash for b in blocks], parent, tokens, blocks[0].block_size]
    if kind == "removed":
        return ["BlockRemoved", list(event.removed.block_hashes), None]
    return ["AllBlocksCleared"]


async def test_subscribe_kv_events_streams_the_same_batches_and_resumes(served):
    stub, follower, server = served
    async with grpc.aio.insecure_channel(server.target) as channel:
        worker = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
        stream = worker.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
        await stream.initial_metadata()  # subscribed from here on
        follower.read(0.3)
        first = follower.last_sequence + 1
        await asyncio.to_thread(generate, stub, "Subscribed: " + "one fish two fish " * 10)
        follower.read(1.0)
        last = follower.last_sequence
        assert last >= first, "the prompt stored no block"
        streamed = {}
        async for batch in stream:
            streamed[batch.sequence_number] = [as_zmq(e) for e in batch.events]
            if batch.sequence_number == last:
                break
        stream.cancel()
        # The same batches, numbered alike, as the ZMQ road sent them (less its defaults).
        sent = {n: [zmq_event[:5] for zmq_event in follower.batches[n]] for n in streamed}
        assert streamed == sent and set(streamed) == set(range(first, last + 1))

        # A subscriber that comes back resumes after the last batch it saw.
        resumed = worker.SubscribeKvEvents(
            common_pb2.SubscribeKvEventsRequest(start_sequence_number=first - 1)
        )
        again = [(await resumed.read()).sequence_number for _ in range(last - first + 1)]
        resumed.cancel()
        assert again == list(range(first, last + 1))

        # One from another process's numbering is told to start over.
        gone = worker.SubscribeKvEvents(
            common_pb2.SubscribeKvEventsRequest(start_sequence_number=last + 1000)
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await gone.read()
        assert error.value.code() == grpc.StatusCode.OUT_OF_RANGE


async def test_the_resume_history_is_bounded_by_the_tokens_it_holds(monkeypatch):
    """A long prompt stream's stored blocks carry every prompt token: the batches kept for
    readers that resume are cut by their tokens, not only by their count."""
    monkeypatch.setattr(kv_events, "HISTORY_TOKENS", 1000)
    hub = kv_events.KvEventHub()
    for n in range(10):  # 10 batches of 4 blocks of 64 tokens: 256 tokens each
        hashes = tuple(range(4 * n + 1, 4 * n + 5))
        hub.publish([BlockStored(hashes, None, tuple(range(256)), 64)])
    with pytest.raises(kv_events.ResumeTooOld, match=r"held from 8 on"):
        hub.subscribe(after=6)
    subscription = hub.subscribe(after=7)  # the last 3 batches (768 tokens) are held
    resumed = []
    async for batch in subscription:
        resumed.append(batch.sequence_number)
        if len(resumed) == 3:
            break
    hub.unsubscribe(subscription)
    assert resumed == [8, 9, 10]
