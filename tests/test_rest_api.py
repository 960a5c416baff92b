"""The OpenAI-compatible REST shim on loopback, driven with the official `openai` client."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import httpx2 as httpx  # the HTTP client the openai package (3.x) is built on
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.client import AsyncInferenceClient
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.config import ServerConfig
from tests.test_grpc_server import kv_back_to_zero, serving
from tests.tiny_models import write_tiny_model

KEY = "test-key"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("rest-tiny"), "llama")


@pytest.fixture
async def rest(tiny_model):
    config = ServerConfig(grpc_port=0, http_port=0, api_key=KEY)
    async with serving(tiny_model, config, max_queued_requests=64, num_blocks=128) as (
        srv,
        core,
        engine,
    ):
        base = f"http://127.0.0.1:{srv.http_port}"
        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        try:
            yield client, srv, engine, base
        finally:
            await client.close()
    assert core.block_manager.num_used_blocks == 0


GREEDY = dict(model="tiny", temperature=0.0, extra_body={"ignore_eos": True})


async def test_completion_greedy_equals_grpc_generate(rest):
    client, srv, _, _ = rest
    result = await client.completions.create(prompt="hello world", max_tokens=12, **GREEDY)
    (choice,) = result.choices
    assert result.object == "text_completion" and result.model == "tiny"
    assert choice.finish_reason == "length"
    assert result.usage.completion_tokens == 12
    metadata = (("authorization", f"Bearer {KEY}"),)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        response = await inference_pb2_grpc.InferenceStub(channel).Generate(
            pb.GenerateRequest(
                text="hello world",
                sampling=pb.SamplingOptions(temperature=0.0),
                stopping=pb.StoppingOptions(max_tokens=12, ignore_eos=True),
            ),
            metadata=metadata,
        )
    assert choice.text == response.candidates[0].text
    assert result.usage.prompt_tokens == response.usage.prompt_tokens


async def test_completion_prompt_forms_echo_and_n(rest):
    client, _, engine, _ = rest
    ids = engine.tokenizer.encode("hello world")
    by_text = await client.completions.create(prompt="hello world", max_tokens=5, **GREEDY)
    by_ids = await client.completions.create(prompt=ids, max_tokens=5, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    several = await client.completions.create(
        prompt=["hello world", "the quick"], n=2, max_tokens=5, **GREEDY
    )
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.choices[0].text == by_text.choices[0].text
    assert several.usage.completion_tokens == 20
    echo = await client.completions.create(prompt="hello world", echo=True, max_tokens=5, **GREEDY)
    assert echo.choices[0].text == "hello world" + by_text.choices[0].text


async def test_chat_uses_the_template_and_n_choices(rest):
    client, _, engine, _ = rest
    messages = [{"role": "user", "content": "Hello!"}]
    result = await client.chat.completions.create(
        messages=messages, n=2, max_tokens=6, seed=3, model="tiny", temperature=1.0
    )
    assert result.object == "chat.completion"
    assert [c.index for c in result.choices] == [0, 1]
    assert all(c.message.role == "assistant" for c in result.choices)
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert result.usage.prompt_tokens == len(engine.tokenizer.encode(prompt, False))


async def test_streaming_chat_chunks_match_the_unary_answer(rest):
    client, _, _, _ = rest
    args = dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=8, **GREEDY)
    unary = await client.chat.completions.create(**args)
    stream = await client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == unary.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])


async def test_raw_sse_framing_ends_with_done(rest):
    _, _, _, base = rest
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{base}/v1/completions", json=body, headers=headers)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = response.text.split("\n\n")
    assert events[-2] == "data: [DONE]" and events[-1] == ""
    assert all(e.startswith("data: {") for e in events[:-2])


async def test_logprobs_both_apis(rest):
    client, _, _, _ = rest
    result = await client.completions.create(prompt="hello", max_tokens=4, logprobs=3, **GREEDY)
    logprobs = result.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == result.choices[0].text
    chat = await client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        **GREEDY,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    # greedy: the chosen token is the most likely one
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


async def test_legacy_logprobs_list_the_sampled_token_among_the_top_ones(rest):
    # OpenAI's completions API: top_logprobs holds the top N and, where it is not among
    # them, the sampled token (up to N + 1 entries); chat's holds the top N only.
    client = rest[0]
    result = await client.completions.create(
        model="tiny", prompt="hello", max_tokens=48, logprobs=1, temperature=2.0, seed=7
    )
    logprobs = result.choices[0].logprobs
    pairs = list(zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs))
    for token, logprob, top in pairs:
        assert token in top and top[token] == pytest.approx(logprob), (token, top)
        assert 1 <= len(top) <= 2, top
    # At temperature 2 the sampled token is often not the most likely: those positions
    # are where the sampled token had to be added.
    assert any(len(top) == 2 for _, _, top in pairs), pairs


async def test_stop_string_ends_the_text_before_it(rest):
    client, _, _, _ = rest
    full = (await client.completions.create(prompt="hello", max_tokens=16, **GREEDY)).choices[0]
    stop = full.text[len(full.text) // 2 :][:3]
    cut = await client.completions.create(prompt="hello", max_tokens=16, stop=stop, **GREEDY)
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full.text[: full.text.index(stop)]


async def test_seed_reproduces_sampled_text(rest):
    client, _, _, _ = rest
    args = dict(model="tiny", prompt="Once upon", max_tokens=12, temperature=1.0)
    a = await client.completions.create(seed=42, **args)
    b = await client.completions.create(seed=42, **args)
    c = await client.completions.create(seed=43, **args)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != c.choices[0].text


async def test_errors_are_the_clients_own_exception_types(rest):
    client, _, _, _ = rest
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model="tiny", prompt="x", top_p=1.5)
    assert "top_p" in err.value.message and err.value.param == "top_p"
    with pytest.raises(openai.BadRequestError) as err:
        await client.completions.create(model="tiny", prompt="x", temperature="hot")
    assert err.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "x"}],
            logprobs=True,
            top_logprobs=21,
        )
    assert err.value.param == "top_logprobs"
    with pytest.raises(openai.NotFoundError) as err:
        await client.completions.create(model="gpt-4", prompt="x")
    assert err.value.code == "model_not_found"


async def test_queue_full_is_429_with_retry_after(tiny_model):
    config = ServerConfig(grpc_port=0, http_port=0)
    async with serving(tiny_model, config, max_queued_requests=0) as (srv, _, _):
        url = f"http://127.0.0.1:{srv.http_port}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0) as client:
            with pytest.raises(openai.RateLimitError) as err:
                await client.completions.create(model="tiny", prompt="x")
            assert err.value.response.headers["retry-after"] == "1"
            srv.door.draining = True
            with pytest.raises(openai.InternalServerError) as err:
                await client.completions.create(model="tiny", prompt="x")
            assert err.value.status_code == 503


async def test_an_engine_fault_is_500_and_the_shim_serves_on(rest):
    client, _, engine, _ = rest
    runner = engine.core.engine.runner
    forward = runner.forward

    def fail_once(*args, **kwargs):
        runner.forward = forward
        raise RuntimeError("injected fault")

    runner.forward = fail_once  # the next step raises, later steps are fine
    with pytest.raises(openai.InternalServerError) as err:
        await client.completions.create(prompt="boom", max_tokens=4, **GREEDY)
    assert err.value.status_code == 500 and "injected fault" in str(err.value)
    reply = await client.completions.create(prompt="fine", max_tokens=4, **GREEDY)
    assert reply.usage.completion_tokens == 4
    await kv_back_to_zero(engine)


async def test_closing_a_stream_early_cancels_and_frees_kv(rest):
    client, _, engine, _ = rest
    generated_before = engine.stats.num_generated_tokens
    stream = await client.chat.completions.create(
        messages=[{"role": "user", "content": "Tell me a story"}],
        max_tokens=400,
        stream=True,
        **GREEDY,
    )
    received = 0
    async for _ in stream:
        received += 1
        if received == 3:
            break
    await stream.close()
    await kv_back_to_zero(engine)
    # cancelled, not run to its end: far fewer than max_tokens were generated
    assert engine.stats.num_generated_tokens - generated_before < 400


async def test_a_client_leaving_a_unary_completion_cancels_it(rest):
    # No stream to close: the server watches the connection while it collects the answer.
    _, _, engine, base = rest
    before = engine.stats.num_generated_tokens
    body = dict(model="tiny", prompt="Tell me a long story", max_tokens=480, ignore_eos=True)
    auth = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        call = asyncio.ensure_future(http.post("/v1/completions", json=body, headers=auth))
        while engine.stats.num_generated_tokens - before < 5:  # generating now
            assert not call.done(), call.result().text
            await asyncio.sleep(0.002)
        call.cancel()  # the client hangs up mid-answer
        with contextlib.suppress(asyncio.CancelledError):
            await call
    await kv_back_to_zero(engine)
    assert not engine.has_work
    assert engine.stats.num_generated_tokens - before < 480  # cancelled, not run out


async def test_api_key_on_rest_and_grpc(rest):
    _, srv, _, base = rest
    async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            await bad.completions.create(model="tiny", prompt="x")
    async with httpx.AsyncClient() as http:
        assert (await http.post(f"{base}/tokenize", json={"prompt": "x"})).status_code == 401
        assert (await http.get(f"{base}/health")).status_code == 200  # probes need no key
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.StreamGenerate(pb.GenerateRequest(text="x")):
                pass
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        registry = srv.door.metrics.registry  # refusals are counted like other outcomes
        for rpc in ("GetModelInfo", "StreamGenerate", "/v1/completions"):
            labels = {"rpc": rpc, "code": "UNAUTHENTICATED"}
            assert registry.get_sample_value("pagedserve_requests_total", labels) == 1
        info = await stub.GetModelInfo(
            pb.GetModelInfoRequest(), metadata=(("authorization", f"Bearer {KEY}"),)
        )
        assert info.name == "tiny"
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    target = f"127.0.0.1:{srv.port}"
    async with AsyncInferenceClient(target, api_key=KEY) as keyed:  # the client library
        assert (await keyed.model_info()).name == "tiny"
    async with AsyncInferenceClient(target) as keyless:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await keyless.model_info()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_models_health_tokenize_metrics(rest):
    client, srv, engine, base = rest
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=base, headers=headers) as http:
        tokens = (await http.post("/tokenize", json={"prompt": "hello world"})).json()
        assert tokens["tokens"] == engine.tokenizer.encode("hello world")
        assert tokens["count"] == len(tokens["tokens"])
        chat = await http.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
        assert chat.json()["count"] > tokens["count"] - 5
        text = (await http.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
        assert text["prompt"] == "hello world"
        assert (await http.post("/detokenize", json={"tokens": [10**6]})).status_code == 400
        await client.completions.create(prompt="hi", max_tokens=2, **GREEDY)
        metrics = (await http.get("/metrics")).text
        assert 'pagedserve_requests_total{code="OK",rpc="/v1/completions"}' in metrics
        assert "pagedserve_kv_cache_blocks_total" in metrics
        assert (await http.get("/health")).status_code == 200
        srv.door.draining = True  # health follows the service, not just the process
        assert (await http.get("/health")).status_code == 503
        srv.door.draining = False
