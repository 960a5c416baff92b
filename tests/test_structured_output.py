"""Structured output and tool calls through both doors, on a tiny random-weight model: the
constraint holds whatever the weights say, bad constraints are refused by field while
other requests go on, and forced tool calls come back in OpenAI's shapes."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import subprocess
import sys
from typing import Literal

import grpc
import httpx2 as httpx
import jsonschema
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import BaseModel, Field

from engine.core.runner import MAX_GRAPH_ROWS_PER_SEQ, ModelRunner
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.structured.constraints import Constraint
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.config import ServerConfig
from tests.json_schemas import FIXED_KEYS_SCHEMA, slow_schema
from tests.server_process import free_port, scrape_metrics, start_server_process
from tests.test_grpc_server import kv_back_to_zero, serving
from tests.tiny_models import write_tiny_model

# Bounded in every direction (no property beyond these), so even random weights must
# finish it within max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "admin"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
GREEDY = dict(model="tiny", temperature=0.0, max_tokens=120)


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    # A context that holds tool definitions in a 400-token vocabulary's many small tokens.
    directory = tmp_path_factory.mktemp("structured-tiny")
    return write_tiny_model(directory, "llama", max_position_embeddings=4096)


@pytest.fixture
async def doors(tiny_model):
    config = ServerConfig(grpc_port=0, http_port=0)
    async with serving(tiny_model, config, num_blocks=2048) as (srv, core, engine):
        base = f"http://127.0.0.1:{srv.http_port}/v1"
        client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
        try:
            yield client, inference_pb2_grpc.InferenceStub(channel), engine, base
        finally:
            await client.close()
            await channel.close()
    assert core.block_manager.num_used_blocks == 0


def greedy_grpc(max_tokens: int = 200, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        sampling=pb.SamplingOptions(temperature=0.0),
        stopping=pb.StoppingOptions(max_tokens=max_tokens),
        **fields,
    )


async def test_every_kind_of_constraint_holds_on_both_doors(doors) -> None:
    client, stub, _, _ = doors
    schema = await client.chat.completions.create(
        messages=[{"role": "user", "content": "a person"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        **GREEDY,
    )
    jsonschema.validate(json.loads(schema.choices[0].message.content), PERSON)
    assert schema.choices[0].finish_reason == "stop"

    # Any object: random weights may go on until max_tokens; what they wrote is an object's
    # start, and parses whenever they ended it.
    any_json = await client.completions.create(
        prompt="{", extra_body={"response_format": {"type": "json_object"}}, **GREEDY
    )
    assert any_json.choices[0].text.startswith("{")
    if any_json.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(any_json.choices[0].text), dict)

    regex = await stub.Generate(greedy_grpc(text="id", regex=r"[A-Z]{2}-[0-9]{3}"))
    assert regex.candidates[0].text[:2].isupper() and regex.candidates[0].text[2] == "-"
    assert len(regex.candidates[0].text) == 6

    choices = ["red", "green", "blue"]
    picked = await stub.Generate(greedy_grpc(text="color", choice=pb.Choices(choices=choices)))
    assert picked.candidates[0].text in choices
    assert picked.candidates[0].finish_reason == pb.FINISH_REASON_EOS

    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    ebnf = await client.completions.create(
        prompt="q", extra_body={"structured_outputs": {"grammar": grammar}}, **GREEDY
    )
    text = ebnf.choices[0].text
    assert text in ("yes", "no") or (text[:-1] == "maybe " and text[-1].isdigit())


async def test_a_schema_of_25000_choices_is_taken_by_both_doors(doors) -> None:
    # Both doors bound a schema by its size (MAX_SPEC_CHARS), not by how many entries its
    # JSON holds: REST once refused lists over 4,096 entries anywhere in a body.
    client, stub, _, _ = doors
    schema = {"enum": [f"v{i}" for i in range(25_000)]}
    rest = await client.completions.create(
        prompt="pick",
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "v", "schema": schema},
            }
        },
        **GREEDY,
    )
    assert json.loads(rest.choices[0].text) in schema["enum"]
    grpc_answer = await stub.Generate(greedy_grpc(text="pick", json_schema=json.dumps(schema)))
    assert json.loads(grpc_answer.candidates[0].text) in schema["enum"]


async def test_sampled_candidates_each_keep_to_the_schema(doors) -> None:
    client, *_ = doors
    answer = await client.chat.completions.create(
        messages=[{"role": "user", "content": "people"}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        model="tiny",
        n=3,
        temperature=1.0,
        seed=7,
        max_tokens=200,
    )
    documents = [json.loads(c.message.content) for c in answer.choices]
    for document in documents:
        jsonschema.validate(document, PERSON)
    assert len({json.dumps(d) for d in documents}) > 1  # each candidate its own matcher


async def test_the_openai_client_parses_a_pydantic_model(doors) -> None:
    client, *_ = doors
    completion = await client.chat.completions.parse(
        messages=[{"role": "user", "content": "who?"}], response_format=Person, **GREEDY
    )
    assert isinstance(completion.choices[0].message.parsed, Person)


async def test_a_cut_off_document_says_length(doors) -> None:
    client, *_ = doors
    answer = await client.chat.completions.create(
        messages=[{"role": "user", "content": "a person"}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        model="tiny",
        temperature=0.0,
        max_tokens=3,
    )
    assert answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= ["}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
    ],
)
async def test_bad_constraints_and_tools_are_400_naming_the_field(doors, body, param) -> None:
    client, _, engine, base = doors
    async with httpx.AsyncClient() as http:
        answer = await http.post(
            f"{base}/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "x"}], **body},
        )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert param in error["message"] or error["param"] == param, error
    # Nothing else broke: the next request is answered, and no KV block is held.
    fine = await client.completions.create(prompt="fine", max_tokens=3, model="tiny")
    assert fine.choices[0].finish_reason == "length"
    await kv_back_to_zero(engine)


@pytest.mark.parametrize(
    "fields, name",
    [
        ({"json_schema": '{"type": "object", "properties": 3}'}, "json_schema"),
        ({"json_schema": "{not json"}, "json_schema"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "root ::= ["}, "grammar"),
        ({"choice": pb.Choices()}, "choice.choices"),
        ({"json_object": False}, "json_object"),
    ],
)
async def test_bad_constraints_are_invalid_argument_naming_the_field(doors, fields, name) -> None:
    _, stub, engine, _ = doors
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(greedy_grpc(text="x", **fields))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{name}:"), caught.value.details()
    await kv_back_to_zero(engine)


async def test_schemas_that_build_past_their_limit_hold_only_the_compile_threads(
    tiny_model,
) -> None:
    """Two schemas whose grammars build for seconds, past a 0.3 s limit, take both compile
    threads. Each is refused at its limit, naming its field. While they build on: a free
    request runs to its end and health answers; a constraint that finds no thread free in
    its time is told to retry (RESOURCE_EXHAUSTED / 429), not that it is too slow; a caller
    who leaves while its constraint waits for a thread costs no build. Once the builds end,
    constraints compile again."""
    config = ServerConfig(grpc_port=0, http_port=0)
    limit = dict(grammar_compile_timeout=0.3, num_blocks=2048)
    async with serving(tiny_model, config, **limit) as (srv, core, engine):
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
        stub = inference_pb2_grpc.InferenceStub(channel)
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.http_port}")
        try:
            slow = [greedy_grpc(text="x", json_schema=slow_schema(8000, n)) for n in "ab"]
            refused = await asyncio.gather(*map(stub.Generate, slow), return_exceptions=True)
            for error in refused:
                assert isinstance(error, grpc.aio.AioRpcError), error
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error.details() == "json_schema: did not compile within 0.3 s; simplify it"

            # The builds go on (each takes seconds); the engine and the event loop too.
            free = await stub.Generate(greedy_grpc(text="free", max_tokens=16))
            assert len(free.candidates[0].token_ids) == 16
            health = health_pb2_grpc.HealthStub(channel)
            status = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert status.status == health_pb2.HealthCheckResponse.SERVING

            busy = "no grammar compile thread was free for 0.3 s"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(greedy_grpc(text="x", regex="[0-9]+"))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "retry-after-ms" in dict(caught.value.trailing_metadata())
            assert (
                caught.value.details()
                == f"regex: {busy} (other constraints' builds hold them); retry later"
            )
            body = {"model": "tiny", "prompt": "x", "max_tokens": 4}
            answer = await http.post(
                "/v1/completions", json={**body, "structured_outputs": {"regex": "[0-9]+"}}
            )
            assert answer.status_code == 429 and "Retry-After" in answer.headers, answer.text
            assert busy in answer.json()["error"]["message"]
            # Gone before a thread is free: had its build been left queued, it would run
            # (in a moment: a regex builds in milliseconds) once one is.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.Generate(greedy_grpc(text="x", regex="[a-z]+"), timeout=0.1)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

            for _ in range(300):  # until a slow build ends and frees its thread
                try:
                    fine = await stub.Generate(greedy_grpc(text="x", regex="[0-9]+", max_tokens=4))
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            else:
                pytest.fail("the compile threads were never free again")
            assert fine.candidates[0].text.isdigit()
            url = f"http://127.0.0.1:{srv.http_port}/metrics"
            for _ in range(300):  # until both slow builds (over a second each) have ended
                metrics = await asyncio.to_thread(scrape_metrics, url)
                fast = metrics['pagedserve_grammar_build_seconds_bucket{le="1"}']
                if metrics["pagedserve_grammar_build_seconds_count"] - fast == 2:
                    break
                await asyncio.sleep(0.1)
            else:
                pytest.fail(f"the slow builds never ended: {metrics}")
            assert fast == 1  # "[0-9]+" alone: neither "[a-z]+" nor the refused retries
            assert metrics["pagedserve_grammar_cache_hits_total"] == 0
            gone = 'pagedserve_requests_aborted_total{door="grpc_unary",stage="compiling"}'
            assert metrics[gone] == 1
        finally:
            await http.aclose()
            await channel.close()
    assert core.block_manager.num_used_blocks == 0


async def test_a_forced_call_streams_deltas_that_add_up_to_the_unary_call(doors) -> None:
    client, *_ = doors
    ask = dict(
        messages=[{"role": "user", "content": "weather in Paris?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **GREEDY,
    )
    unary = await client.chat.completions.create(**ask)
    call = unary.choices[0].message.tool_calls[0]
    assert unary.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    pieces, names, ids, finish = [], [], set(), None
    async for chunk in await client.chat.completions.create(stream=True, **ask):
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            assert delta.index == 0
            if delta.id:
                ids.add(delta.id)
                names.append(delta.function.name)
            pieces.append(delta.function.arguments or "")
        finish = choice.finish_reason or finish
    assert names == ["get_weather"] and len(ids) == 1
    assert len(pieces) > 1  # the arguments arrive in pieces
    assert "".join(pieces) == call.function.arguments
    assert finish == "tool_calls"


async def test_required_calls_one_tool_or_several_and_the_round_trip_ends_in_text(doors) -> None:
    client, *_ = doors
    messages = [{"role": "user", "content": "weather and time?"}]
    single = await client.chat.completions.create(
        messages=messages,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        **GREEDY,
    )
    calls = single.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in ("get_weather", "get_time")
    assert single.choices[0].message.content is None

    result = {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temp": 21}'}
    history = [*messages, single.choices[0].message.model_dump(exclude_none=True), result]
    answer = await client.chat.completions.create(
        messages=history, tools=[WEATHER, TIME], tool_choice="none", **GREEDY
    )
    assert answer.choices[0].message.tool_calls is None
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.choices[0].finish_reason in ("stop", "length")


async def test_grpc_chat_takes_tools_and_answers_calls(doors) -> None:
    _, stub, _, _ = doors
    tool = WEATHER["function"]
    request = greedy_grpc(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="weather?")]),
        tools=[pb.Tool(name=tool["name"], parameters=json.dumps(tool["parameters"]))],
        tool_choice=pb.TOOL_CHOICE_REQUIRED,
        parallel_tool_calls=False,
    )
    unary = await stub.Generate(request)
    candidate = unary.candidates[0]
    assert candidate.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert [c.name for c in candidate.tool_calls] and candidate.text == ""
    for call in candidate.tool_calls:
        jsonschema.validate(json.loads(call.arguments), tool["parameters"])
    deltas = [d for m in [m async for m in stub.StreamGenerate(request)] for d in m.tool_calls]
    rebuilt = {}
    for d in deltas:
        rebuilt.setdefault(d.index, ["", ""])
        rebuilt[d.index][0] += d.name
        rebuilt[d.index][1] += d.arguments
    assert [tuple(v) for _, v in sorted(rebuilt.items())] == [
        (c.name, c.arguments) for c in candidate.tool_calls
    ]

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Generate(greedy_grpc(text="x", tools=request.tools))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("tools:")


async def test_constrained_and_free_requests_in_one_batch_answer_as_they_do_alone(doors) -> None:
    _, stub, _, _ = doors
    requests = [
        greedy_grpc(40, text="one", json_schema=json.dumps(PERSON)),
        greedy_grpc(40, text="two"),
        greedy_grpc(40, text="three", regex="[a-z ]{5,30}"),
        greedy_grpc(40, text="four"),
    ]
    alone = [await stub.Generate(r) for r in requests]
    together = await asyncio.gather(*(stub.Generate(r) for r in requests))
    assert [a.candidates[0].token_ids for a in alone] == [
        t.candidates[0].token_ids for t in together
    ]


def test_a_constraint_that_admits_the_free_answer_changes_no_token(tiny_model) -> None:
    llm = LLM(str(tiny_model), num_blocks=512, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = [f"{word} quick" for word in ("The", "A", "One", "Hello", "Where", "Why", "So")]
    answers = [out.outputs[0].token_ids for out in llm.generate(prompts, greedy)]

    # Random weights write parts of characters, and special tokens; the constraint is
    # text, so it spells the longest start of a free answer that is whole characters.
    def whole(ids: list[int]) -> int:
        special = llm.tokenizer.all_special_ids
        ids = list(itertools.takewhile(lambda t: t not in special, ids))
        decode = llm.tokenizer.decode
        return next((k for k in range(len(ids), 0, -1) if "\ufffd" not in decode(ids[:k])), 0)

    prompt, free = max(zip(prompts, answers), key=lambda pair: whole(pair[1]))
    length = whole(free)
    assert length >= 4
    text = llm.tokenizer.decode(free[:length])
    exact = dataclasses.replace(greedy, constraint=Constraint("choice", (text,)))
    constrained = llm.generate([prompt], exact)[0].outputs[0]
    assert constrained.token_ids[:length] == free[:length]
    assert constrained.text == text


def test_a_preempted_constrained_request_replays_to_the_same_document(tiny_model) -> None:
    params = SamplingParams(
        temperature=0.0, max_tokens=120, constraint=Constraint("json_schema", json.dumps(PERSON))
    )
    prompts = [f"person {i}" for i in range(6)]
    roomy = LLM(str(tiny_model), num_blocks=256, block_size=4).generate(prompts, params)
    tight = LLM(str(tiny_model), num_blocks=48, block_size=4)
    squeezed = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in squeezed] == [o.outputs[0].token_ids for o in roomy]
    for output in squeezed:
        jsonschema.validate(json.loads(output.outputs[0].text), PERSON)


def test_the_step_ahead_pipeline_changes_no_token_of_a_mixed_batch(tiny_model) -> None:
    """With async scheduling (the GPU's default), constrained and free requests in one
    batch, preempted for want of KV blocks, answer token for token as the synchronous engine
    with room to spare does: each masked step's masks follow the tokens of the step before,
    read back while its forward is queued."""
    person = Constraint("json_schema", json.dumps(PERSON))
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, constraint=person),
        SamplingParams(temperature=0.8, seed=5, max_tokens=50),
        SamplingParams(temperature=0.8, seed=3, max_tokens=40, constraint=person),
        SamplingParams(temperature=0.0, max_tokens=50),
        SamplingParams(
            temperature=0.0, max_tokens=40, constraint=Constraint("regex", "[a-z ]{5,30}")
        ),
        SamplingParams(temperature=0.8, seed=7, max_tokens=50, n=2, constraint=person),
    ]
    prompts = [f"item {i}" for i in range(len(params))]
    roomy = LLM(str(tiny_model), num_blocks=256, block_size=4, async_scheduling=False)
    want = roomy.generate(prompts, params)
    ahead = LLM(str(tiny_model), num_blocks=48, block_size=4, async_scheduling=True)
    got = ahead.generate(prompts, params)
    assert ahead.engine.scheduler.num_preemptions > 0
    for have, expected in zip(got, want, strict=True):
        assert [c.token_ids for c in have.outputs] == [c.token_ids for c in expected.outputs]


def test_tokens_a_grammar_forces_are_appended_without_a_step_each_and_change_no_token(
    tiny_model,
) -> None:
    """A schema of long fixed keys forces most of its text. Each run of forced tokens is
    appended unsampled and computed in one chunk with the token before it, so an answer
    takes far fewer steps than it has tokens, and the tokens are those of an engine that
    gives every token a step (greedy and seeded sampling with n = 2, with and without the
    step-ahead pipeline). A request for logprobs samples every token: a forced one would
    have none."""
    schema = FIXED_KEYS_SCHEMA
    constraint = Constraint("json_schema", json.dumps(schema))
    greedy = SamplingParams(temperature=0.0, max_tokens=200, constraint=constraint)
    sampled = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=200, constraint=constraint)

    def answers(llm: LLM, params: SamplingParams) -> list[list[list[int]]]:
        outputs = llm.generate(["a b", "c d e"], params)
        return [[list(c.token_ids) for c in output.outputs] for output in outputs]

    each = LLM(str(tiny_model), num_blocks=512, block_size=4, grammar_fast_forward=False)
    want = [answers(each, greedy), answers(each, sampled)]
    for async_scheduling in (False, True):
        llm = LLM(str(tiny_model), num_blocks=512, block_size=4, async_scheduling=async_scheduling)
        assert [answers(llm, greedy), answers(llm, sampled)] == want

        steps, forced = llm.engine.num_steps, llm.engine.num_forced_tokens
        alone = llm.generate(["a b"], greedy)[0].outputs[0]
        jsonschema.validate(json.loads(alone.text), schema)
        taken = llm.engine.num_steps - steps
        assert taken <= len(alone.token_ids) / 2, (taken, len(alone.token_ids))
        # Each step sampled one token of it; the rest were forced.
        assert llm.engine.num_forced_tokens - forced == len(alone.token_ids) - taken

        steps = llm.engine.num_steps
        asked = dataclasses.replace(greedy, logprobs=0)
        logged = llm.generate(["a b"], asked)[0].outputs[0]
        assert logged.token_ids == alone.token_ids
        assert llm.engine.num_steps - steps == len(logged.token_ids)  # the prompt's samples one
        assert llm.engine.num_forced_tokens == forced + len(alone.token_ids) - taken
        assert len(logged.logprobs) == len(logged.token_ids)


def test_forced_tokens_are_appended_only_as_far_as_the_next_step_fits_a_cuda_graph(
    tiny_model, monkeypatch
) -> None:
    """A step outgrowing the largest CUDA graph (rows in all, or one sequence's row limits)
    runs eagerly, at the cost of several replays, so where steps replay graphs only as many
    forced tokens are appended as keep the next step in one. With graphs of 32 rows: every
    step after the prompts' fits, where the engine without graphs computes runs of 36
    tokens at once; the forced tokens still save most steps, and no token changes."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=200,
        constraint=Constraint("json_schema", json.dumps(FIXED_KEYS_SCHEMA)),
    )
    prompts = ["a b", "c d e", "f", "g h"]  # all four start in the first step

    def run(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
        """The answers' tokens, and the rows of each sequence in each step after the first."""
        rows, forward = [], llm.engine.runner.forward

        def recording(plan):
            rows.append(plan.query_lens.tolist())
            return forward(plan)

        monkeypatch.setattr(llm.engine.runner, "forward", recording)
        outputs = llm.generate(prompts, params)
        return [list(o.outputs[0].token_ids) for o in outputs], rows[1:]

    want, unlimited = run(LLM(str(tiny_model), num_blocks=512, block_size=4))
    assert max(map(max, unlimited)) > MAX_GRAPH_ROWS_PER_SEQ and max(map(sum, unlimited)) > 32
    monkeypatch.setattr(ModelRunner, "max_graph_rows", property(lambda runner: 32))
    llm = LLM(str(tiny_model), num_blocks=512, block_size=4)
    got, limited = run(llm)
    assert got == want
    assert all(sum(step) <= 32 and max(step) <= MAX_GRAPH_ROWS_PER_SEQ for step in limited)
    assert len(limited) < len(want[0]) / 2 and llm.engine.num_forced_tokens > 0


@pytest.fixture(scope="module")
def undecodable_model(tmp_path_factory):
    """A tiny model whose tokenizer has no decoder (as benchmarks/gpu_bench.py's random
    model's has none): llguidance cannot tell the bytes its tokens stand for."""
    directory = tmp_path_factory.mktemp("no-decoder")
    write_tiny_model(directory, "llama", max_position_embeddings=4096)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer["decoder"] = None
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    return directory


def test_a_model_without_structured_output_starts_serves_and_refuses_constraints_by_field(
    undecodable_model,
) -> None:
    """`pagedserve warmup` and `serve` start a model llguidance cannot read, each saying so
    in one warning line; every constraint, a forced tool call's too, is refused naming its
    field and why; a free request is answered."""
    unavailable = "structured output is not available for this model: its tokenizer has no decoder"
    command = [sys.executable, "-m", "service.cli", "warmup", "--model", str(undecodable_model)]
    warmup = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert warmup.returncode == 0, warmup.stderr
    assert warmup.stderr.count(unavailable) == 1, warmup.stderr

    http_port = free_port()
    server = start_server_process(undecodable_model, "--http-port", str(http_port))
    try:
        server.wait_ready(timeout=120)
        with grpc.insecure_channel(server.target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            free = stub.Generate(greedy_grpc(8, text="hello"), timeout=60)
            assert len(free.candidates[0].token_ids) == 8
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(greedy_grpc(8, text="hello", regex="[0-9]+"), timeout=60)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details().startswith(f"regex: {unavailable}"), caught.value

        chat = {"messages": [{"role": "user", "content": "weather?"}]}
        forced = {"tools": [WEATHER], "tool_choice": "required"}
        schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}/v1", timeout=60) as http:
            for body, field in [
                ({"response_format": schema}, "response_format.json_schema.schema"),
                (forced, "tools.function.parameters"),
            ]:
                refused = http.post("/chat/completions", json={**chat, **body, "max_tokens": 8})
                assert refused.status_code == 400, refused.text
                error = refused.json()["error"]
                assert error["param"] == field, error
                assert error["message"].startswith(f"{field}: {unavailable}"), error
            answered = http.post("/chat/completions", json={**chat, "max_tokens": 8})
            assert answered.status_code == 200, answered.text
            assert answered.json()["usage"]["completion_tokens"] >= 1
        assert server.stderr().count(unavailable) == 1, server.stderr()
    finally:
        server.stop()
