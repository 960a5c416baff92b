"""Bad input fuzzing: hypothesis draws requests over every field of the
gRPC GenerateRequest and TokenizeRequest and of the REST /v1/completions,
/v1/chat/completions, /tokenize and /detokenize bodies
(empty, huge, negative, NaN and infinities, every numeric type's extremes (uint32, int32,
int64, float32 limits; 10**12 and 1e308 in JSON), out-of-vocab token ids, invalid UTF-8,
lists far past their limits (stop strings, stop token ids, token-id prompts, chat messages,
prompts in a batch), max_tokens beyond the context, wrong JSON types, unknown fields) and
sends them to a real server on loopback, gRPC and REST on the same engine; a sample of both
doors' cases again with the engine in a child process of its own.

Every answer must be a success that is well formed, or a refusal the API documents for that
input: INVALID_ARGUMENT / 400 whose message starts with the name of a field the request
set, NOT_FOUND / 404 for another model, RESOURCE_EXHAUSTED / 413 for a message over the size
limit, 401 without the API key, 429 for more prompts than the queue holds. Never INTERNAL /
UNKNOWN / 500, never a hang. Afterwards the server is healthy: health SERVING, the greedy
request from before answers the same tokens, no KV block used, no request left.

Examples are derandomized, so CI tries the same cases every run; `pytest -s` prints how
many each door tried and how they were answered."""

from __future__ import annotations

import asyncio
import collections
import json
import math
import re
import time

import grpc
import httpx2 as httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from engine.text.prompts import MAX_CHAT_MESSAGES
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.config import ServerConfig
from service.convert import MAX_PROMPTS
from service.grpc.handlers import SERVICE_NAME
from tests.test_grpc_server import greedy, kv_back_to_zero, serving
from tests.tiny_models import SPECIAL_TOKENS, write_tiny_model

KEY = "fuzz-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MAX_MESSAGE_BYTES = 256 * 1024  # small, so that over-limit messages are cheap to send
CONTEXT = 256  # num_blocks x block_size below: the context limit
TIMEOUT = 60  # seconds for one call: a hang fails the test instead of stalling CI
INT32, UINT32, INT64 = 2**31 - 1, 2**32 - 1, 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
FAR_PAST = 20_000  # entries of a list far past its limit, well within the message limit

FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,  # the same cases in every CI run
    database=None,
    # No shrinking: over a live server it can take minutes. A failure prints the example
    # as drawn; add Phase.shrink locally to get a smaller one.
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,  # one server per test, shared by its examples
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)
TRIED: collections.Counter[tuple[str, str]] = collections.Counter()  # (door, answer) -> cases


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("fuzz-tiny"), "llama")


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    doors = sorted({door for door, _ in TRIED})
    for door in doors:
        answers = {a: n for (d, a), n in sorted(TRIED.items()) if d == door}
        print(f"\nfuzz {door}: {sum(answers.values())} cases: {answers}")
    print(f"fuzz total: {sum(TRIED.values())} cases")


class Doors:
    """The server under test, a gRPC stub and an HTTP client on it, and the greedy answer
    it gave before any fuzzing (it must give the same one afterwards)."""

    def __init__(self, srv, core, engine, channel, http) -> None:
        self.srv, self.core, self.engine = srv, core, engine
        self.channel, self.http = channel, http
        self.stub = inference_pb2_grpc.InferenceStub(channel)
        self.baseline: list[int] = []

    async def greedy_tokens(self) -> list[int]:
        request = pb.GenerateRequest(text="hello world", **greedy(8))
        response = await self.stub.Generate(request, metadata=tuple(AUTH.items()), timeout=30)
        return list(response.candidates[0].token_ids)

    async def assert_healthy(self) -> None:
        health = health_pb2_grpc.HealthStub(self.channel)
        for name in ("", SERVICE_NAME):
            status = await health.Check(health_pb2.HealthCheckRequest(service=name))
            assert status.status == health_pb2.HealthCheckResponse.SERVING, name
        assert (await self.http.get("/health")).status_code == 200
        assert await self.greedy_tokens() == self.baseline
        await kv_back_to_zero(self.engine)
        if self.core is not None:  # else in the engine's process: its stats said so above
            assert not self.core.requests and self.core.block_manager.num_used_blocks == 0


@pytest.fixture
async def doors(tiny_model, request):
    config = ServerConfig(
        grpc_port=0, http_port=0, api_key=KEY, max_message_bytes=MAX_MESSAGE_BYTES
    )
    settings_ = dict(max_queued_requests=64, num_blocks=CONTEXT // 4, block_size=4)
    engine_process = getattr(request, "param", False)  # parametrized indirectly
    async with serving(tiny_model, config, engine_process=engine_process, **settings_) as (
        srv,
        core,
        engine,
    ):
        async with (
            grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel,
            httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{srv.http_port}", timeout=TIMEOUT
            ) as http,
        ):
            doors = Doors(srv, core, engine, channel, http)
            doors.baseline = await doors.greedy_tokens()
            started = time.monotonic()
            yield doors
            await doors.assert_healthy()
            seconds = time.monotonic() - started
            print(f"\n{request.node.name}: {seconds:.1f} s, server healthy afterwards")


# ---- values ------------------------------------------------------------------------------

# "<field>: ..." or "<field>.<index or key>...: ...": the top-level field comes first.
ERROR_MESSAGE = re.compile(r"^(?P<field>[A-Za-z_]\w*)(\.[^:]+)?: \S")


def named_field(message: str) -> str:
    """The (top-level) field an error message starts with; fails if it names none."""
    match = ERROR_MESSAGE.match(message)
    assert match, f"error message does not start with a field name: {message!r}"
    return match["field"]


def sized(strategy, sizes):
    """Lists of one drawn element repeated a drawn number of times: sizes hypothesis would
    not reach by itself (thousands of stop strings) at no generation cost."""
    return st.builds(lambda item, k: [item] * k, strategy, st.sampled_from(sizes))


class Fields:
    """Draws each field good or bad. An example first draws how often it breaks one (never,
    now and then, often), so valid requests, requests with one bad field and requests with
    many all come up, and successes are checked as well as refusals."""

    def __init__(self, draw) -> None:
        self.draw = draw
        self.rate = draw(st.sampled_from([0, 0, 4, 15, 50]))  # percent of fields broken

    def __call__(self, good, bad=None):
        if bad is not None and self.draw(st.integers(0, 99)) < self.rate:
            return self.draw(bad)
        return self.draw(good)

    def maybe(self, good, bad=None):
        """None (the field stays unset) a third of the time."""
        return None if self.draw(st.integers(0, 2)) == 0 else self(good, bad)


GOOD_TEXT = st.one_of(
    st.text(min_size=1, max_size=12),
    st.sampled_from(["hello world", "\x00", "\ufffd", "🙂" * 3, "é\u0301", *SPECIAL_TOKENS]),
)
BAD_TEXT = st.one_of(
    st.just(""),
    st.builds(  # past the context, and past the message size limit
        lambda c, k: c * k,
        st.sampled_from(["x", "é", "🙂", " ", "<|im_start|>"]),
        st.sampled_from([300, 3000, 70_000]),
    ),
)
TEXT = st.one_of(GOOD_TEXT, BAD_TEXT)
GOOD_STOP = st.text(min_size=1, max_size=4)
STOPS = st.one_of(st.lists(GOOD_STOP, max_size=3), sized(GOOD_STOP, [64]))
BAD_STOPS = st.one_of(
    st.lists(st.one_of(GOOD_STOP, st.sampled_from(["", "x" * 257])), min_size=1, max_size=3),
    sized(GOOD_STOP, [65, 3000, FAR_PAST]),
)
GOOD_ID, BAD_ID = st.integers(0, 399), st.sampled_from([400, 401, 10**6, UINT32 - 1, UINT32])
IDS = st.lists(GOOD_ID, min_size=1, max_size=8)
BAD_IDS = st.one_of(
    st.lists(st.one_of(GOOD_ID, BAD_ID), max_size=8),
    sized(GOOD_ID, [0, 256, 600, FAR_PAST]),  # no prompt, past the context, far past it
)
STOP_IDS = st.one_of(st.lists(GOOD_ID, max_size=3), sized(GOOD_ID, [64]))
BAD_STOP_IDS = st.one_of(
    st.lists(BAD_ID, min_size=1, max_size=3), sized(GOOD_ID, [65, 2000, FAR_PAST])
)
NAN_INF = st.sampled_from([math.nan, math.inf, -math.inf])


def floats(low: float, high: float):
    """(good, bad): values in [low, high]; NaN, infinities, values outside, any float32."""
    good = st.one_of(st.sampled_from([low, high]), st.floats(low, high, width=32))
    outside = st.sampled_from([low - 1, high + 1, -1e38, 1e38, -FLOAT32_MAX, FLOAT32_MAX])
    return good, st.one_of(NAN_INF, outside, st.floats(width=32))


# ---- gRPC --------------------------------------------------------------------------------


def set_prompt(draw, field: Fields, request, kinds: list[str]) -> None:
    """One of `kinds` of prompt (text, chat, token_ids) on a Generate or Tokenize request,
    good or bad; now and then none."""
    prompt = field(st.sampled_from(kinds), st.just(None))
    if prompt == "text":
        request.text = field(GOOD_TEXT, BAD_TEXT)
    elif prompt == "chat":
        role = st.one_of(st.sampled_from(["system", "user", "assistant", "tool"]), st.text())
        good = st.lists(st.tuples(role, GOOD_TEXT), min_size=1, max_size=3)
        many = sized(st.tuples(st.just(""), st.just("")), [MAX_CHAT_MESSAGES + 1, FAR_PAST])
        messages = field(good, st.lists(st.tuples(role, TEXT), max_size=3) | many)
        request.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)
        request.chat.SetInParent()  # an empty chat is still "chat"
    elif prompt == "token_ids":
        request.token_ids.ids.extend(field(IDS, BAD_IDS))
        request.token_ids.SetInParent()


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    field = Fields(draw)
    request = pb.GenerateRequest()
    request.request_id = draw(st.one_of(st.just(""), st.text(max_size=8), st.just("r" * 5000)))
    set_prompt(draw, field, request, ["text", "chat", "token_ids"])
    uint = st.sampled_from([UINT32])
    fields = {
        "sampling": dict(
            n=(
                st.integers(1, 3) | st.just(64),
                st.sampled_from([0, 65, 10**6, 10**9, INT32, UINT32]),
            ),
            temperature=floats(0.0, 2.0),
            top_k=(st.integers(-1, 500) | st.just(INT32), st.sampled_from([-2, -INT32 - 1])),
            top_p=floats(2**-20, 1.0),
            min_p=floats(0.0, 1.0),
            repetition_penalty=floats(0.125, 2.0),
            presence_penalty=floats(-2.0, 2.0),
            frequency_penalty=floats(-2.0, 2.0),
            seed=(st.integers(-INT64 - 1, INT64) | st.sampled_from([-INT64 - 1, -1, INT64]), None),
        ),
        "stopping": dict(
            max_tokens=(st.integers(1, 8), st.sampled_from([0, 256, 300, INT32, UINT32])),
            min_tokens=(st.integers(0, 1), st.sampled_from([9, 300, INT32, UINT32])),
            ignore_eos=(st.booleans(), None),
            include_stop_str=(st.booleans(), None),
        ),
        "output": dict(
            logprobs=(st.integers(0, 20), st.sampled_from([21, 10**6, INT32]) | uint),
            prompt_logprobs=(st.integers(0, 20), st.sampled_from([21, 10**6, INT32]) | uint),
            skip_special_tokens=(st.booleans(), None),
        ),
    }
    for part, values in fields.items():
        message = getattr(request, part)
        for name, (good, bad) in values.items():
            value = field.maybe(good, bad)
            if value is not None:
                setattr(message, name, value)
    request.stopping.stop.extend(field(STOPS, BAD_STOPS))
    request.stopping.stop_token_ids.extend(field(STOP_IDS, BAD_STOP_IDS))
    request.priority = draw(st.one_of(st.integers(-3, 3), st.sampled_from([-INT32 - 1, INT32])))
    request.model = field(st.sampled_from(["", "tiny"]), st.sampled_from(["gpt-4", "tiny "]))
    return request


@st.composite
def tokenize_requests(draw) -> pb.TokenizeRequest:
    field = Fields(draw)
    request = pb.TokenizeRequest(add_special_tokens=draw(st.booleans()))
    set_prompt(draw, field, request, ["text", "chat"])
    return request


def fields_set(message, out: set[str]) -> set[str]:
    """The names of every field a message sets, at any depth (leaves and messages)."""
    for field, value in message.ListFields():
        out.add(field.name)
        if field.message_type is not None:
            for item in [value] if hasattr(value, "ListFields") else value:
                fields_set(item, out)
    return out


# The engine's name for a field -> the request's (gRPC) field it comes from. (A prompt's
# errors name the request's own text, chat.messages or token_ids.ids.)
GRPC_NAMES = {"include_stop_str_in_output": "include_stop_str"}
GRPC_ALWAYS = {"prompt", "max_tokens"}  # required, or bounded by the context even when unset


def check_grpc_refusal(request, err: grpc.aio.AioRpcError, always: set[str] = GRPC_ALWAYS) -> str:
    """Checks a refused Generate (or Tokenize: always={"input"}, its oneof); returns the code."""
    code, details = err.code(), err.details()
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field = named_field(details)
        given = fields_set(request, set()) | always
        assert GRPC_NAMES.get(field, field) in given, (field, details, request)
    elif code == grpc.StatusCode.NOT_FOUND:
        model = getattr(request, "model", "")  # a TokenizeRequest names none
        assert model not in ("", "tiny") and details.startswith("model:"), details
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the request, or a unary answer
        too_big = request.ByteSize() > MAX_MESSAGE_BYTES
        assert too_big or details.startswith("response:"), details
    else:
        raise AssertionError(f"{code.name} for a bad request: {details}\n{request}")
    return code.name


def check_grpc_candidates(request: pb.GenerateRequest, candidates: dict[int, list]) -> None:
    """A success: every candidate finished normally with in-vocab tokens, within max_tokens."""
    n = request.sampling.n if request.sampling.HasField("n") else 1
    assert sorted(candidates) == list(range(n))
    for token_ids, finish_reason in candidates.values():
        assert finish_reason not in (pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_ERROR)
        assert all(0 <= t < 400 for t in token_ids)
        if request.stopping.HasField("max_tokens"):
            assert len(token_ids) <= request.stopping.max_tokens


@FUZZ
@given(request=generate_requests(), streamed=st.booleans())
async def test_grpc_generate_fuzz(doors, request, streamed):
    await grpc_generate_case(doors, request, streamed)


async def grpc_generate_case(doors: Doors, request: pb.GenerateRequest, streamed: bool) -> None:
    metadata = tuple(AUTH.items())
    door = "gRPC StreamGenerate" if streamed else "gRPC Generate"
    if doors.core is None:
        door += " (engine process)"
    try:
        if streamed:
            candidates: dict[int, list] = {}
            call = doors.stub.StreamGenerate(request, metadata=metadata, timeout=TIMEOUT)
            async for message in call:
                tokens, _ = candidates.setdefault(message.index, ([], 0))
                tokens.extend(message.token_ids)
                if message.finish_reason:
                    candidates[message.index] = (tokens, message.finish_reason)
        else:
            response = await doors.stub.Generate(request, metadata=metadata, timeout=TIMEOUT)
            candidates = {
                c.index: (list(c.token_ids), c.finish_reason) for c in response.candidates
            }
    except grpc.aio.AioRpcError as err:
        TRIED[door, check_grpc_refusal(request, err)] += 1
        return
    check_grpc_candidates(request, candidates)
    TRIED[door, "OK"] += 1


@settings(FUZZ, max_examples=60)
@given(request=tokenize_requests())
async def test_grpc_tokenize_fuzz(doors, request):
    try:
        response = await doors.stub.Tokenize(request, metadata=tuple(AUTH.items()), timeout=TIMEOUT)
    except grpc.aio.AioRpcError as err:
        TRIED["gRPC Tokenize", check_grpc_refusal(request, err, {"input"})] += 1
        return
    assert len(response.tokens) == len(response.token_ids)
    assert all(0 <= t < 400 for t in response.token_ids)
    if request.HasField("text"):  # add_special_tokens honoured
        tokenizer = doors.engine.tokenizer
        assert response.token_ids == tokenizer.encode(request.text, request.add_special_tokens)
    TRIED["gRPC Tokenize", "OK"] += 1


# Where raw_requests puts invalid UTF-8 -> the field the error must name.
UTF8_FIELDS = {
    "text": "text",
    "chat": "chat.messages.content",
    "stop": "stopping.stop",
    "request_id": "request_id",
    "model": "model",
}
RAW_FIELDS = {  # those of UTF8_FIELDS each RPC's request has; GetModelInfoRequest has none
    "Generate": sorted(UTF8_FIELDS),
    "StreamGenerate": sorted(UTF8_FIELDS),
    "Tokenize": ["chat", "text"],
    "GetModelInfo": [],
}


@st.composite
def raw_requests(draw, method: str = "Generate") -> tuple[bytes, str | None]:
    """Bytes no protobuf client would send: invalid UTF-8 in a string field (and the field
    the refusal must name), wire-format garbage, truncated messages."""
    kind = draw(st.sampled_from(["bad_utf8", "garbage", "truncated"]))
    if kind == "garbage" or not RAW_FIELDS[method]:
        return draw(st.binary(max_size=64)), None
    marker = "qq"
    if method == "Tokenize":
        request = pb.TokenizeRequest(add_special_tokens=True)
    else:
        request = pb.GenerateRequest(stopping=pb.StoppingOptions(max_tokens=2))
    where = draw(st.sampled_from(RAW_FIELDS[method]))
    if where == "text":
        request.text = marker
    elif where == "chat":
        request.chat.messages.add(role="user", content=marker)
    elif where == "stop":
        request.text = "hi"
        request.stopping.stop.append(marker)
    else:
        request.text = "hi"
        setattr(request, where, marker)
    data = request.SerializeToString()
    if kind == "truncated":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))], None
    bad = draw(st.sampled_from([b"\xff\xfe", b"\xc3(", b"\xed\xa0", b"\xf8\x88"]))
    return data.replace(marker.encode(), bad), UTF8_FIELDS[where]  # same length: still parses


def rpc_counts(doors: Doors, rpc: str) -> collections.Counter[str]:
    """pagedserve_requests_total of one RPC, by status code."""
    (family,) = doors.srv.door.metrics.requests.collect()
    samples = [s for s in family.samples if s.name.endswith("_total") and s.labels["rpc"] == rpc]
    return collections.Counter({s.labels["code"]: s.value for s in samples})


async def settled_rpc_counts(doors: Doors, rpc: str) -> collections.Counter[str]:
    """rpc_counts once the last case's handler has counted it: an aborted RPC's status can
    reach the client before its handler's count (same event loop: a few turns settle it)."""
    seen = rpc_counts(doors, rpc)
    for _ in range(50):
        await asyncio.sleep(0.02)
        now = rpc_counts(doors, rpc)
        if now == seen:
            return now
        seen = now
    return seen


async def raw_case(doors: Doors, door: str, method: str, data: bytes, bad_field: str | None):
    """Sends request bytes as they are; checks the answer, and that the RPC metric counted
    it once, under its own name and code."""
    counted = await settled_rpc_counts(doors, method)
    path = f"/{SERVICE_NAME}/{method}"
    make = doors.channel.unary_stream if method == "StreamGenerate" else doors.channel.unary_unary
    call = make(path, request_serializer=None, response_deserializer=None)
    try:
        result = call(data, metadata=tuple(AUTH.items()), timeout=TIMEOUT)
        if method == "StreamGenerate":
            [m async for m in result]
        else:
            await result
        code = "OK"  # some byte strings are valid requests
    except grpc.aio.AioRpcError as err:
        # Garbage and truncated bytes may parse into any request, e.g. for another model.
        code, details = err.code().name, err.details()
        assert code == "INVALID_ARGUMENT" or (
            code == "NOT_FOUND" and details.startswith("model: ")
        ), (code, details, data)
        named_field(details)
        assert bad_field is None or details.startswith(f"{bad_field}: "), details
    assert await settled_rpc_counts(doors, method) - counted == {code: 1}, (method, code, data)
    TRIED[door, code] += 1


@settings(FUZZ, max_examples=200)  # cheap: every case is refused before the engine
@given(case=raw_requests(), method=st.sampled_from(["Generate", "StreamGenerate"]))
async def test_grpc_raw_bytes_fuzz(doors, case, method):
    await raw_case(doors, "gRPC raw bytes", method, *case)


@settings(FUZZ, max_examples=60)
@given(
    case=st.sampled_from(["Tokenize", "GetModelInfo"]).flatmap(
        lambda method: st.tuples(st.just(method), raw_requests(method))
    )
)
async def test_grpc_raw_bytes_tokenize_fuzz(doors, case):
    method, (data, bad_field) = case
    await raw_case(doors, "gRPC raw bytes Tokenize, GetModelInfo", method, data, bad_field)


# ---- REST --------------------------------------------------------------------------------

FLOAT = st.one_of(st.floats(), NAN_INF)
JSON_ANY = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), FLOAT, st.text(max_size=6)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=5,
)
BIG_INT = st.sampled_from(
    [-(2**70), -(2**63) - 1, -(2**63), -1, 2**31, UINT32, INT64, 2**63, 2**70, 10**12]
)
HUGE_FLOAT = st.sampled_from([1e308, -1e308, 1e39])  # finite in JSON, infinite in float32
# JSON can spell what is no text: lone UTF-16 surrogates ("\ud800" escapes).
SURROGATES = st.sampled_from(["\ud800", "x\udc00y", "🙂\ud83d"])
REST_BAD_TEXT = BAD_TEXT | SURROGATES
REST_BAD_ID = st.one_of(BAD_ID, BIG_INT)


def rest(good, bad=None):
    """(good, bad) for a body field: bad adds any JSON value (a wrong type, mostly)."""
    return good, JSON_ANY if bad is None else st.one_of(bad, JSON_ANY)


def rest_floats(low: float, high: float):
    good, bad = floats(low, high)
    good = st.one_of(good, st.integers(math.ceil(low), math.floor(high)))
    return rest(good, bad | BIG_INT | HUGE_FLOAT)


COMMON_FIELDS = dict(
    model=rest(st.sampled_from(["tiny"]), st.sampled_from(["gpt-4", ""])),
    n=rest(st.integers(1, 3), st.sampled_from([0, -1, 65, 10**9, 1e308]) | BIG_INT),
    stop=rest(GOOD_STOP | STOPS, BAD_STOPS | SURROGATES),
    temperature=rest_floats(0.0, 2.0),
    top_p=rest_floats(2**-20, 1.0),
    seed=rest(st.integers(-INT64 - 1, INT64), BIG_INT),
    presence_penalty=rest_floats(-2.0, 2.0),
    frequency_penalty=rest_floats(-2.0, 2.0),
    stream=rest(st.booleans()),
    stream_options=rest(st.fixed_dictionaries({"include_usage": st.booleans()})),
    logit_bias=rest(st.just({}), st.just({"1": 5.0})),
    user=rest(st.text(max_size=8)),
    top_k=rest(st.integers(-1, 500), st.integers(-5, -2) | BIG_INT),
    min_p=rest_floats(0.0, 1.0),
    repetition_penalty=rest_floats(0.125, 2.0),
    min_tokens=rest(st.integers(0, 1), st.sampled_from([9, 300]) | BIG_INT),
    ignore_eos=rest(st.booleans()),
    stop_token_ids=rest(STOP_IDS, BAD_STOP_IDS | st.lists(REST_BAD_ID, min_size=1, max_size=2)),
    include_stop_str_in_output=rest(st.booleans()),
    skip_special_tokens=rest(st.booleans()),
    priority=rest(st.integers(-2, 2), BIG_INT),
)
COMPLETION_FIELDS = dict(
    COMMON_FIELDS,
    prompt=rest(
        st.one_of(GOOD_TEXT, st.lists(GOOD_TEXT, min_size=1, max_size=3), IDS),
        st.one_of(
            REST_BAD_TEXT,
            st.lists(REST_BAD_TEXT, min_size=1, max_size=2),
            BAD_IDS,
            st.lists(REST_BAD_ID, min_size=1, max_size=3),
            st.lists(st.lists(GOOD_ID | REST_BAD_ID, max_size=4), max_size=3),
            sized(st.just("hi"), [100, MAX_PROMPTS + 1, FAR_PAST]),  # past the queue, the limit
        ),
    ),
    max_tokens=rest(st.integers(1, 8), st.sampled_from([-1, 0, 256, 300, 10**6]) | BIG_INT),
    echo=rest(st.booleans()),
    logprobs=rest(st.integers(0, 20), st.sampled_from([-1, 21]) | BIG_INT),
    best_of=rest(st.just(1), st.integers(0, 3)),
    suffix=rest(st.just(""), st.text(min_size=1, max_size=4)),
)
ROLE = rest(st.sampled_from(["system", "user", "assistant", "tool"]))
CONTENT = rest(
    st.one_of(
        GOOD_TEXT,
        st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": GOOD_TEXT}), max_size=2),
    ),
    st.one_of(REST_BAD_TEXT, st.none(), st.lists(st.fixed_dictionaries({"type": st.text()}))),
)


@st.composite
def chat_messages(draw, field: Fields) -> list:
    messages = []
    for _ in range(draw(st.integers(1, 3))):
        message = {"role": field(*ROLE), "content": field(*CONTENT)}
        if field(st.just(False), st.booleans()):
            del message[draw(st.sampled_from(["role", "content"]))]
        extra = st.sampled_from(["name", "tool_call_id", "x"])
        message |= draw(st.dictionaries(extra, JSON_ANY | SURROGATES, max_size=2))
        messages.append(message)
    return messages


CHAT_FIELDS = dict(
    COMMON_FIELDS,
    messages=None,  # chat_messages()
    max_tokens=COMPLETION_FIELDS["max_tokens"],
    max_completion_tokens=COMPLETION_FIELDS["max_tokens"],
    logprobs=rest(st.booleans()),
    top_logprobs=rest(st.integers(0, 20), st.sampled_from([-1, 21]) | BIG_INT),
    tools=rest(st.just([]), st.just([{"type": "function"}])),
    response_format=rest(st.just({"type": "text"}), st.sampled_from([{"type": "json"}, {}])),
)
TOKENIZE_FIELDS = dict(  # /tokenize: text that cannot fit the context is refused, as for prompts
    model=COMMON_FIELDS["model"],
    prompt=rest(GOOD_TEXT, REST_BAD_TEXT),
    add_special_tokens=rest(st.booleans()),
)
DETOKENIZE_FIELDS = dict(
    model=COMMON_FIELDS["model"],
    tokens=rest(
        st.one_of(IDS, sized(GOOD_ID, [0, 600])),
        st.lists(st.one_of(GOOD_ID, REST_BAD_ID), min_size=1, max_size=4),
    ),
)
REQUIRED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
KNOWN_KEYS = {*COMPLETION_FIELDS, *CHAT_FIELDS, *TOKENIZE_FIELDS, *DETOKENIZE_FIELDS}
UNKNOWN_KEYS = st.text(min_size=1, max_size=8).filter(lambda k: k not in KNOWN_KEYS)


def unknown_fields(draw, field: Fields) -> dict:
    """Now and then a field or two the API does not know: they are ignored."""
    if field(st.just(False), st.just(True)):
        return draw(st.dictionaries(UNKNOWN_KEYS, JSON_ANY, min_size=1, max_size=2))
    return {}


@st.composite
def rest_bodies(draw, path: str) -> dict:
    field = Fields(draw)
    chat = path == "/v1/chat/completions"
    body = {}
    if chat:
        messages = sized(st.just({"role": "u", "content": ""}), [300, MAX_CHAT_MESSAGES + 1])
        body["messages"] = field(chat_messages(field), st.one_of(JSON_ANY, messages))
    for name, values in (CHAT_FIELDS if chat else COMPLETION_FIELDS).items():
        if name == "messages":
            continue
        # Few fields are sent; max_tokens mostly is, so that a success stays short.
        if name in ("prompt", "max_tokens") or draw(st.integers(0, 4)) == 0:
            value = field(*values)
            if name == "max_tokens" and field(st.just(False), st.booleans()):
                continue  # unset: 16 for completions, up to the context for chat
            body[name] = value
    return body | unknown_fields(draw, field)


@st.composite
def token_bodies(draw, path: str) -> dict:
    """/tokenize: a prompt or chat messages (now and then both, or neither); /detokenize:
    token ids (now and then none). Each other field half the time."""
    field = Fields(draw)
    if path == "/tokenize":
        fields = dict(TOKENIZE_FIELDS, messages=(chat_messages(field), JSON_ANY))
        good = st.sampled_from([("prompt",), ("messages",)])
        sent = field(good, st.sampled_from([(), ("prompt", "messages")]))
    else:
        fields, sent = DETOKENIZE_FIELDS, field(st.just(("tokens",)), st.just(()))
    body = {}
    for name, values in fields.items():
        optional = name not in ("prompt", "messages", "tokens")
        if name in sent or (optional and draw(st.booleans())):
            body[name] = field(*values)
    return body | unknown_fields(draw, field)


# Fields a 400 may name though the body left them out: required, or (max_tokens: 16 by
# default for completions) bounded by the context anyway; "body" for the body as a whole.
REST_ALWAYS = {
    "/v1/completions": {"prompt", "max_tokens", "body"},
    "/v1/chat/completions": {"messages", "body"},
    "/tokenize": {"prompt", "body"},  # "prompt: give exactly one of prompt, messages"
    "/detokenize": {"tokens", "body"},
}


def rest_answer(path: str, body: dict, sent: bytes, headers: dict, response: httpx.Response) -> str:
    """Checks one REST answer against the request; returns how it was answered."""
    status = response.status_code
    assert status != 500 and status in (200, 400, 401, 404, 413, 429), (status, response.text)
    if status != 200:
        error = response.json()["error"]  # OpenAI's envelope, always
        assert error["message"] and error["type"], error
    if headers.get("authorization") != AUTH["authorization"]:
        assert status in (401, 400, 413), (status, response.text)  # never served without the key
        return str(status)
    assert status != 401
    if status == 400:
        field = named_field(error["message"])
        assert error["param"] is not None and error["message"].startswith(error["param"] + ":")
        assert field in set(body) | REST_ALWAYS[path], (field, error["message"], body)
    elif status == 404:
        assert body.get("model") not in (None, "", "tiny") and error["param"] == "model"
    elif status == 413:
        assert len(sent) > MAX_MESSAGE_BYTES and error["param"] == "body"
    elif status == 429:
        assert isinstance(body.get("prompt"), list) and len(body["prompt"]) > 1, error
    elif path == "/tokenize":
        result = response.json()
        assert result["count"] == len(result["tokens"]) and result["max_model_len"] == CONTEXT
        assert all(0 <= t < 400 for t in result["tokens"]), result
    elif path == "/detokenize":
        assert isinstance(response.json()["prompt"], str)
    elif body.get("stream") is True:
        events = [line for line in response.text.split("\n\n") if line]
        assert events[-1] == "data: [DONE]", events[-3:]
        for event in events[:-1]:
            assert event.startswith("data: ") and "error" not in json.loads(event[6:]), event
    else:
        result = response.json()
        prompts = body[REQUIRED[path]]
        many = path == "/v1/completions" and isinstance(prompts, list) and prompts
        many = many and not isinstance(prompts[0], int)
        n = body.get("n", 1)
        assert len(result["choices"]) == n * (len(prompts) if many else 1), result
        assert all(c["finish_reason"] in ("length", "stop") for c in result["choices"]), result
    return str(status)


NO_KEY = [{}, {"authorization": "Bearer nope"}, {"authorization": "Bearer"}]
HEADERS = st.sampled_from([AUTH] * 5 + NO_KEY)  # the right key 5 times in 8


def dumps(body) -> bytes:
    # json.dumps writes NaN and Infinity, as many clients do; the server must refuse them.
    return json.dumps(body, allow_nan=True).encode()


async def rest_case(doors: Doors, path: str, body: dict, headers: dict) -> None:
    sent = dumps(body)
    headers = {"content-type": "application/json", **headers}
    response = await doors.http.post(path, content=sent, headers=headers)
    door = f"REST {path}" + (" (engine process)" if doors.core is None else "")
    TRIED[door, rest_answer(path, body, sent, headers, response)] += 1


@FUZZ
@given(body=rest_bodies("/v1/completions"), headers=HEADERS)
async def test_rest_completions_fuzz(doors, body, headers):
    await rest_case(doors, "/v1/completions", body, headers)


@FUZZ
@given(body=rest_bodies("/v1/chat/completions"), headers=HEADERS)
async def test_rest_chat_fuzz(doors, body, headers):
    await rest_case(doors, "/v1/chat/completions", body, headers)


GENERATION_CASES = st.one_of(
    st.tuples(st.just("gRPC"), generate_requests(), st.booleans()),
    *(st.tuples(st.just(path), rest_bodies(path), HEADERS) for path in sorted(REQUIRED)),
)


@settings(FUZZ, max_examples=80)
@given(case=GENERATION_CASES)
@pytest.mark.parametrize("doors", [True], indirect=True, ids=["engine-process"])
async def test_generation_fuzz_with_the_engine_in_its_own_process(doors, case):
    """Generate / StreamGenerate and both REST generation paths, the engine in a child
    process: a request's sizes and values reach it pickled, and must sink neither process."""
    door, request, extra = case
    if door == "gRPC":
        await grpc_generate_case(doors, request, extra)
    else:
        await rest_case(doors, door, request, extra)


@settings(FUZZ, max_examples=120)  # about 60 a path
@given(
    case=st.sampled_from(["/tokenize", "/detokenize"]).flatmap(
        lambda path: st.tuples(st.just(path), token_bodies(path))
    ),
    headers=HEADERS,
)
async def test_rest_tokenize_fuzz(doors, case, headers):
    await rest_case(doors, *case, headers)


@st.composite
def raw_bodies(draw) -> bytes:
    """Bodies that are not a JSON object, or not JSON, or not UTF-8, or over the limit."""
    kind = draw(st.sampled_from(["bytes", "json_value", "bad_utf8", "truncated", "huge"]))
    if kind == "bytes":
        return draw(st.binary(max_size=40))
    if kind == "json_value":
        return dumps(draw(JSON_ANY))
    good = dumps(
        {"prompt": "hello", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    if kind == "bad_utf8":
        return good.replace(b"hello", draw(st.sampled_from([b"\xff", b"\xc3(", b"\xed\xa0\x80"])))
    if kind == "truncated":
        return good[: draw(st.integers(0, len(good) - 1))]
    size = draw(st.sampled_from([MAX_MESSAGE_BYTES + 1, 3 * MAX_MESSAGE_BYTES]))
    return dumps({"prompt": "x" * size, "max_tokens": 2})


@settings(FUZZ, max_examples=100)
@given(
    data=raw_bodies(),
    path=st.sampled_from([*sorted(REQUIRED), "/tokenize", "/detokenize"]),
    content_type=st.sampled_from(["application/json", "text/plain", ""]),
    chunked=st.booleans(),
)
async def test_rest_raw_body_fuzz(doors, data, path, content_type, chunked):
    headers = dict(AUTH) | ({"content-type": content_type} if content_type else {})

    async def chunks():  # no Content-Length: the limit must hold while reading
        for start in range(0, len(data), 65536):
            yield data[start : start + 65536]

    content = chunks() if chunked else data
    response = await doors.http.post(path, content=content, headers=headers)
    status = response.status_code
    assert status in (200, 400, 413), (status, response.text, data[:200])
    if status != 200:
        error = response.json()["error"]
        named_field(error["message"])
    if status == 413:
        assert len(data) > MAX_MESSAGE_BYTES
    if len(data) > MAX_MESSAGE_BYTES:
        assert status == 413, response.text
    TRIED["REST raw bodies", str(status)] += 1
