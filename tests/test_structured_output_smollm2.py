"""Structured output and tool calls on the embedded default model (SmolLM2-135M-Instruct),
served by `pagedserve serve` as a real process and driven only from outside with the
official openai client and the generated gRPC stubs.

Every answer keeps to its constraint, greedy and sampled: each of the JSON schemas in
tests/json_schemas.py parses and validates, and ends with "stop" (a whole document, not one
cut off by max_tokens); each regex matches in full; a choice comes back as exactly one of
the choices; the client's pydantic parse gets an instance; a forced tool call carries
arguments that validate against the tool's parameters, streams as deltas that add up to the
unary call, and once its result is sent back the model answers in text.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from tests.json_schemas import REGEXES, SCHEMAS
from tests.server_process import ServerProcess, free_port, start_server_process

pytestmark = pytest.mark.slow

MAX_TOKENS = 300
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=0.8, seed=1234, n=2)
COLORS = ["red", "green", "blue", "purple"]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


class Pet(BaseModel):
    name: str = Field(max_length=20)
    species: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def served(smollm2_gguf) -> tuple[ServerProcess, int]:
    port = free_port()
    server = start_server_process(
        smollm2_gguf, "--http-port", str(port), "--http-host", "127.0.0.1", "--max-num-seqs", "64"
    )
    try:
        server.wait_ready(timeout=300)
        yield server, port
    finally:
        server.stop()


@pytest.fixture
async def client(served):
    _, port = served
    client = openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=300
    )
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def model(client) -> str:
    """The served model's id, as the server lists it."""
    return (await client.models.list()).data[0].id


@pytest.fixture
async def stub(served):
    server, _ = served
    async with grpc.aio.insecure_channel(server.target) as channel:
        yield inference_pb2_grpc.InferenceStub(channel)


def ask(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def grpc_request(prompt: str, temperature: float, n: int = 1, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
        sampling=pb.SamplingOptions(temperature=temperature, seed=1234, n=n),
        stopping=pb.StoppingOptions(max_tokens=MAX_TOKENS),
        **fields,
    )


async def test_every_schema_validates_greedy_and_sampled(client, model) -> None:
    async def one(index: int, sampling: dict):
        prompt, schema = SCHEMAS[index]
        answer = await client.chat.completions.create(
            model=model,
            messages=ask(f"{prompt} Answer in JSON."),
            response_format={
                "type": "json_schema",
                "json_schema": {"name": f"schema_{index}", "schema": schema},
            },
            max_tokens=MAX_TOKENS,
            **sampling,
        )
        return index, sampling, answer

    answers = await asyncio.gather(
        *(one(i, s) for i in range(len(SCHEMAS)) for s in (GREEDY, SAMPLED))
    )
    failures = []
    for index, sampling, answer in answers:
        assert len(answer.choices) == sampling.get("n", 1)
        for choice in answer.choices:
            content, reason = choice.message.content, choice.finish_reason
            where = f"schema {index} {sampling}: {content!r}"
            if reason != "stop":
                failures.append(f"{where}: finish_reason {reason}")
                continue
            try:
                jsonschema.validate(json.loads(content), SCHEMAS[index][1])
            except (ValueError, jsonschema.ValidationError) as error:
                failures.append(f"{where}: {error}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("door", ["completions", "chat"])
async def test_every_regex_matches_in_full_on_rest(client, model, door) -> None:
    async def one(prompt: str, pattern: str, sampling: dict):
        extra = {"structured_outputs": {"regex": pattern}}
        if door == "completions":
            answer = await client.completions.create(
                model=model, prompt=prompt, max_tokens=MAX_TOKENS, extra_body=extra, **sampling
            )
            texts = [c.text for c in answer.choices]
        else:
            answer = await client.chat.completions.create(
                model=model,
                messages=ask(prompt),
                max_tokens=MAX_TOKENS,
                extra_body=extra,
                **sampling,
            )
            texts = [c.message.content for c in answer.choices]
        reasons = [c.finish_reason for c in answer.choices]
        return pattern, sampling, texts, reasons

    answers = await asyncio.gather(*(one(p, r, s) for p, r in REGEXES for s in (GREEDY, SAMPLED)))
    for pattern, sampling, texts, reasons in answers:
        assert len(texts) == sampling.get("n", 1)
        for text, reason in zip(texts, reasons):
            assert re.fullmatch(pattern, text), (pattern, sampling, text)
            assert reason == "stop", (pattern, sampling, text, reason)


async def test_every_regex_matches_in_full_on_grpc(stub) -> None:
    requests = [
        grpc_request(prompt, temperature, n, regex=pattern)
        for prompt, pattern in REGEXES
        for temperature, n in ((0.0, 1), (0.8, 2))
    ]
    answers = await asyncio.gather(*(stub.Generate(r) for r in requests))
    for request, answer in zip(requests, answers):
        assert len(answer.candidates) == request.sampling.n
        for candidate in answer.candidates:
            assert re.fullmatch(request.regex, candidate.text), (request.regex, candidate.text)
            assert candidate.finish_reason == pb.FINISH_REASON_EOS, candidate


async def test_a_choice_is_exactly_one_of_the_choices_on_both_doors(client, model, stub) -> None:
    prompt = "Which color is the sky? Answer with one word."
    rest = [
        client.chat.completions.create(
            model=model,
            messages=ask(prompt),
            max_tokens=MAX_TOKENS,
            extra_body={"structured_outputs": {"choice": COLORS}},
            **sampling,
        )
        for sampling in (GREEDY, dict(temperature=1.0, seed=7, n=4))
    ]
    grpc_calls = [
        stub.Generate(grpc_request(prompt, t, n, choice=pb.Choices(choices=COLORS)))
        for t, n in ((0.0, 1), (1.0, 4))
    ]
    greedy, sampled, grpc_greedy, grpc_sampled = await asyncio.gather(*rest, *grpc_calls)
    assert len(sampled.choices) == 4 and len(grpc_sampled.candidates) == 4
    for choice in [*greedy.choices, *sampled.choices]:
        assert choice.message.content in COLORS, choice
        assert choice.finish_reason == "stop"
    for candidate in [*grpc_greedy.candidates, *grpc_sampled.candidates]:
        assert candidate.text in COLORS, candidate
        assert candidate.finish_reason == pb.FINISH_REASON_EOS


async def test_the_openai_client_parses_a_pydantic_model(client, model) -> None:
    completion = await client.chat.completions.parse(
        model=model,
        messages=ask("Describe a pet in JSON."),
        response_format=Pet,
        max_tokens=MAX_TOKENS,
        **GREEDY,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Pet)
    assert choice.message.parsed == Pet.model_validate_json(choice.message.content)


async def test_a_forced_tool_call_round_trip_ends_in_text(client, model) -> None:
    messages = ask("What is the weather in Paris?")
    call_ask = dict(
        model=model,
        messages=messages,
        tools=[WEATHER],
        tool_choice=FORCE_WEATHER,
        max_tokens=MAX_TOKENS,
        **GREEDY,
    )
    unary = await client.chat.completions.create(**call_ask)
    choice = unary.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls), calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)

    # The same request streamed: the deltas add up to the unary calls, name and arguments.
    rebuilt: dict[int, list[str]] = {}
    finish = None
    async for chunk in await client.chat.completions.create(stream=True, **call_ask):
        for streamed in chunk.choices:
            for delta in streamed.delta.tool_calls or []:
                piece = rebuilt.setdefault(delta.index, ["", ""])
                piece[0] += (delta.function.name or "") if delta.function else ""
                piece[1] += (delta.function.arguments or "") if delta.function else ""
            finish = streamed.finish_reason or finish
    assert finish == "tool_calls"
    assert [tuple(v) for _, v in sorted(rebuilt.items())] == [
        (c.function.name, c.function.arguments) for c in calls
    ]

    results = [
        {"role": "tool", "tool_call_id": c.id, "content": '{"celsius": 18, "condition": "rain"}'}
        for c in calls
    ]
    history = [*messages, choice.message.model_dump(exclude_none=True), *results]
    answer = await client.chat.completions.create(
        model=model,
        messages=history,
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=MAX_TOKENS,
        **GREEDY,
    )
    reply = answer.choices[0]
    assert reply.message.tool_calls is None, reply
    assert isinstance(reply.message.content, str) and reply.message.content.strip(), reply
    assert reply.finish_reason == "stop", reply
