"""Constraints past what a grammar's parser can follow: a request whose grammar compiles
but that its parser gives up on (its limits), or whose work for a token keeps growing (an
ambiguous grammar), fails on every door with an error that names the constraint's field,
the caller's fault (INVALID_ARGUMENT / 400), never an answer outside its constraint; the
log says which request, and none of its content; the other callers keep their pace.

`pagedserve serve` with the embedded default model, as a real process, driven from outside
with the generated gRPC stubs and raw HTTP.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx2 as httpx
import pytest

from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from tests.reliability.pace import PaceProbe
from tests.server_process import ServerProcess, free_port, start_server_process

# 5,001 alternatives: it compiles, and its parser's row of items (5,002, its limit 2,000)
# is too wide the moment a token is taken.
WIDE_ALTERNATIVES = [f"a{i}" for i in range(5001)]
WIDE_GRAMMAR = "start: " + " | ".join(f'"{a}"' for a in WIDE_ALTERNATIVES)
WIDE_GAVE_UP = "the grammar's parser gave up after 1 tokens (Current row has 5002 items"
# Every string of a and b, each in exponentially many ways: its masks cost milliseconds a
# few dozen tokens in, then hundreds (seconds before its parser gives up, past 175 tokens).
AMBIGUOUS_GRAMMAR = 'start: s\ns: s s s | s s | "a" | "b"'
STEP_LIMIT = 0.05  # grammar_step_timeout's default
# The attacker is a request the server generates for, so the pace it is held to is the
# pace beside an ordinary request as long as the attack lasts (70-90 tokens): what is left
# is the grammar's own cost. On two CPU cores an ordinary neighbour alone costs a normal
# request 1.6x its unloaded pace; the attack measured 1.13-1.19x of that.
NEIGHBOUR_TOKENS = 80
MAX_ATTACK_RATIO = 1.5


@pytest.fixture(scope="module")
def served(smollm2_gguf) -> tuple[ServerProcess, int]:
    http_port = free_port()
    server = start_server_process(smollm2_gguf, "--http-port", str(http_port))
    try:
        server.wait_ready(timeout=300)
        yield server, http_port
    finally:
        server.stop()


def grammar_request(grammar: str, max_tokens: int, seed: int = 0) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text="Pick one:",
        sampling=pb.SamplingOptions(temperature=1.0, seed=seed),
        stopping=pb.StoppingOptions(max_tokens=max_tokens),
        grammar=grammar,
    )


async def test_a_grammar_past_its_parsers_limits_fails_by_its_field_on_every_door(served):
    server, http_port = served
    logged_before = len(server.stderr())
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = grammar_request(WIDE_GRAMMAR, 20)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Generate(request)
        assert unary.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert unary.value.details().startswith(f"grammar: {WIDE_GAVE_UP}"), unary.value.details()
        assert unary.value.details().endswith("); simplify it")

        streamed = ""
        with pytest.raises(grpc.aio.AioRpcError) as stream:
            async for message in stub.StreamGenerate(request):
                streamed += message.text
                assert not message.finish_reason, message  # no ending but the error
        assert stream.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stream.value.details() == unary.value.details()

    field = "structured_outputs.grammar"
    body = {
        "prompt": "Pick one:",
        "max_tokens": 20,
        "temperature": 1.0,
        "structured_outputs": {"grammar": WIDE_GRAMMAR},
    }
    base = f"http://127.0.0.1:{http_port}/v1"
    async with httpx.AsyncClient(base_url=base, timeout=120) as http:
        whole = await http.post("/completions", json=body)
        assert whole.status_code == 400, whole.text
        error = whole.json()["error"]
        assert error["param"] == field and error["type"] == "invalid_request_error", error
        assert error["message"].startswith(f"{field}: {WIDE_GAVE_UP}"), error

        chat = {k: v for k, v in body.items() if k != "prompt"}
        chat["messages"] = [{"role": "user", "content": "Pick one."}]
        events = []
        async with http.stream("POST", "/chat/completions", json={**chat, "stream": True}) as sse:
            assert sse.status_code == 200  # the stream had begun: its error comes as an event
            async for line in sse.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
        assert "[DONE]" not in events, events
        last = json.loads(events[-1])  # the error, then the stream ends
        assert last["error"]["param"] == field, events
        assert last["error"]["type"] == "invalid_request_error", events
        assert last["error"]["message"].startswith(f"{field}: {WIDE_GAVE_UP}"), events
        for chunk in map(json.loads, events[:-1]):
            assert all(c["finish_reason"] is None for c in chunk["choices"]), events

    # The log names the requests and none of their content: not the grammar, not the
    # parser's state with the tokens generated.
    await asyncio.sleep(0.5)  # the engine's lines of the last request
    logged = server.stderr()[logged_before:]
    for content in ('"a4999"', "a4999", "<state>", "<grammar>", "Tokens:"):
        assert content not in logged, logged[:2000]
    failures = [line for line in logged.splitlines() if "could not go on" in line]
    assert len(failures) == 4, logged[:2000]
    assert all(line.endswith("its constraint (grammar) could not go on") for line in failures[:2])
    assert len(logged) < 2000, logged[:2000]


async def test_an_ambiguous_grammar_fails_at_the_step_limit_and_others_keep_their_pace(served):
    """A request whose grammar's masks grow with every token, against normal callers: it
    fails, naming its field, once one token's mask takes longer than the step limit, long
    before its parser would give up; meanwhile an 8-token request keeps its p50 within
    1.5x of its p50 beside an ordinary request, and the readiness check answers within
    0.5 s."""
    server, _ = served
    neighbour = pb.GenerateRequest(
        text="Pick one:",
        sampling=pb.SamplingOptions(temperature=1.0, seed=0),
        stopping=pb.StoppingOptions(max_tokens=NEIGHBOUR_TOKENS, ignore_eos=True),
    )
    async with grpc.aio.insecure_channel(server.target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with PaceProbe(server.target) as beside_neighbour:
            await stub.Generate(neighbour, timeout=300)
        with PaceProbe(server.target) as probe:
            (attack,) = await asyncio.gather(
                stub.Generate(grammar_request(AMBIGUOUS_GRAMMAR, 250), timeout=300),
                return_exceptions=True,
            )
    probe.pace.assert_kept(beside_neighbour.pace, max_p50_ratio=MAX_ATTACK_RATIO)
    assert isinstance(attack, grpc.aio.AioRpcError), attack
    assert attack.code() == grpc.StatusCode.INVALID_ARGUMENT, attack.details()
    details = attack.details()
    assert details.startswith("grammar: the grammar took "), details
    assert details.endswith(f"past the limit of {STEP_LIMIT:g} s a token; simplify it"), details
