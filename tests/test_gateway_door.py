"""The gateway door (service/grpc/gateway.py) on the real grpc.aio server, driven through
the published SglangScheduler stubs as a router drives it: token ids in, token ids out."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import zipfile

import grpc
import pytest
import tokenizers
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from service.config import ServerConfig
from tests.test_grpc_server import kv_back_to_zero, serving, tiny_model  # noqa: F401

PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture
async def worker(tiny_model):  # noqa: F811
    async with serving(tiny_model, num_blocks=128) as (srv, core, engine):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            yield sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel), core, engine


def generate_request(max_new_tokens: int = 10, stream: bool = False, **sampling) -> dict:
    params = dict(temperature=0.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, n=1)
    params.update(sampling)
    return dict(
        request_id="r1",
        tokenized=pb.TokenizedInput(input_ids=PROMPT),
        sampling_params=pb.SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, **params),
        stream=stream,
    )


async def test_generate_equals_the_offline_engine_unary_and_streamed(worker, tiny_model):  # noqa: F811
    stub, _, engine = worker
    offline = LLM(str(tiny_model), num_blocks=64, block_size=4).generate(
        PROMPT,
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    )[0]
    want = offline.outputs[0].token_ids

    unary = [m async for m in stub.Generate(pb.GenerateRequest(**generate_request()))]
    (only,) = unary  # no chunks unasked: the complete answer alone
    complete = only.complete
    assert list(complete.output_ids) == want
    assert complete.finish_reason == "length"
    assert (complete.prompt_tokens, complete.completion_tokens) == (len(PROMPT), 10)

    streamed = [m async for m in stub.Generate(pb.GenerateRequest(**generate_request(stream=True)))]
    chunks = [m.chunk for m in streamed if m.HasField("chunk")]
    assert [t for chunk in chunks for t in chunk.token_ids] == want
    assert chunks[-1].completion_tokens == 10 and chunks[0].prompt_tokens == len(PROMPT)
    assert streamed[-1].complete.output_ids == complete.output_ids
    await kv_back_to_zero(engine)


async def test_n_candidates_each_complete_with_their_index_and_logprobs(worker):
    stub, _, _ = worker
    request = pb.GenerateRequest(
        **generate_request(stream=True, temperature=1.0, n=2),
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=-1,
    )
    completes = {}
    tokens = {0: [], 1: []}
    async for message in stub.Generate(request):
        if message.HasField("chunk"):
            tokens[message.chunk.index] += message.chunk.token_ids
            logprobs = message.chunk.output_logprobs
            assert list(logprobs.token_ids) == list(message.chunk.token_ids)
            assert all(len(top.token_ids) == 2 for top in logprobs.top_logprobs)
        else:
            completes[message.complete.index] = message.complete
    assert set(completes) == {0, 1}
    for index, complete in completes.items():
        assert list(complete.output_ids) == tokens[index] and len(tokens[index]) == 10
        assert list(complete.output_logprobs.token_ids) == tokens[index]
        assert all(value <= 0 for value in complete.output_logprobs.token_logprobs)


INVALID = [  # (the field the message names, the request's changes)
    ("sampling_params.temperature", dict(temperature=-1.0)),
    ("sampling_params.top_p", dict(top_p=1.5)),
    ("sampling_params.top_k", dict(top_k=-2)),
    ("sampling_params.max_new_tokens", dict(max_new_tokens=0)),
    ("sampling_params.logit_bias", dict(logit_bias={"5": 1.0})),
    ("sampling_params.structural_tag", dict(structural_tag="{}")),
    ("sampling_params.regex", dict(regex="")),
    ("sampling_params.json_schema", dict(json_schema="{not json")),
    ("tokenized.input_ids", dict(input_ids=[])),
    ("tokenized.input_ids", dict(input_ids=[1, 10**6])),
    ("logprob_start_len", dict(return_logprob=True, logprob_start_len=3)),
    ("request_id", dict(request_id="a b")),
]


@pytest.mark.parametrize("field,changes", INVALID, ids=[f for f, _ in INVALID])
async def test_each_bad_field_is_invalid_argument_naming_it(worker, field, changes):
    stub, core, engine = worker
    request = pb.GenerateRequest(**generate_request())
    for name, value in changes.items():
        if name == "input_ids":
            del request.tokenized.input_ids[:]
            request.tokenized.input_ids.extend(value)
        elif name in ("return_logprob", "logprob_start_len", "request_id"):
            setattr(request, name, value)
        elif name == "logit_bias":
            request.sampling_params.logit_bias.update(value)
        else:
            setattr(request.sampling_params, name, value)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        [m async for m in stub.Generate(request)]
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert error.value.details().startswith(f"{field}:"), error.value.details()
    assert not core.requests
    await kv_back_to_zero(engine)


async def test_abort_ends_a_running_generate_and_frees_its_blocks(worker):
    stub, core, engine = worker
    request = pb.GenerateRequest(**generate_request(max_new_tokens=400, stream=True))
    finish = None
    async for message in stub.Generate(request):
        if message.HasField("chunk") and finish is None:
            finish = "asked"
            answer = await stub.Abort(pb.AbortRequest(request_id="r1", reason="client left"))
            assert answer.success
        if message.HasField("complete"):
            finish = message.complete.finish_reason
            assert len(message.complete.output_ids) < 400
    assert finish == "abort"
    again = await stub.Abort(pb.AbortRequest(request_id="r1"))  # no error: already gone
    assert not again.success
    await kv_back_to_zero(engine)


async def test_health_model_server_loads_and_tokenizer_for_a_router(worker):
    stub, core, engine = worker
    assert (await stub.HealthCheck(pb.HealthCheckRequest())).healthy
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.is_generation and info.served_model_name == "tiny" and info.model_path
    assert info.max_context_length == core.info.max_model_len
    assert info.vocab_size == core.info.vocab_size
    server = await stub.GetServerInfo(pb.GetServerInfoRequest())
    assert server.server_args["max_total_tokens"] == core.info.kv_capacity_tokens
    loads = await stub.GetLoads(pb.GetLoadsRequest())
    (load,) = loads.loads
    assert load.num_running_reqs == 0 and load.max_total_num_tokens == core.info.kv_capacity_tokens

    chunks = [chunk async for chunk in stub.GetTokenizer(common_pb2.GetTokenizerRequest())]
    bundle = b"".join(chunk.data for chunk in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(bundle).hexdigest()
    assert not any(chunk.sha256 for chunk in chunks[:-1])
    files = zipfile.ZipFile(io.BytesIO(bundle))
    rebuilt = tokenizers.Tokenizer.from_str(files.read("tokenizer.json").decode())
    text = "hello world, the router tokenizes"
    assert rebuilt.encode(text, add_special_tokens=False).ids == core.tokenizer.encode(
        text, add_special_tokens=False
    )
    generation = json.loads(files.read("generation_config.json"))
    assert generation["eos_token_id"] == list(core.tokenizer.eos_token_ids)


async def test_bytes_that_are_not_a_request_are_invalid_argument(tiny_model):  # noqa: F811
    async with serving(tiny_model) as (srv, _, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            generate = channel.unary_stream("/sglang.grpc.scheduler.SglangScheduler/Generate")
            with pytest.raises(grpc.aio.AioRpcError) as error:
                [m async for m in generate(b"\x0a\x05\xff\xfe\xfd\xfc\xfb")]  # request_id
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.value.details() == "request_id: is not valid UTF-8"


async def test_the_api_key_guards_the_gateway_door_as_every_door(tiny_model):  # noqa: F811
    config = ServerConfig(grpc_port=0, api_key="sekrit")
    async with serving(tiny_model, server_config=config) as (srv, _, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
            request = pb.GenerateRequest(**generate_request())
            with pytest.raises(grpc.aio.AioRpcError) as error:
                [m async for m in stub.Generate(request)]
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            key = (("authorization", "Bearer sekrit"),)
            answer = [m async for m in stub.Generate(request, metadata=key)]
            assert answer[-1].complete.finish_reason == "length"


@pytest.mark.parametrize("engine_process", [False, True], ids=["thread", "process"])
async def test_kv_events_reach_a_subscriber_from_the_engine_thread_or_process(
    tiny_model,  # noqa: F811
    engine_process,
):
    async with serving(tiny_model, engine_process=engine_process) as (srv, _, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
            events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
            await events.initial_metadata()
            [m async for m in stub.Generate(pb.GenerateRequest(**generate_request()))]
            stored = []
            while not stored:  # the reset after the warm-up may come first: cleared
                batch = await asyncio.wait_for(events.read(), timeout=10)
                stored = [e.stored for e in batch.events if e.HasField("stored")]
            events.cancel()
    blocks = [block for event in stored for block in event.blocks]
    # The prompt's one full block of 4 (the tiny server's block size) comes first.
    assert list(blocks[0].token_ids) == PROMPT[:4] and blocks[0].block_size == 4
    assert not stored[0].HasField("parent_block_hash")


async def test_its_calls_are_counted_under_their_own_names_and_a_drain_stops_it(tiny_model):  # noqa: F811
    async with serving(tiny_model) as (srv, _, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = sglang_scheduler_pb2_grpc.SglangSchedulerStub(channel)
            [m async for m in stub.Generate(pb.GenerateRequest(**generate_request()))]
            exposition = srv.door.metrics.render().decode()
            assert 'pagedserve_requests_total{code="OK",rpc="gateway/Generate"} 1.0' in exposition

            # Draining, it says it is not healthy (the router sends it nothing) and refuses work.
            await srv.drain(0)
            health = await stub.HealthCheck(pb.HealthCheckRequest())
            assert not health.healthy and "draining" in health.message
            with pytest.raises(grpc.aio.AioRpcError) as error:
                [m async for m in stub.Generate(pb.GenerateRequest(**generate_request()))]
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
