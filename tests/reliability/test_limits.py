"""Limits: every bound on a request's size holds at both doors,
gRPC and REST, with an error that names the field: the message size (max_message_bytes,
the REST body too: 413, read no further than the limit), prompt tokens and max_tokens
against the context, n, stop strings (count and length), stop token ids, logprobs and
prompt logprobs. Each limit is tried at its value (served) and one past it (refused).
Text that cannot fit the context is refused before it is encoded."""

from __future__ import annotations

import json

import grpc
import httpx2 as httpx
import pytest

from engine.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from engine.text.prompts import MAX_CHAT_MESSAGES
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.config import ServerConfig
from tests.test_grpc_server import kv_back_to_zero, serving
from tests.tiny_models import write_tiny_model

LIMIT_BYTES = 64 * 1024
JSON = {"content-type": "application/json"}
CONTEXT = 128  # num_blocks x block_size below
TOKEN = 42  # prompts are token ids: k of them are k tokens, where text is not under BPE


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("limits-tiny"), "llama")


@pytest.fixture
async def doors(tiny_model):
    config = ServerConfig(grpc_port=0, http_port=0, max_message_bytes=LIMIT_BYTES)
    async with serving(tiny_model, config, num_blocks=CONTEXT // 4, block_size=4) as (
        srv,
        core,
        engine,
    ):
        base = f"http://127.0.0.1:{srv.http_port}"
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel,
            httpx.AsyncClient(base_url=base, timeout=60) as http,
        ):
            yield inference_pb2_grpc.InferenceStub(channel), http
        await kv_back_to_zero(engine)
        assert not core.requests


def grpc_request(prompt: list[int], **fields) -> pb.GenerateRequest:
    """A greedy request over token ids, 2 tokens unless max_tokens says otherwise, with
    `fields` set on whichever of sampling / stopping / output has them."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt))
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = 2
    for name, value in fields.items():
        for part in (request.sampling, request.stopping, request.output):
            if name in part.DESCRIPTOR.fields_by_name:
                field = getattr(part, name)
                if isinstance(value, list):
                    field.extend(value)
                else:
                    setattr(part, name, value)
                break
        else:
            raise KeyError(name)
    return request


# (name, at the limit, one past it): gRPC fields; the REST bodies are derived below.
LIMITS = [
    ("n", dict(n=MAX_N), dict(n=MAX_N + 1)),
    ("stop", dict(stop=["zz"] * MAX_STOP_STRINGS), dict(stop=["zz"] * (MAX_STOP_STRINGS + 1))),
    (
        "stop",
        dict(stop=["z" * MAX_STOP_STRING_CHARS]),
        dict(stop=["z" * (MAX_STOP_STRING_CHARS + 1)]),
    ),
    (
        "stop_token_ids",
        dict(stop_token_ids=[7] * MAX_STOP_TOKEN_IDS),
        dict(stop_token_ids=[7] * (MAX_STOP_TOKEN_IDS + 1)),
    ),
    ("logprobs", dict(logprobs=MAX_LOGPROBS), dict(logprobs=MAX_LOGPROBS + 1)),
    (
        "prompt_logprobs",
        dict(prompt_logprobs=MAX_LOGPROBS),
        dict(prompt_logprobs=MAX_LOGPROBS + 1),
    ),
]


def assert_refused(response: httpx.Response, status: int, param: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error


def rest_bodies(fields: dict) -> list[tuple[str, dict, str]]:
    """(path, body, the name REST gives the field) for the same limit over REST."""
    base = {"max_tokens": 2, "temperature": 0.0}
    ((name, value),) = fields.items()
    if name == "prompt_logprobs":  # completions: echo + logprobs asks for them
        body = base | {"prompt": [TOKEN] * 4, "echo": True, "logprobs": value}
        return [("/v1/completions", body, "logprobs")]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    if name == "logprobs":
        return [
            ("/v1/completions", base | {"prompt": [TOKEN] * 4, "logprobs": value}, "logprobs"),
            (
                "/v1/chat/completions",
                base | chat | {"logprobs": True, "top_logprobs": value},
                "top_logprobs",
            ),
        ]
    return [
        ("/v1/completions", base | {"prompt": [TOKEN] * 4, name: value}, name),
        ("/v1/chat/completions", base | chat | {name: value}, name),
    ]


@pytest.mark.parametrize(
    "name,at_limit,past_it", LIMITS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(LIMITS)]
)
async def test_each_limit_holds_at_both_doors(doors, name, at_limit, past_it):
    stub, http = doors
    prompt = [TOKEN] * 4
    served = await stub.Generate(grpc_request(prompt, **at_limit))
    assert len(served.candidates) == at_limit.get("n", 1)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(grpc_request(prompt, **past_it))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(f"{name}: "), err.value.details()
    for (path, ok, _), (_, refused, param) in zip(
        rest_bodies(at_limit), rest_bodies(past_it), strict=True
    ):
        response = await http.post(path, json=ok)
        assert response.status_code == 200, (path, response.text)
        assert_refused(await http.post(path, json=refused), 400, param)


async def test_prompt_tokens_and_max_tokens_against_the_context(doors):
    stub, http = doors
    # The longest prompt that leaves room for one token is served, one more is refused.
    await stub.Generate(grpc_request([TOKEN] * (CONTEXT - 1), max_tokens=1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(grpc_request([TOKEN] * CONTEXT, max_tokens=1))
    assert err.value.details().startswith("token_ids.ids: "), err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(grpc_request([TOKEN] * 4, max_tokens=CONTEXT - 3))
    assert err.value.details().startswith("max_tokens: "), err.value.details()
    body = {"prompt": [TOKEN] * (CONTEXT - 1), "max_tokens": 1}
    assert (await http.post("/v1/completions", json=body)).status_code == 200
    body = {"prompt": [TOKEN] * CONTEXT, "max_tokens": 1}
    assert_refused(await http.post("/v1/completions", json=body), 400, "prompt")
    body = {"prompt": "hello", "max_tokens": CONTEXT}
    assert_refused(await http.post("/v1/completions", json=body), 400, "max_tokens")
    # Chat: the rendered conversation is the prompt, and the error names the field sent.
    long_chat = {"messages": [{"role": "user", "content": "hello " * CONTEXT}]}
    assert_refused(await http.post("/v1/chat/completions", json=long_chat), 400, "messages")
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for field in ("max_tokens", "max_completion_tokens"):
        body = chat | {field: CONTEXT}
        assert_refused(await http.post("/v1/chat/completions", json=body), 400, field)


async def test_chat_message_count_at_both_doors(doors):
    # At the limit the messages are rendered, and judged against the context (4,096 cannot
    # fit in 128 tokens); one past it they are refused before any is copied, at every door.
    stub, http = doors
    for count, counted in ((MAX_CHAT_MESSAGES, False), (MAX_CHAT_MESSAGES + 1, True)):
        messages = [pb.ChatMessage(role="user", content="hi")] * count
        for call, request in (
            (stub.Generate, pb.GenerateRequest(chat=pb.ChatMessages(messages=messages))),
            (stub.Tokenize, pb.TokenizeRequest(chat=pb.ChatMessages(messages=messages))),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(request)
            details = err.value.details()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert details.startswith("chat.messages: "), details  # the gRPC field
            assert ("at most" in details) == counted, details
        # Short, to stay within the body limit: a message with a role only.
        body = json.dumps({"messages": [{"role": "u"}] * count}, separators=(",", ":"))
        for path in ("/v1/chat/completions", "/tokenize"):
            response = await http.post(path, content=body, headers=JSON)
            assert_refused(response, 400, "messages")
            assert ("at most" in response.json()["error"]["message"]) == counted


async def test_message_size_limit_at_both_doors(doors):
    stub, http = doors
    big = "x" * LIMIT_BYTES
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(pb.GenerateRequest(text=big))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in err.value.details()
    body = {"prompt": big, "max_tokens": 2}
    assert_refused(await http.post("/v1/completions", json=body), 413, "body")

    async def chunks():  # no Content-Length: refused once the bytes read pass the limit
        for _ in range(4 * LIMIT_BYTES // 4096):
            yield b" " * 4096

    response = await http.post("/v1/completions", content=chunks())
    assert_refused(response, 413, "body")
    # Just under the limit the body is read and judged on its content.
    body = {"prompt": "x" * (LIMIT_BYTES - 100), "max_tokens": 2}
    assert_refused(await http.post("/v1/completions", json=body), 400, "prompt")
    # A unary answer over the limit (64 candidates with logprobs) fails cleanly, naming
    # what to change; streaming the same request works.
    request = grpc_request([7] * 4, n=MAX_N, max_tokens=16, logprobs=MAX_LOGPROBS)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.Generate(request)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("response: "), err.value.details()
    finals = [m async for m in stub.StreamGenerate(request) if m.finish_reason]
    assert len(finals) == MAX_N


async def test_a_tokenize_answer_over_the_message_limit_fails_cleanly(tiny_model):
    # Text within the context's bound can still tokenize to an answer over a small message
    # limit (1,600 emoji: 4,800 tokens over 16 KiB): RESOURCE_EXHAUSTED naming the response.
    config = ServerConfig(grpc_port=0, max_message_bytes=16 * 1024)
    async with serving(tiny_model, config, num_blocks=CONTEXT // 4, block_size=4) as (srv, _, _):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Tokenize(pb.TokenizeRequest(text="🙂" * 1600))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert err.value.details().startswith("response: "), err.value.details()


async def test_what_the_fuzzer_found_is_refused_in_the_envelope(doors):
    """The REST answers the fuzzer once got wrong (500, or FastAPI's bare {"detail"}), and
    the refusals outside the API: each is OpenAI's envelope naming the field."""
    _, http = doors
    as_json = {"content-type": "application/json"}
    for response, status, param in (
        # echo decoded token ids before the engine checked them: OverflowError, 500
        (await http.post("/v1/completions", json={"prompt": [-1], "echo": True}), 400, "prompt"),
        # a lone surrogate ("\ud800", no character) reached the tokenizer: TypeError, 500;
        # JSON as RFC 8259 has it refuses the body
        (
            await http.post(
                "/v1/completions", content=json.dumps({"prompt": ["\ud800"]}), headers=as_json
            ),
            400,
            "body",
        ),
        # bytes that are not UTF-8: refused by the field that holds them
        (
            await http.post("/v1/completions", content=b'{"prompt": "\xff"}', headers=as_json),
            400,
            "prompt",
        ),
        (
            await http.post(
                "/v1/completions", content=b'{"prompt": "x", "user": "\xff"}', headers=as_json
            ),
            400,
            "body",
        ),
        (await http.post("/v1/completions", content=b"{not json", headers=as_json), 400, "body"),
        (await http.post("/v1/completions", content=b"[1, 2]", headers=as_json), 400, "body"),
        (await http.post("/v1/completions", content=b'{"prompt": "x"}'), 400, "body"),  # no type
        (await http.post("/v1/completions", json={"prompt": {"a": 1}}), 400, "prompt"),
        # logit_bias is refused whole, whatever it holds: its entries are never built
        (
            await http.post("/v1/completions", json={"prompt": "x", "logit_bias": {"": "?"}}),
            400,
            "logit_bias",
        ),
        (await http.get("/v1/nope"), 404, None),
        (await http.get("/v1/completions"), 405, None),
        # JSON types as OpenAI documents them: no true for token 1, no "yes" for true
        (await http.post("/detokenize", json={"tokens": [True]}), 400, "tokens.0"),
        (await http.post("/v1/completions", json={"prompt": "x", "echo": "yes"}), 400, "echo"),
    ):
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"], error


class CountingBackend:
    """A tokenizers.Tokenizer stand-in that counts encode() calls and delegates the rest."""

    def __init__(self, backend):
        self.backend, self.encoded = backend, 0

    def encode(self, *args, **kwargs):
        self.encoded += 1
        return self.backend.encode(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.backend, name)


async def test_text_that_cannot_fit_the_context_is_refused_unencoded(tiny_model):
    # Text longer than context x the longest vocabulary entry cannot fit, and encoding
    # megabytes of it would hold the event loop for seconds: it is refused before encoding.
    config = ServerConfig(grpc_port=0, http_port=0)
    async with serving(tiny_model, config, num_blocks=CONTEXT // 4, block_size=4) as (
        srv,
        core,
        engine,
    ):
        tokenizer = engine.tokenizer
        counting = tokenizer.backend = CountingBackend(tokenizer.backend)
        too_long = "a" * (CONTEXT * tokenizer.max_token_chars + 1)
        base = f"http://127.0.0.1:{srv.http_port}"
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel,
            httpx.AsyncClient(base_url=base, timeout=60) as http,
        ):
            stub = inference_pb2_grpc.InferenceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(pb.GenerateRequest(text=too_long))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # Named as the gRPC request spells the field, as Tokenize does below.
            assert err.value.details().startswith("text: ") and "cannot fit" in str(err.value)
            chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=too_long)])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(pb.GenerateRequest(chat=chat))
            assert err.value.details().startswith("chat.messages: "), err.value.details()
            body = {"prompt": too_long, "max_tokens": 2}
            assert_refused(await http.post("/v1/completions", json=body), 400, "prompt")
            body = {"messages": [{"role": "user", "content": too_long}]}
            assert_refused(await http.post("/v1/chat/completions", json=body), 400, "messages")
            # Tokenize has the same guard, at both doors.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Tokenize(pb.TokenizeRequest(text=too_long))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("text: ") and "cannot fit" in str(err.value)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Tokenize(pb.TokenizeRequest(chat=chat))
            assert err.value.details().startswith("chat.messages: "), err.value.details()
            assert_refused(await http.post("/tokenize", json={"prompt": too_long}), 400, "prompt")
            assert_refused(await http.post("/tokenize", json=body), 400, "messages")
            assert counting.encoded == 0
            # At the bound the text is encoded, then judged on its tokens.
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Generate(pb.GenerateRequest(text=too_long[:-1]))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert counting.encoded == 1 and "cannot fit" not in err.value.details()
        await kv_back_to_zero(engine)
        assert not core.requests
