"""Slow consumers: a gRPC client and a REST SSE client that never read their streams.

What bounds the server's memory for such a stream is each candidate's mailbox
(`mailbox_size` step events), not CandidateEvent.merge (that only shortens the catch-up of
a writer that fell behind; it holds nothing back). The transport fills first: the client's
HTTP/2 window (gRPC; 2-4 MB with grpc's default client settings, measured) or the kernel's
socket buffers (REST), held by the client and the kernel rather than the server's heap. Then
the handler's write waits, the mailbox fills, and the request is cancelled in the engine:
it stops producing, its KV blocks go back, and the others' streams complete meanwhile.
Structural, not timed: the test counts tokens and mailbox depths, not seconds."""

from __future__ import annotations

import asyncio
import json
import socket

import grpc
import pytest

from engine.serving.request_stream import RequestStream
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.config import ServerConfig
from tests.reliability.test_abort_storm import consume
from tests.test_grpc_server import greedy, kv_back_to_zero, serving
from tests.tiny_models import write_tiny_model

MAILBOX = 64  # small, so it fills soon; 16 was so small that busy normal streams overflowed
N, MAX_TOKENS, LOGPROBS = 64, 1500, 20  # big messages: the transport fills in ~300 steps
BLOCKS = N * (MAX_TOKENS + 2) // 4 + 64
OTHERS, OTHER_TOKENS = 4, 60


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("slow-consumer-tiny")
    return write_tiny_model(directory, "llama", max_position_embeddings=2048)


@pytest.fixture
def deepest_mailbox(monkeypatch) -> list[int]:
    """[the most step events any candidate's mailbox ever held], updated as events arrive."""
    deepest = [0]
    push = RequestStream.push

    def recording(self, events):
        push(self, events)
        deepest[0] = max(deepest[0], *(len(m) for m in self._mailboxes))

    monkeypatch.setattr(RequestStream, "push", recording)
    return deepest


async def others_finish_while(stub, core, stuck_ids: set[str]) -> None:
    """OTHERS streams start once the stuck requests run, and all end normally with every
    token while a stuck request is still in the engine or its stream is still unread."""
    while not stuck_ids & set(core.requests):
        await asyncio.sleep(0.01)
    requests = [
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, i]), **greedy(OTHER_TOKENS))
        for i in range(OTHERS)
    ]
    for messages, error in await asyncio.gather(
        *(consume(stub.StreamGenerate(r)) for r in requests)
    ):
        assert error is None, error
        assert sum(len(m.token_ids) for m in messages) == OTHER_TOKENS


async def test_a_grpc_client_that_never_reads_costs_one_mailbox(tiny_model, deepest_mailbox):
    async with serving(tiny_model, mailbox_size=MAILBOX, num_blocks=BLOCKS) as (srv, core, engine):
        target = f"127.0.0.1:{srv.port}"
        # Default channel options: whatever window grpc's client grants, it never reads.
        async with grpc.aio.insecure_channel(target) as stuck_channel:
            async with grpc.aio.insecure_channel(target) as channel:
                request = pb.GenerateRequest(
                    request_id="stuck",
                    token_ids=pb.TokenIds(ids=[5]),
                    output=pb.OutputOptions(logprobs=LOGPROBS),
                    **greedy(MAX_TOKENS),
                )
                request.sampling.n = N
                stuck = inference_pb2_grpc.InferenceStub(stuck_channel).StreamGenerate(request)
                stub = inference_pb2_grpc.InferenceStub(channel)
                await others_finish_while(stub, core, {"stuck"})
                assert not stuck.done()
                # The stuck request gets cancelled, its stream still unread.
                await kv_back_to_zero(engine, timeout=60)
                assert "stuck" not in core.requests and not stuck.done()
                stuck_generated = core.num_generated_tokens - OTHERS * OTHER_TOKENS
            messages, error = await consume(stuck)  # what the transport held for it
    received = sum(len(m.token_ids) for m in messages)
    print(f"\nstuck gRPC stream: {stuck_generated} of {N * MAX_TOKENS} tokens generated, "
          f"{received} ({sum(m.ByteSize() for m in messages)} bytes) in the transport, "
          f"mailboxes at most {deepest_mailbox[0]} deep")  # fmt: skip
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert stuck_generated < N * MAX_TOKENS / 3  # cut off early, not run to its end
    assert deepest_mailbox[0] <= MAILBOX


@pytest.mark.parametrize("prompts", [1, 2])
async def test_a_rest_sse_client_that_never_reads_costs_one_mailbox(
    tiny_model, deepest_mailbox, prompts
):
    """prompts=2: a completion of several prompts merges their streams; the merge must not
    read ahead of its consumer (it once did, into an unbounded queue, and ran to the end)."""
    config = ServerConfig(grpc_port=0, http_port=0)
    async with serving(tiny_model, config, mailbox_size=MAILBOX, num_blocks=BLOCKS) as (
        srv,
        core,
        engine,
    ):
        body = json.dumps({
            "prompt": [[5], [6]][:prompts], "n": N // prompts, "logprobs": LOGPROBS,
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
        }).encode()  # fmt: skip
        # A small receive buffer, so the kernel holds little for the client that never reads.
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.setblocking(False)
        await asyncio.get_running_loop().sock_connect(stuck, ("127.0.0.1", srv.http_port))
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        stuck.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
                stub = inference_pb2_grpc.InferenceStub(channel)
                while not core.requests:
                    await asyncio.sleep(0.01)
                stuck_ids = set(core.requests)
                await others_finish_while(stub, core, stuck_ids)
            await kv_back_to_zero(engine)  # cancelled, the socket still open and unread
            assert not stuck_ids & set(core.requests)
            stuck_generated = core.num_generated_tokens - OTHERS * OTHER_TOKENS
        finally:
            stuck.close()
    print(f"\nstuck SSE stream ({prompts} prompts): {stuck_generated} of {N * MAX_TOKENS} "
          f"tokens generated, mailboxes at most {deepest_mailbox[0]} deep")  # fmt: skip
    assert stuck_generated < N * MAX_TOKENS / 3
    assert deepest_mailbox[0] <= MAILBOX
