"""`pagedserve serve` with the embedded default model, as a real process, driven only from
outside: generated stubs, the health service, reflection, and the metrics endpoint."""

from __future__ import annotations

import asyncio
import shlex
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from tests.server_process import ServerProcess, running_server

KV_USED = "pagedserve_kv_cache_blocks_used"


@pytest.fixture(scope="module")
def served(smollm2_gguf) -> ServerProcess:
    with running_server(smollm2_gguf, "--max-num-seqs", "64", ready_within=300) as server:
        yield server


def greedy(max_tokens: int, **sampling) -> dict:
    return dict(
        sampling=pb.SamplingOptions(temperature=0.0, **sampling),
        stopping=pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
    )


async def test_unary_and_stream_agree_token_for_token(served):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Name three colors.")])
    request = pb.GenerateRequest(chat=chat, **greedy(24))
    async with grpc.aio.insecure_channel(served.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        unary = (await stub.Generate(request)).candidates[0]
        ids, text, finals = [], "", []
        async for message in stub.StreamGenerate(request):
            ids += message.token_ids
            text += message.text
            if message.finish_reason:
                finals.append(message)
    assert ids == list(unary.token_ids) and len(ids) == 24
    assert text == unary.text and text.strip()
    assert len(finals) == 1 and finals[0].usage.completion_tokens == 24


async def test_n_3_returns_three_distinct_candidates(served):
    request = pb.GenerateRequest(
        text="Once upon a time",
        sampling=pb.SamplingOptions(n=3, temperature=1.0, seed=7),
        stopping=pb.StoppingOptions(max_tokens=12, ignore_eos=True),
    )
    async with grpc.aio.insecure_channel(served.target) as channel:
        response = await inference_pb2_grpc.InferenceStub(channel).Generate(request)
    assert sorted(c.index for c in response.candidates) == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in response.candidates)
    assert len({tuple(c.token_ids) for c in response.candidates}) > 1
    assert response.usage.completion_tokens == 36


async def test_64_concurrent_streams_complete_and_release_every_block(served):
    async def one(stub, i: int) -> int:
        request = pb.GenerateRequest(text=f"Request number {i} says", **greedy(8))
        return sum([len(m.token_ids) async for m in stub.StreamGenerate(request)])

    async with grpc.aio.insecure_channel(served.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        counts = await asyncio.gather(*(one(stub, i) for i in range(64)))
    assert counts == [8] * 64
    assert served.wait_for_metric(KV_USED, 0) == 0
    assert served.metrics()['pagedserve_requests_total{code="OK",rpc="StreamGenerate"}'] >= 64


async def _first_message_then(served, action: str) -> grpc.StatusCode:
    """Start a long stream, do `action` after its first message, return how it ended."""
    async with grpc.aio.insecure_channel(served.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request_id = f"door-{action}"
        request = pb.GenerateRequest(request_id=request_id, text="Count: 1, 2,", **greedy(1000))
        call = stub.StreamGenerate(request, timeout=0.2 if action == "deadline" else None)
        try:
            await call.read()
            assert served.metrics()[KV_USED] > 0
            if action == "cancel-rpc":
                assert (await stub.Cancel(pb.CancelRequest(request_id=request_id))).cancelled
            elif action == "disconnect":
                call.cancel()
            last = None
            while (message := await call.read()) is not grpc.aio.EOF:
                last = message
            if action == "cancel-rpc":
                assert last.finish_reason == pb.FINISH_REASON_CANCELLED
            return await call.code()
        except grpc.aio.AioRpcError as err:
            return err.code()
        except asyncio.CancelledError:
            return grpc.StatusCode.CANCELLED


@pytest.mark.parametrize(
    "action,code",
    [
        ("cancel-rpc", grpc.StatusCode.OK),
        ("disconnect", grpc.StatusCode.CANCELLED),
        ("deadline", grpc.StatusCode.DEADLINE_EXCEEDED),
    ],
)
async def test_each_cancellation_door_frees_the_blocks(served, action, code):
    assert await _first_message_then(served, action) == code
    assert served.wait_for_metric(KV_USED, 0) == 0


async def test_metrics_count_requests_tokens_and_latencies(served):
    before = served.settled_metrics(
        ("pagedserve_generation_tokens_total", "pagedserve_e2e_request_latency_seconds_count")
    )
    async with grpc.aio.insecure_channel(served.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await stub.Generate(pb.GenerateRequest(text="The sky is", **greedy(5)))
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Generate(pb.GenerateRequest(text="x", sampling=pb.SamplingOptions(n=0)))
    # An aborted RPC's status can reach the client before the server's handler has
    # counted it: wait for the count rather than race it.
    refused = 'pagedserve_requests_total{code="INVALID_ARGUMENT",rpc="Generate"}'
    served.wait_for_metric(refused, before.get(refused, 0) + 1)
    after = served.metrics()

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert grew('pagedserve_requests_total{code="OK",rpc="Generate"}') == 1
    assert grew(refused) == 1
    assert grew("pagedserve_generation_tokens_total") == 5
    assert grew("pagedserve_time_to_first_token_seconds_count") == 1
    assert grew("pagedserve_time_per_output_token_seconds_count") == 1
    assert grew("pagedserve_e2e_request_latency_seconds_count") == 1
    assert grew("pagedserve_queue_time_seconds_count") == 1
    assert after["pagedserve_num_requests_running"] == 0
    assert after["pagedserve_kv_cache_blocks_total"] > 0


# ---- the grpcurl calls of clients/README.md ------------------------------------------------


def grpcurl_calls() -> list[list[str]]:
    """Each `grpcurl ...` command of clients/README.md, continuation lines joined, split."""
    readme = (Path(__file__).parents[1] / "clients" / "README.md").read_text()
    text = readme.replace("\\\n", " ")
    return [
        shlex.split(line.strip())
        for line in text.splitlines()
        if line.strip().startswith("grpcurl ")
    ]


def test_readme_has_a_grpcurl_call_for_every_rpc():
    called = {arg for call in grpcurl_calls() for arg in call if "/" in arg}
    for method in pb.DESCRIPTOR.services_by_name["Inference"].methods:
        assert f"pagedserve.v1.Inference/{method.name}" in called


def test_readme_grpcurl_calls_work_through_reflection(served):
    """Run each README call the way grpcurl does: learn the schema from the server's
    reflection service (not from our stubs), parse `-d` JSON against it, invoke by name."""
    with grpc.insecure_channel(served.target) as channel:
        pool = descriptor_pool.DescriptorPool(ProtoReflectionDescriptorDatabase(channel))
        for call in grpcurl_calls():
            args = call[1:]
            assert args[0] == "-plaintext", call
            data = args[args.index("-d") + 1] if "-d" in args else "{}"
            rest = [a for a in args if a not in ("-plaintext", "-d", data)]
            assert rest[0] == "localhost:50051", call
            verb = rest[1]
            if verb == "list":
                services = ProtoReflectionDescriptorDatabase(channel).get_services()
                assert "pagedserve.v1.Inference" in services
            elif verb == "describe":
                assert pool.FindServiceByName(rest[2]).methods
            else:
                service_name, method_name = verb.split("/")
                method = pool.FindServiceByName(service_name).methods_by_name[method_name]
                request_class = message_factory.GetMessageClass(method.input_type)
                response_class = message_factory.GetMessageClass(method.output_type)
                request = json_format.Parse(data, request_class())
                path = f"/{service_name}/{method_name}"
                if method.server_streaming:
                    invoke = channel.unary_stream(
                        path, request_class.SerializeToString, response_class.FromString
                    )
                    responses = list(invoke(request, timeout=120))
                    assert responses and responses[-1].finish_reason, call
                else:
                    invoke = channel.unary_unary(
                        path, request_class.SerializeToString, response_class.FromString
                    )
                    response = invoke(request, timeout=120)
                    assert json_format.MessageToJson(response), call
