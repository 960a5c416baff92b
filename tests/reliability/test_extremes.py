"""Extremes: every numeric field of every request, at both doors, is tried at its type's
bounds (0, -1 where the type allows it, int32 / uint32 / int64 limits, 10**12 and 1e308 in
JSON, NaN and infinities where floats go), and every size (candidates, stop lists, token-id
prompts, prompts in a batch, chat messages, text) far past its limit.

An invalid value is refused within 1 s, INVALID_ARGUMENT / 400 naming the field; a legal one
(temperature 0, seed -1, top_k 0, ...) is served a well-formed answer. Throughout, the
server's memory stays within 100 MB of where it started and health answers between cases:
no size is used to build anything before it is checked. Run once on the in-process server
(gRPC and REST on one engine thread) and once on `pagedserve serve` as a child process
with the engine in a process of its own, measuring both processes."""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass

import grpc
import httpx2 as httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.errors import ValidationError
from engine.sampling_params import MAX_LOGPROBS, MAX_N
from engine.text.prompts import MAX_CHAT_MESSAGES
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.config import ServerConfig
from service.convert import MAX_PROMPTS, SAMPLING_FIELDS
from service.grpc.handlers import SERVICE_NAME
from service.rest.bodies import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    decode,
)
from tests.server_process import free_port, start_server_process
from tests.test_grpc_server import kv_back_to_zero, serving
from tests.tiny_models import TOKENIZER_VOCAB_SIZE, write_tiny_model

INT32_MIN, INT32, UINT32 = -(2**31), 2**31 - 1, 2**32 - 1
INT64_MIN, INT64 = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_MESSAGE_BYTES = 256 * 1024  # the biggest sizes below are as many as fit in it
NUM_BLOCKS, BLOCK_SIZE = 32, 4
CONTEXT = NUM_BLOCKS * BLOCK_SIZE
MAX_QUEUED = 64
TOKEN = 42
REFUSED_WITHIN = 1.0  # seconds
RSS_HEADROOM = 100 * 1024 * 1024
MANY = 50_000  # entries of a list: far past every count limit, within the message limit

# The values each type can carry, at its bounds (a float field is float32 on gRPC).
GRPC_EXTREMES = {
    "uint32": [0, 1, INT32, UINT32, 10**9],
    "int32": [0, -1, INT32, INT32_MIN],
    "int64": [0, -1, INT64, INT64_MIN],
    "float": [0.0, -1.0, FLOAT32_MAX, -FLOAT32_MAX, math.nan, math.inf, -math.inf],
}
JSON_EXTREMES = [0, -1, INT32, UINT32, INT64, INT64_MIN, 10**12, 1e308, -1e308]
JSON_EXTREMES += [math.nan, math.inf, -math.inf]  # written NaN, Infinity, -Infinity


def between(low, high):
    """Legal values: JSON integers (and floats, for a float field) in [low, high]."""
    return lambda v, floats=False: (
        not isinstance(v, bool)
        and (isinstance(v, int) or (floats and isinstance(v, float)))
        and math.isfinite(v)
        and (low is None or v >= low)
        and (high is None or v <= high)
    )


def above(low):  # a float field open at low, unbounded above (float32 on the engine)
    return lambda v, floats=True: (
        isinstance(v, int | float) and math.isfinite(v) and low < v <= FLOAT32_MAX
    )


MAX_TOKENS = 2  # of every request served; the prompt is 4 tokens
# field -> (proto type, legal values, REST float field); where each sampling field goes on
# a GenerateRequest is the converter's SAMPLING_FIELDS
FIELDS = {
    "n": ("uint32", between(1, MAX_N), False),
    "temperature": ("float", between(0, FLOAT32_MAX), True),
    "top_k": ("int32", between(-1, None), False),
    "top_p": ("float", above(0.0), True),
    "min_p": ("float", between(0, 1), True),
    "repetition_penalty": ("float", above(0.0), True),
    "presence_penalty": ("float", between(-2, 2), True),
    "frequency_penalty": ("float", between(-2, 2), True),
    "seed": ("int64", between(INT64_MIN, INT64), False),
    "max_tokens": ("uint32", between(1, CONTEXT - 4), False),
    "min_tokens": ("uint32", between(0, MAX_TOKENS), False),
    "logprobs": ("uint32", between(0, MAX_LOGPROBS), False),
    "prompt_logprobs": ("uint32", between(0, MAX_LOGPROBS), False),
    "priority": ("int32", between(INT32_MIN, INT32), False),
    "stop_token_ids": ("uint32", between(0, TOKENIZER_VOCAB_SIZE - 1), False),
    "token_ids": ("uint32", between(0, TOKENIZER_VOCAB_SIZE - 1), False),
}
# top_p is at most 1 as well: `above` covers only the open end.
LEGAL_OVERRIDES = {"top_p": lambda v, floats=True: above(0.0)(v) and v <= 1}


def legal(name: str, value) -> bool:
    check = LEGAL_OVERRIDES.get(name, FIELDS[name][1])
    return check(value, floats=FIELDS[name][2])


@dataclass
class Case:
    label: str
    door: str  # a gRPC method, or a REST path
    request: object  # a protobuf message, or the REST body's bytes
    refused: str | None  # the field the refusal names; None: served


def generate_request(**fields) -> pb.GenerateRequest:
    """A greedy 2-token request over a 4-token prompt, `fields` set where they belong."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[TOKEN] * 4))
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = MAX_TOKENS
    for name, value in fields.items():
        if name == "token_ids":
            del request.token_ids.ids[:]
            request.token_ids.ids.extend(value)
        elif name == "priority":
            request.priority = value
        else:
            part, field = SAMPLING_FIELDS[name].grpc.split(".")
            if isinstance(value, list):
                getattr(getattr(request, part), field).extend(value)
            else:
                setattr(getattr(request, part), field, value)
    return request


def chat(count: int, content: str = "", role: str = "user") -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=role, content=content)] * count)


def grpc_cases() -> list[Case]:
    cases = []
    for name, (kind, _, _) in FIELDS.items():
        for value in GRPC_EXTREMES[kind]:
            refused = None if legal(name, value) else name
            if name == "token_ids":
                request, refused = (
                    generate_request(token_ids=[value] * 4),
                    refused and "token_ids.ids",
                )
            elif name == "stop_token_ids":
                request = generate_request(stop_token_ids=[value])
            else:
                request = generate_request(**{name: value})
            cases.append(Case(f"{name}={value}", "Generate", request, refused))
    text = "a" * (MAX_MESSAGE_BYTES - 1000)
    for label, request, refused in (
        ("n=10**9 streamed", generate_request(n=10**9), "n"),
        ("stop x MANY", generate_request(stop=["a"] * MANY), "stop"),
        ("stop of 200,000 chars", generate_request(stop=[text]), "stop"),
        ("stop_token_ids x MANY", generate_request(stop_token_ids=[1] * MANY), "stop_token_ids"),
        ("token_ids x MANY", generate_request(token_ids=[1] * MANY), "token_ids.ids"),
        ("token_ids x context", generate_request(token_ids=[1] * CONTEXT), "token_ids.ids"),
        ("chat x MANY", pb.GenerateRequest(chat=chat(MANY, role="")), "chat.messages"),
        ("chat x limit+1", pb.GenerateRequest(chat=chat(MAX_CHAT_MESSAGES + 1)), "chat.messages"),
        ("text of 200,000 chars", pb.GenerateRequest(text=text), "text"),
    ):
        door = "StreamGenerate" if "streamed" in label else "Generate"
        cases.append(Case(label, door, request, refused))
    for label, request, refused in (
        ("text of 200,000 chars", pb.TokenizeRequest(text=text), "text"),
        ("text within the context", pb.TokenizeRequest(text="hello " * 8), None),
        ("chat x MANY", pb.TokenizeRequest(chat=chat(MANY, role="")), "chat.messages"),
        ("chat of 200,000 chars", pb.TokenizeRequest(chat=chat(1, text)), "chat.messages"),
    ):
        cases.append(Case(f"Tokenize {label}", "Tokenize", request, refused))
    return cases


def dumps(body: dict) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN, Infinity: as Python clients send


BASE = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
COMPLETION = BASE | {"prompt": [TOKEN] * 4}
CHAT = BASE | {"messages": [{"role": "user", "content": "hi"}]}
# field -> (path, body without the field, the REST name of the field, the engine's)
REST_FIELDS = [
    *[
        (name, path, base, name)
        # Each door says these as the engine does; logprobs and prompt ids apart, below.
        for name in FIELDS
        if name not in ("logprobs", "prompt_logprobs", "token_ids")
        for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT))
    ],
    ("logprobs", "/v1/completions", COMPLETION, "logprobs"),
    ("logprobs", "/v1/completions", COMPLETION | {"echo": True}, "prompt_logprobs"),
    ("best_of", "/v1/completions", COMPLETION, "n"),
    ("prompt", "/v1/completions", COMPLETION, "token_ids"),
    ("top_logprobs", "/v1/chat/completions", CHAT | {"logprobs": True}, "logprobs"),
    ("max_completion_tokens", "/v1/chat/completions", CHAT, "max_tokens"),
    ("tokens", "/detokenize", {}, "token_ids"),
]


def rest_cases() -> list[Case]:
    cases = []
    for name, path, base, engine_name in REST_FIELDS:
        for value in JSON_EXTREMES:
            ok = legal(engine_name, value)
            if name == "best_of":
                ok = value == 1 and not isinstance(value, float)  # best_of == n only
            listed = name in ("stop_token_ids", "prompt", "tokens")
            body = base | {name: [value] * 4 if listed else value}
            refused = None if ok else name
            if isinstance(value, float) and not math.isfinite(value):
                refused = "body"  # NaN and Infinity are not JSON: the body is refused whole
            cases.append(Case(f"{name}={value}", path, dumps(body), refused))
    text = "a" * (MAX_MESSAGE_BYTES - 1000)
    many = [{"role": "u"}] * (MANY // 5)  # as many as fit in the body
    for label, path, body, refused in (
        ("n=10**9", "/v1/completions", COMPLETION | {"n": 10**9}, "n"),
        ("n=10**9", "/v1/chat/completions", CHAT | {"n": 10**9}, "n"),
        ("n=10**9 streamed", "/v1/completions", COMPLETION | {"n": 10**9, "stream": True}, "n"),
        ("prompt x MANY texts", "/v1/completions", BASE | {"prompt": ["a"] * MANY}, "prompt"),
        ("prompt x MANY ids", "/v1/completions", BASE | {"prompt": [1] * MANY}, "prompt"),
        ("prompt x MANY id lists", "/v1/completions", BASE | {"prompt": [[1]] * MANY}, "prompt"),
        (
            "prompt x limit+1",
            "/v1/completions",
            BASE | {"prompt": ["a"] * (MAX_PROMPTS + 1)},
            "prompt",
        ),
        ("prompt x queue", "/v1/completions", BASE | {"prompt": ["a"] * MAX_QUEUED}, None),
        ("prompt of 200,000 chars", "/v1/completions", BASE | {"prompt": text}, "prompt"),
        ("stop x MANY", "/v1/completions", COMPLETION | {"stop": ["a"] * MANY}, "stop"),
        ("stop of 200,000 chars", "/v1/chat/completions", CHAT | {"stop": text}, "stop"),
        (
            "stop_token_ids x MANY",
            "/v1/completions",
            COMPLETION | {"stop_token_ids": [1] * MANY},
            "stop_token_ids",
        ),
        ("messages x MANY", "/v1/chat/completions", BASE | {"messages": many}, "messages"),
        (
            "messages x limit+1",
            "/v1/chat/completions",
            BASE | {"messages": many[: MAX_CHAT_MESSAGES + 1]},
            "messages",
        ),
        ("prompt of 200,000 chars", "/tokenize", {"prompt": text}, "prompt"),
        ("prompt within the context", "/tokenize", {"prompt": "hello " * 8}, None),
        ("messages x MANY", "/tokenize", {"messages": many}, "messages"),
        (
            "add_special_tokens=0",
            "/tokenize",
            {"prompt": "hi", "add_special_tokens": 0},
            "add_special_tokens",
        ),
    ):
        cases.append(Case(label, path, dumps(body), refused))
    return cases


def rss_of(process: psutil.Process) -> int:
    """Resident bytes of a process and its children (the engine's, when it has its own)."""
    total = 0
    for p in [process, *process.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class Doors:
    def __init__(self, channel, http, process: psutil.Process) -> None:
        self.channel, self.http, self.process = channel, http, process
        self.stub = inference_pb2_grpc.InferenceStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    async def assert_healthy(self) -> None:
        """Liveness and readiness over gRPC, and REST's /health, asked at once."""
        *answers, rest = await asyncio.gather(
            *(
                self.health.Check(health_pb2.HealthCheckRequest(service=name), timeout=2)
                for name in ("", SERVICE_NAME)
            ),
            self.http.get("/health", timeout=2),
        )
        assert all(a.status == health_pb2.HealthCheckResponse.SERVING for a in answers)
        assert rest.status_code == 200, rest.text

    async def grpc(self, case: Case) -> None:
        method = getattr(self.stub, case.door)
        started = time.monotonic()
        try:
            if case.door == "StreamGenerate":
                answer = [m async for m in method(case.request, timeout=30)]
                assert sum(1 for m in answer if m.finish_reason) == max(case.request.sampling.n, 1)
            else:
                answer = await method(case.request, timeout=30)
        except grpc.aio.AioRpcError as err:
            assert case.refused is not None, (case.label, err.code(), err.details())
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (case.label, err.details())
            assert err.details().startswith(f"{case.refused}: "), (case.label, err.details())
            assert time.monotonic() - started < REFUSED_WITHIN, case.label
            return
        assert case.refused is None, f"{case.label}: served, expected a refusal of {case.refused}"
        if case.door == "Generate":
            n = case.request.sampling.n if case.request.sampling.HasField("n") else 1
            assert len(answer.candidates) == n, case.label
            for candidate in answer.candidates:
                assert candidate.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
                assert all(0 <= t < TOKENIZER_VOCAB_SIZE for t in candidate.token_ids)
        elif case.door == "Tokenize":
            assert len(answer.token_ids) == len(answer.tokens) > 0, case.label

    async def rest(self, case: Case) -> None:
        started = time.monotonic()
        headers = {"content-type": "application/json"}
        response = await self.http.post(case.door, content=case.request, headers=headers)
        if case.refused is not None:
            assert response.status_code == 400, (case.label, case.door, response.text[:300])
            error = response.json()["error"]
            # The field, or the entry of it at fault ("stop_token_ids.0").
            param = error["param"]
            assert param.split(".")[0] == case.refused, (case.label, case.door, error)
            assert error["message"].startswith(f"{param}: "), (case.label, error)
            assert time.monotonic() - started < REFUSED_WITHIN, case.label
            return
        assert response.status_code == 200, (case.label, case.door, response.text[:300])
        answer = response.json()
        body = json.loads(case.request)
        if case.door == "/tokenize":
            assert answer["count"] == len(answer["tokens"]) > 0
        elif case.door == "/detokenize":
            assert isinstance(answer["prompt"], str)
        else:
            prompt = body.get("prompt")
            batch = isinstance(prompt, list) and not isinstance(prompt[0], int)
            n = body.get("n", 1) * (len(prompt) if batch else 1)
            assert len(answer["choices"]) == n, (case.label, answer)
            assert all(c["finish_reason"] in ("length", "stop") for c in answer["choices"])

    async def watched(self, case: Case, start: int) -> None:
        """One case, failed as soon as the server's memory grows past RSS_HEADROOM (a
        server in another process is watched while it works on the case)."""
        task = asyncio.ensure_future(
            self.rest(case) if isinstance(case.request, bytes) else self.grpc(case)
        )
        while not task.done():
            await asyncio.wait({task}, timeout=0.05)
            grown = rss_of(self.process) - start
            if grown > RSS_HEADROOM:
                task.cancel()
                raise AssertionError(f"{case.label} ({case.door}): RSS grew {grown >> 20} MiB")
        task.result()

    async def try_all(self, cases: list[Case]) -> dict[str, int]:
        """Every case, health checked after each; memory within RSS_HEADROOM of the start."""
        await self.assert_healthy()
        start = rss_of(self.process)
        tried = {"refused": 0, "served": 0}
        for case in cases:
            await self.watched(case, start)
            tried["served" if case.refused is None else "refused"] += 1
            await self.assert_healthy()
            grown = rss_of(self.process) - start
            assert grown < RSS_HEADROOM, f"{case.label} ({case.door}): RSS grew {grown >> 20} MiB"
        return tried


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("extremes-tiny"), "llama")


CASES = grpc_cases() + rest_cases()


async def test_extremes_at_both_doors_in_process(tiny_model):
    config = ServerConfig(grpc_port=0, http_port=0, max_message_bytes=MAX_MESSAGE_BYTES)
    settings = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    async with serving(tiny_model, config, MAX_QUEUED, **settings) as (srv, core, engine):
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.http_port}", timeout=30) as http,
        ):
            tried = await Doors(channel, http, psutil.Process()).try_all(CASES)
        await kv_back_to_zero(engine)
        assert not core.requests
    assert tried["refused"] > 300 and tried["served"] > 100, tried


async def test_extremes_against_a_server_process_with_its_own_engine_process(tiny_model):
    http_port = free_port()
    server = start_server_process(
        tiny_model,
        *("--engine-process", "--http-port", str(http_port)),
        *("--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE)),
        *("--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-queued-requests", str(MAX_QUEUED)),
    )
    try:
        server.wait_ready(timeout=120)
        process = psutil.Process(server.proc.pid)
        assert process.children(), "the engine runs in a child process of its own"
        async with (
            grpc.aio.insecure_channel(server.target) as channel,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{http_port}", timeout=30) as http,
        ):
            # The refusals: what could sink the server; the legal values were served above.
            refusals = [case for case in CASES if case.refused is not None]
            tried = await Doors(channel, http, process).try_all(refusals)
        assert server.proc.poll() is None, server.stderr()
        assert tried["refused"] == len(refusals) > 300, tried
    finally:
        server.stop()


@pytest.mark.parametrize(
    "kind,body,field",
    [
        (CompletionRequest, {"prompt": [[1]] * 1000 + [["x"]]}, "prompt.1000.0"),
        (CompletionRequest, {"prompt": [[1]] * 100_000 + [["x"]]}, "prompt"),  # too many
        (CompletionRequest, {"prompt": [[1] + ["x"] * 1_000_000]}, "prompt.0.1"),
        (CompletionRequest, {"prompt": [["x"] * 1000] * 4000}, "prompt.0.0"),
        (
            CompletionRequest,
            {"prompt": "x", "stop_token_ids": ["x"] * 1_000_000},
            "stop_token_ids.0",
        ),
        (ChatCompletionRequest, {"messages": [{"role": 1}] * 1_000_000}, "messages.0.role"),
        (DetokenizeRequest, {"tokens": ["x"] * 1_000_000}, "tokens.0"),
    ],
    ids=[
        "prompt lists",
        "prompt lists past the limit",
        "prompt bad ids",
        "prompt lists of texts",
        "stop_token_ids",
        "messages",
        "tokens",
    ],
)
def test_a_long_list_is_refused_at_its_first_wrong_entry(kind, body, field):
    # A validator that checks every entry before it answers once recorded an error per
    # entry under each type a field may have: 12 MiB of [[1], [1], ...] made 1.9 GB of
    # them. The body is refused with one error, naming the first wrong entry.
    with pytest.raises(ValidationError) as err:
        request = decode(json.dumps(body).encode(), kind)
        if kind is CompletionRequest:
            request.prompts()  # the prompt's kind is told by its first entry, then decoded
    assert err.value.field == field, err.value


def test_a_long_list_of_token_ids_is_decoded_once():
    ids = [1] * 1_000_000
    assert decode(json.dumps({"prompt": ids}).encode(), CompletionRequest).prompts() == [ids]
    assert decode(json.dumps({"tokens": ids}).encode(), DetokenizeRequest).tokens == ids
