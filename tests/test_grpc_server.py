"""The real grpc.aio server on a loopback port, driven only through the generated stubs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from engine.config import engine_config_from_flat
from engine.core.engine import LLMEngine
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.serving.async_engine import AsyncEngine, EngineThread
from engine.serving.engine_process import EngineProcess
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.config import ServerConfig
from service.grpc.handlers import SERVICE_NAME
from service.serve import Server, start_server
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("grpc-tiny"), "llama")


@contextlib.asynccontextmanager
async def serving(
    model,
    server_config: ServerConfig | None = None,  # default: any free port
    max_queued_requests: int = 1024,
    mailbox_size: int = 256,
    start: bool = True,
    engine_process: bool = False,
    **settings,
) -> AsyncIterator[tuple[Server, LLMEngine | None, AsyncEngine]]:
    """A ready server on a free loopback port over a tiny-model engine (started unless
    start=False); stopped, with its engine, on the way out. With engine_process the
    engine runs in a child process, and no LLMEngine is yielded (None)."""
    settings = {"num_blocks": 64, "block_size": 4, **settings}
    config = engine_config_from_flat(model=str(model), **settings)
    core = None if engine_process else LLMEngine(config)
    engine = AsyncEngine(
        EngineProcess(config) if core is None else EngineThread(core),
        max_queued_requests,
        mailbox_size,
    )
    if start:
        engine.start()
    srv = await start_server(server_config or ServerConfig(grpc_port=0))
    await srv.set_ready(engine, "tiny")
    try:
        yield srv, core, engine
    finally:
        await srv.stop()
        engine.shutdown(timeout=5)


async def kv_back_to_zero(engine: AsyncEngine, timeout: float = 10) -> None:
    """Poll the engine's published stats until no KV block is used and nothing runs or
    waits (a client's cancel reaches the engine asynchronously, and a preempted request
    it ends holds no block while it waits)."""
    for _ in range(int(timeout / 0.02)):
        stats = engine.stats
        if (
            stats.num_kv_blocks_used == 0
            and stats.num_running_requests == 0
            and stats.num_waiting_requests == 0
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not drained: {engine.stats}")


async def wait_until_gone(core: LLMEngine, request_id: str, timeout: float = 10) -> None:
    """Poll until the engine no longer holds request_id (its cancel is asynchronous)."""
    for _ in range(int(timeout / 0.02)):
        if request_id not in core.requests:
            return
        await asyncio.sleep(0.02)


@pytest.fixture
async def server(tiny_model):
    async with serving(tiny_model, max_queued_requests=64, num_blocks=128) as (srv, core, _):
        target = f"127.0.0.1:{srv.port}"
        async with grpc.aio.insecure_channel(target) as channel:
            yield inference_pb2_grpc.InferenceStub(channel), channel, core, target
    assert core.block_manager.num_used_blocks == 0


def greedy(max_tokens: int) -> dict:
    return dict(
        sampling=pb.SamplingOptions(temperature=0.0),
        stopping=pb.StoppingOptions(max_tokens=max_tokens, ignore_eos=True),
    )


async def test_generate_equals_offline_engine(server, tiny_model):
    stub, _, _, _ = server
    response = await stub.Generate(pb.GenerateRequest(text="hello world", **greedy(12)))
    offline = LLM(str(tiny_model), num_blocks=64, block_size=4).generate(
        ["hello world"], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )[0]
    (candidate,) = response.candidates
    assert list(candidate.token_ids) == offline.outputs[0].token_ids
    assert candidate.text == offline.outputs[0].text
    assert candidate.finish_reason == pb.FINISH_REASON_LENGTH
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert response.request_id  # generated when the client sends none


async def test_stream_deltas_add_up_to_unary_result(server):
    stub, _, _, _ = server
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7, 8]), **greedy(10))
    request.sampling.n = 2
    unary = await stub.Generate(request)
    texts, finals = {0: "", 1: ""}, {}
    async for message in stub.StreamGenerate(request):
        texts[message.index] += message.text
        if message.finish_reason:
            finals[message.index] = message
    assert set(finals) == {0, 1}
    for c in unary.candidates:
        assert texts[c.index] == c.text
        assert finals[c.index].usage.completion_tokens == 10


async def test_invalid_argument_names_the_field(server):
    stub, _, _, _ = server
    request = pb.GenerateRequest(text="x", sampling=pb.SamplingOptions(top_p=1.5))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(request)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(pb.GenerateRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt" in err.value.details()


INVALID_REQUESTS = [  # (field the message must name, request)
    ("n", dict(text="x", sampling=pb.SamplingOptions(n=0))),
    ("n", dict(text="x", sampling=pb.SamplingOptions(n=65))),
    ("temperature", dict(text="x", sampling=pb.SamplingOptions(temperature=-1))),
    ("temperature", dict(text="x", sampling=pb.SamplingOptions(temperature=float("nan")))),
    ("top_k", dict(text="x", sampling=pb.SamplingOptions(top_k=-2))),
    ("top_p", dict(text="x", sampling=pb.SamplingOptions(top_p=0))),
    ("min_p", dict(text="x", sampling=pb.SamplingOptions(min_p=1.5))),
    ("repetition_penalty", dict(text="x", sampling=pb.SamplingOptions(repetition_penalty=0))),
    ("presence_penalty", dict(text="x", sampling=pb.SamplingOptions(presence_penalty=2.5))),
    ("frequency_penalty", dict(text="x", sampling=pb.SamplingOptions(frequency_penalty=-3))),
    ("max_tokens", dict(text="x", stopping=pb.StoppingOptions(max_tokens=0))),
    ("max_tokens", dict(text="x", stopping=pb.StoppingOptions(max_tokens=10**6))),
    ("min_tokens", dict(text="x", stopping=pb.StoppingOptions(max_tokens=4, min_tokens=5))),
    ("stop", dict(text="x", stopping=pb.StoppingOptions(stop=[""]))),
    ("stop", dict(text="x", stopping=pb.StoppingOptions(stop=["s"] * 65))),
    ("stop_token_ids", dict(text="x", stopping=pb.StoppingOptions(stop_token_ids=[10**6]))),
    ("logprobs", dict(text="x", output=pb.OutputOptions(logprobs=21))),
    ("prompt_logprobs", dict(text="x", output=pb.OutputOptions(prompt_logprobs=21))),
    # The prompt's errors name the field of the prompt oneof that carried it (the engine
    # calls them prompt, prompt_token_ids and messages, as REST does), or the oneof if none.
    ("token_ids.ids", dict(token_ids=pb.TokenIds(ids=[1, 10**6]))),
    ("token_ids.ids", dict(token_ids=pb.TokenIds(ids=[]))),
    ("token_ids.ids", dict(token_ids=pb.TokenIds(ids=[1] * 600))),
    ("text", dict(text="hello " * 4000)),
    ("text", dict(text="hello " * 300)),  # encodes fine, then too long for the context
    ("prompt", dict()),
    ("chat.messages", dict(chat=pb.ChatMessages(messages=[]))),
    ("chat.messages", dict(chat=pb.ChatMessages(messages=[pb.ChatMessage()] * 4097))),
    (
        "tool_function",
        dict(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user")]),
            tools=[pb.Tool(name="f")],
            tool_choice=pb.TOOL_CHOICE_FUNCTION,
            tool_function="g",
        ),
    ),
]


@pytest.mark.parametrize(
    "field,fields", INVALID_REQUESTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID_REQUESTS)]
)
async def test_every_invalid_field_is_invalid_argument_naming_it(server, field, fields):
    stub, _, core, _ = server
    for call in (stub.Generate, stub.StreamGenerate):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            response = call(pb.GenerateRequest(**fields))
            if call is stub.StreamGenerate:
                [m async for m in response]
            else:
                await response
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert err.value.details().startswith(f"{field}:"), err.value.details()
    assert not core.requests and core.block_manager.num_used_blocks == 0


async def test_unknown_model_and_duplicate_request_id(server):
    stub, _, core, _ = server
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(pb.GenerateRequest(text="x", model="other-model"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "model" in err.value.details()
    live = stub.StreamGenerate(pb.GenerateRequest(request_id="dup", text="x", **greedy(200)))
    await live.read()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(pb.GenerateRequest(request_id="dup", text="y", **greedy(2)))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert err.value.details().startswith("request_id:")
    live.cancel()  # the client leaves: the server cancels the engine request
    await wait_until_gone(core, "dup", timeout=2)
    assert "dup" not in core.requests


async def test_cancel_rpc_ends_stream_and_frees_blocks(server):
    stub, _, core, _ = server
    request = pb.GenerateRequest(request_id="to-cancel", text="abc", **greedy(400))
    reasons = []
    async for message in stub.StreamGenerate(request):
        if not message.finish_reason and not reasons:
            reasons.append("started")
            answer = await stub.Cancel(pb.CancelRequest(request_id="to-cancel"))
            assert answer.cancelled
        if message.finish_reason:
            reasons.append(message.finish_reason)
    assert reasons[-1] == pb.FINISH_REASON_CANCELLED
    assert not (await stub.Cancel(pb.CancelRequest(request_id="to-cancel"))).cancelled
    assert "to-cancel" not in core.requests


async def test_deadline_cancels_engine_request(server):
    stub, _, core, _ = server
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(
            pb.GenerateRequest(request_id="slow", text="abc", **greedy(500)), timeout=0.3
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until_gone(core, "slow", timeout=2)
    assert "slow" not in core.requests


async def test_tokenize_model_info_health_and_reflection(server):
    stub, channel, core, _ = server
    tokens = await stub.Tokenize(pb.TokenizeRequest(text="hello", add_special_tokens=False))
    assert list(tokens.token_ids) == core.tokenizer.encode("hello", add_special_tokens=False)
    with pytest.raises(grpc.aio.AioRpcError) as err:  # named its own oneof (was "prompt")
        await stub.Tokenize(pb.TokenizeRequest())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "input: set one of text or chat"
    for fields, field in (
        (dict(text="hello " * 4000), "text"),
        (dict(chat=pb.ChatMessages()), "chat.messages"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:  # its own fields (was "messages")
            await stub.Tokenize(pb.TokenizeRequest(**fields))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field}: "), err.value.details()
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.architecture == "LlamaForCausalLM" and info.kv_num_blocks == 128
    assert info.max_context_length == core.info.max_model_len
    health_stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME):
        status = await health_stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    reflection_stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = reflection_stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = [s.name async for r in responses for s in r.list_services_response.service]
    assert SERVICE_NAME in names and "grpc.health.v1.Health" in names


def test_sigterm_during_8_streams_drains_them_all_and_exits_0(tiny_model):
    """A real `pagedserve serve` process, configured by the k8s ConfigMap's file (only the
    addresses and ports moved to free loopback ones): readiness goes NOT_SERVING -> SERVING
    while it loads, then on SIGTERM flips to NOT_SERVING at once; new work gets
    UNAVAILABLE, the 8 streams in flight all finish, and the process exits 0 within the
    grace period the Deployment leaves after its preStop sleep."""
    import json
    import signal
    import subprocess
    import sys
    import threading
    import time
    from pathlib import Path

    import yaml

    from service.settings import read_config_file
    from tests.server_process import free_port, start_server_process

    k8s = Path(__file__).resolve().parent.parent / "k8s" / "base"
    config = k8s / "pagedserve.toml"
    pod = yaml.safe_load((k8s / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = pod["terminationGracePeriodSeconds"] - pre_stop  # what SIGTERM leaves
    assert read_config_file(str(config))["drain_seconds"] < grace
    loopback = ("--host", "127.0.0.1", "--http-host", "127.0.0.1")
    server = start_server_process(
        tiny_model,
        *("--config", str(config), *loopback, "--http-port", str(free_port())),
        *("--num-blocks", "128"),
    )
    statuses: list[int] = []

    def watch_readiness() -> None:
        while server.proc.poll() is None:
            try:
                with grpc.insecure_channel(server.target) as channel:
                    watch = health_pb2_grpc.HealthStub(channel).Watch(
                        health_pb2.HealthCheckRequest(service=SERVICE_NAME)
                    )
                    for answer in watch:
                        if not statuses or statuses[-1] != answer.status:
                            statuses.append(answer.status)
            except grpc.RpcError:
                time.sleep(0.05)  # not listening yet, or gone

    watcher = threading.Thread(target=watch_readiness, daemon=True)
    watcher.start()
    try:
        server.wait_ready(timeout=120)
        client = subprocess.run(
            [sys.executable, "-m", "service.cli", "client", "generate", "--json"]
            + ["--target", server.target, "--prompt", "hi", "--max-tokens", "5"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert client.returncode == 0, client.stderr
        assert len(json.loads(client.stdout)["candidates"][0]["tokenIds"]) == 5

        channel = grpc.insecure_channel(server.target)
        stub = inference_pb2_grpc.InferenceStub(channel)
        streams = [
            stub.StreamGenerate(pb.GenerateRequest(text=f"stream {i}", **greedy(150)))
            for i in range(8)
        ]
        firsts = [next(s) for s in streams]  # all 8 are running
        server.proc.send_signal(signal.SIGTERM)
        sigterm_at = time.monotonic()
        deadline = time.monotonic() + 10
        while server.health() != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert server.health("") == health_pb2.HealthCheckResponse.SERVING  # still alive
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(text="late", **greedy(2)), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        for first, stream in zip(firsts, streams):
            rest = list(stream)
            assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
            assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 150
        channel.close()
        assert server.proc.wait(timeout=grace) == 0, server.stderr()
        assert time.monotonic() - sigterm_at < grace
        watcher.join(timeout=5)
        serving, not_serving = (
            health_pb2.HealthCheckResponse.SERVING,
            health_pb2.HealthCheckResponse.NOT_SERVING,
        )
        # The first NOT_SERVING (loading) is seen only if the watcher connects before the
        # tiny model is loaded; test_readiness_follows_the_engine... checks it in-process.
        assert statuses in ([not_serving, serving, not_serving], [serving, not_serving])
    finally:
        server.stop()


async def test_async_client_round_trip(server):
    from clients.client import AsyncInferenceClient

    _, _, core, target = server
    async with AsyncInferenceClient(target) as client:
        info = await client.model_info()
        assert info.vocab_size == core.model_config.vocab_size
        request = pb.GenerateRequest(text="hello", **greedy(6))
        unary = await client.generate(request, timeout=30)
        streamed = "".join([m.text async for m in client.stream(request, timeout=30)])
        assert streamed == unary.candidates[0].text
        assert await client.tokenize("hello", add_special_tokens=False) == core.tokenizer.encode(
            "hello", add_special_tokens=False
        )
        assert not await client.cancel("nothing-by-this-id")


async def test_clients_retry_a_full_queue_until_it_drains(tiny_model):
    from clients.client import AsyncInferenceClient, InferenceClient, RetryPolicy

    # The engine is not started: the queue stays full until the test starts it.
    async with serving(tiny_model, max_queued_requests=1, start=False) as (srv, _, engine):
        target = f"127.0.0.1:{srv.port}"
        async with AsyncInferenceClient(target) as client:
            first = asyncio.ensure_future(
                client.generate(pb.GenerateRequest(text="a", **greedy(2)))
            )
            await asyncio.sleep(0.2)  # the first request now occupies the only queue slot
            no_retry = AsyncInferenceClient(target, RetryPolicy(attempts=1))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await no_retry.generate(pb.GenerateRequest(text="b", **greedy(2)))
            await no_retry.close()
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("retry-after-ms", "250") in tuple(err.value.trailing_metadata())

            asyncio.get_running_loop().call_later(0.5, engine.start)
            retried = await client.generate(pb.GenerateRequest(text="c", **greedy(2)), timeout=30)
            assert len(retried.candidates[0].token_ids) == 2
            assert len((await first).candidates[0].token_ids) == 2
        sync_client = InferenceClient(target)
        response = await asyncio.to_thread(
            sync_client.generate, pb.GenerateRequest(text="d", **greedy(3)), 30
        )
        sync_client.close()
        assert len(response.candidates[0].token_ids) == 3


async def test_readiness_follows_the_engine_and_drain_refuses_new_work(tiny_model):
    """NOT_SERVING until an engine is attached, SERVING, then NOT_SERVING on drain while
    liveness stays SERVING; new work gets UNAVAILABLE but the stream in flight finishes."""

    srv = await start_server(ServerConfig(grpc_port=0))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
    stub = inference_pb2_grpc.InferenceStub(channel)
    health_stub = health_pb2_grpc.HealthStub(channel)

    async def health(name: str) -> int:
        return (await health_stub.Check(health_pb2.HealthCheckRequest(service=name))).status

    core = LLMEngine(engine_config_from_flat(model=str(tiny_model), num_blocks=64, block_size=4))
    engine = AsyncEngine(EngineThread(core))
    try:
        assert await health("") == health_pb2.HealthCheckResponse.SERVING
        assert await health(SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(pb.GenerateRequest(text="a", **greedy(2)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "loading" in err.value.details()

        engine.start()
        await srv.set_ready(engine, "tiny")
        assert await health(SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING

        in_flight = stub.StreamGenerate(pb.GenerateRequest(text="b", **greedy(40)))
        first = await in_flight.read()
        assert first.token_ids
        drained = asyncio.ensure_future(srv.drain(grace_seconds=30))
        await asyncio.sleep(0.05)
        assert await health(SERVICE_NAME) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await health("") == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(pb.GenerateRequest(text="c", **greedy(2)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "draining" in err.value.details()
        assert not drained.done()
        rest = []
        while (message := await in_flight.read()) is not grpc.aio.EOF:
            rest.append(message)
        assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert len(first.token_ids) + sum(len(m.token_ids) for m in rest) == 40
        assert await drained  # every in-flight request finished inside the grace period
    finally:
        await channel.close()
        await srv.stop()
        engine.shutdown(timeout=5)
    assert core.block_manager.num_used_blocks == 0


async def test_a_client_that_stops_reading_fails_alone(tiny_model):
    """HTTP/2 flow control stalls the server's writes to a client that stops reading; its
    mailbox fills, the engine cancels its request and frees its blocks, and another client's
    request meanwhile runs to the end. The slow client finds RESOURCE_EXHAUSTED when it
    finally reads."""
    # The well-behaved request's mailbox must absorb the engine's steps between two turns
    # of the event loop (a tiny model's steps are shorter than the interpreter's 5 ms GIL
    # switch): 4 failed it once in CI; the reader that stops overflows even at 128.
    async with serving(tiny_model, mailbox_size=64, num_blocks=128) as (srv, core, _):
        target = f"127.0.0.1:{srv.port}"
        # A tiny receive window that never grows, so the server's writes block quickly.
        slow_channel = grpc.aio.insecure_channel(
            target, options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        )
        async with slow_channel, grpc.aio.insecure_channel(target) as channel:
            slow = inference_pb2_grpc.InferenceStub(slow_channel).StreamGenerate(
                pb.GenerateRequest(request_id="slow", token_ids=pb.TokenIds(ids=[5]), **greedy(480))
            )
            await slow.initial_metadata()
            await wait_until_gone(core, "slow")
            assert "slow" not in core.requests  # cancelled in the engine without a single read
            other = await inference_pb2_grpc.InferenceStub(channel).Generate(
                pb.GenerateRequest(text="fine", **greedy(100))
            )
            assert len(other.candidates[0].token_ids) == 100
            assert core.block_manager.num_used_blocks == 0
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await slow.read() is not grpc.aio.EOF:
                    pass
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "fell behind" in err.value.details()


async def test_queue_limit_4_with_40_at_once_rejects_some_and_serves_the_rest(tiny_model):
    """The bound is on requests not yet running: with 2 running slots and 4 queue places,
    a burst of 40 gets RESOURCE_EXHAUSTED (with a retry hint) for the rest; none hang."""
    limited = serving(tiny_model, max_queued_requests=4, num_blocks=128, max_num_seqs=2)
    async with limited as (srv, core, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)

            async def one(i: int) -> grpc.aio.AioRpcError | pb.GenerateResponse:
                try:
                    request = pb.GenerateRequest(text=f"burst {i}", **greedy(30))
                    return await stub.Generate(request, timeout=60)
                except grpc.aio.AioRpcError as err:
                    return err

            results = await asyncio.gather(*(one(i) for i in range(40)))
        done = [r for r in results if isinstance(r, pb.GenerateResponse)]
        refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
        assert all(r.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for r in refused)
        assert all(("retry-after-ms", "250") in tuple(r.trailing_metadata()) for r in refused)
        assert 4 <= len(done) <= 12 and len(done) + len(refused) == 40
        assert all(len(r.candidates[0].token_ids) == 30 for r in done)
        assert core.num_generated_tokens == 30 * len(done) + 0  # the refused never ran


async def test_generate_is_traced_under_the_callers_trace(tiny_model):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from service.tracing import RequestTracer

    trace_id, caller_span = 0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7
    exporter = InMemorySpanExporter()
    async with serving(tiny_model) as (srv, _, _):  # stopping the server flushes the spans
        srv.grpc.service.tracer = RequestTracer(exporter)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            metadata = (("traceparent", f"00-{trace_id:032x}-{caller_span:016x}-01"),)
            stub = inference_pb2_grpc.InferenceStub(channel)
            await stub.Generate(pb.GenerateRequest(text="hi", **greedy(4)), metadata=metadata)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    rpc = spans[f"{SERVICE_NAME}/Generate"]
    assert rpc.context.trace_id == trace_id and rpc.parent.span_id == caller_span
    for phase in ("queue", "prefill", "decode"):
        assert spans[phase].parent.span_id == rpc.context.span_id


async def test_an_engine_fault_fails_its_requests_with_internal_and_the_server_serves_on(
    server,
):
    stub, _, core, _ = server
    forward = core.runner.forward

    def fail_once(*args, **kwargs):
        core.runner.forward = forward
        raise RuntimeError("injected fault")

    request = pb.GenerateRequest(text="boom", **greedy(4))
    core.runner.forward = fail_once  # the next step raises, later steps are fine
    with pytest.raises(grpc.aio.AioRpcError) as unary:
        await stub.Generate(request)
    core.runner.forward = fail_once
    with pytest.raises(grpc.aio.AioRpcError) as streamed:
        [m async for m in stub.StreamGenerate(request)]
    for err in (unary, streamed):
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "injected fault" in err.value.details()
    response = await stub.Generate(pb.GenerateRequest(text="fine", **greedy(4)))
    assert len(response.candidates[0].token_ids) == 4
    assert core.block_manager.num_used_blocks == 0


async def test_messages_over_the_size_limit_are_refused_and_the_server_serves_on(tiny_model):
    async with serving(tiny_model, ServerConfig(grpc_port=0, max_message_bytes=4096)) as (
        srv,
        _,
        _,
    ):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(pb.GenerateRequest(text="x" * 8192, **greedy(2)))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in err.value.details()
            response = await stub.Generate(pb.GenerateRequest(text="small", **greedy(2)))
            assert len(response.candidates[0].token_ids) == 2
