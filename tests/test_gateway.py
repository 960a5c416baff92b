"""pagedserve as a worker behind a real gateway: the Shepherd Model Gateway (`smg`, from
PyPI) on loopback in front of three `pagedserve serve` processes, which it drives over
their gRPC port as SglangScheduler workers (service/grpc/gateway.py). The router fetches
the tokenizer from a worker, applies the chat template, tokenizes and detokenizes itself;
the workers generate. Driven from outside with the official openai client and raw HTTP,
read back from the workers' metrics.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import httpx2 as httpx
import jsonschema
import openai
import pytest

from tests.server_process import (
    RouterProcess,
    ServerProcess,
    free_port,
    start_router,
    start_server_process,
)
from tests.test_structured_output_smollm2 import WEATHER, WEATHER_PARAMETERS

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
# A pool of 32 blocks per worker: 7 of the shared prompts below (4 blocks each) stay
# cached beside a request's own blocks, not all 16.
WORKER_ARGS = ("--num-blocks", "32", "--block-size", str(BLOCK_SIZE), "--max-model-len", "512")
# Health probes each second; one failure takes a worker out of rotation.
ROUTER_ARGS = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1")
GREEDY = dict(temperature=0.0)
PET = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "species": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
    },
    "required": ["name", "species", "age"],
    "additionalProperties": False,
}


class Fleet:
    """The workers, their REST ports (for direct calls), and the router before them."""

    def __init__(self, workers: list[ServerProcess], http_ports: list[int], router) -> None:
        self.workers, self.http_ports, self.router = workers, http_ports, router
        self.model = ""

    def direct(self, index: int = 0) -> openai.AsyncOpenAI:
        url = f"http://127.0.0.1:{self.http_ports[index]}/v1"
        return openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0)

    def routed(self, router: RouterProcess | None = None) -> openai.AsyncOpenAI:
        url = f"{(router or self.router).base_url}/v1"
        return openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)

    def total(self, name: str, workers: list[ServerProcess] | None = None) -> float:
        return sum(worker.metrics().get(name, 0.0) for worker in workers or self.workers)


@pytest.fixture(scope="module")
def fleet(smollm2_gguf):
    http_ports = [free_port() for _ in range(3)]
    workers = [
        start_server_process(smollm2_gguf, *WORKER_ARGS, "--http-port", str(port))
        for port in http_ports
    ]
    router = None
    try:
        for worker in workers:
            worker.wait_ready(180)
        router = start_router(workers, "cache_aware", *ROUTER_ARGS)
        router.wait_ready(60)
        fleet = Fleet(workers, http_ports, router)
        models = httpx.get(f"{router.base_url}/v1/models", timeout=10).json()["data"]
        fleet.model = models[0]["id"]
        yield fleet
    finally:
        if router is not None:
            router.stop()
        for worker in workers:
            worker.stop()


async def test_chat_and_completions_through_the_router_equal_a_direct_call(fleet):
    routed, direct = fleet.routed(), fleet.direct()
    chat = dict(
        model=fleet.model,
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=24,
        **GREEDY,
    )
    want = (await direct.chat.completions.create(**chat)).choices[0]
    got = (await routed.chat.completions.create(**chat)).choices[0]
    assert want.message.content  # the comparison compares something
    assert (got.message.content, got.finish_reason) == (want.message.content, want.finish_reason)
    text, finish = "", None
    async for chunk in await routed.chat.completions.create(stream=True, **chat):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert (text, finish) == (want.message.content, want.finish_reason)

    completion = dict(model=fleet.model, prompt="The capital of France is", max_tokens=16, **GREEDY)
    want = await direct.completions.create(**completion)
    got = await routed.completions.create(**completion)
    assert got.choices[0].text == want.choices[0].text and want.choices[0].text
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens
    text = ""
    async for chunk in await routed.completions.create(stream=True, **completion):
        text += "".join(choice.text for choice in chunk.choices)
    assert text == want.choices[0].text


async def test_a_json_schema_answer_and_a_tool_call_through_the_router(fleet):
    routed, direct = fleet.routed(), fleet.direct()
    ask = dict(
        model=fleet.model,
        messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET}},
        max_tokens=100,
        **GREEDY,
    )
    got = (await routed.chat.completions.create(**ask)).choices[0]
    want = (await direct.chat.completions.create(**ask)).choices[0]
    assert got.finish_reason == "stop", got
    jsonschema.validate(json.loads(got.message.content), PET)
    assert got.message.content == want.message.content

    # The router writes the forced call's grammar and reads the call back itself.
    call = await routed.chat.completions.create(
        model=fleet.model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,
        **GREEDY,
    )
    choice = call.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (tool_call,) = choice.message.tool_calls
    assert tool_call.function.name == "get_weather"
    jsonschema.validate(json.loads(tool_call.function.arguments), WEATHER_PARAMETERS)


async def test_a_client_that_leaves_mid_stream_stops_the_work_on_the_worker(fleet):
    generated = "pagedserve_generation_tokens_total"
    aborted = 'pagedserve_requests_aborted_total{door="gateway",stage="decode"}'
    before_tokens, before_aborts = fleet.total(generated), fleet.total(aborted)
    body = {
        "model": fleet.model,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
        **GREEDY,
    }
    received = 0
    async with httpx.AsyncClient(timeout=60) as http:
        url = f"{fleet.router.base_url}/v1/completions"
        async with http.stream("POST", url, json=body) as sse:
            assert sse.status_code == 200
            async for line in sse.aiter_lines():
                received += line.startswith("data: {")
                if received == 8:
                    break  # the client leaves: its connection closes with the block
    left = time.monotonic()
    # Due within a step of its leaving: give the worker a second, then it has stopped.
    await asyncio.sleep(max(0.0, left + 1.0 - time.monotonic()))
    assert fleet.total("pagedserve_num_requests_running") == 0
    assert fleet.total(aborted) == before_aborts + 1
    tokens = fleet.total(generated) - before_tokens
    # What ran past the client: the tokens in flight to it and at most a step or two more.
    assert received <= tokens <= received + 6, (received, tokens)
    await asyncio.sleep(0.5)
    assert fleet.total(generated) - before_tokens == tokens  # and nothing since


def shared_prefix_workload(label: str, seed: int) -> list[str]:
    """16 system prompts of 4 full blocks or more, 8 users each, in a shuffled order."""
    rng = random.Random(seed)
    words = ["river", "stone", "maple", "copper", "lantern", "harbor", "meadow", "signal"]
    systems = [
        f"System {label}{i}: you are assistant {i}. "
        + " ".join(rng.choice(words) for _ in range(70))
        for i in range(16)
    ]
    prompts = [
        f"{system}\nUser {user}: hello, how are you?" for system in systems for user in range(8)
    ]
    rng.shuffle(prompts)
    return prompts


async def hit_rate(fleet: Fleet, router: RouterProcess, prompts: list[str]) -> float:
    """The workers' prefix-cache hit rate over `prompts`, sent one by one through router."""
    queries, hits = "pagedserve_prefix_cache_queries_total", "pagedserve_prefix_cache_hits_total"
    queried, hit = fleet.total(queries), fleet.total(hits)
    client = fleet.routed(router)
    for prompt in prompts:
        await client.completions.create(model=fleet.model, prompt=prompt, max_tokens=1, **GREEDY)
    return (fleet.total(hits) - hit) / (fleet.total(queries) - queried)


async def test_cache_aware_routing_doubles_the_hit_rate_of_round_robin(fleet):
    """Every system prompt fits one worker's cache, not all of them: round robin sends each
    to every worker and they evict each other; the cache-aware router, reading the workers'
    KV events, keeps each prompt on the worker that holds it."""
    round_robin = start_router(fleet.workers, "round_robin", *ROUTER_ARGS)
    try:
        round_robin.wait_ready(60)
        spread = await hit_rate(fleet, round_robin, shared_prefix_workload("R", 1))
    finally:
        round_robin.stop()
    kept = await hit_rate(fleet, fleet.router, shared_prefix_workload("C", 2))
    assert kept >= 2 * spread, (kept, spread)


async def test_a_worker_killed_mid_traffic_leaves_the_router_to_the_others(fleet):
    client = fleet.routed()

    async def ask(i: int) -> str:
        prompt = f"Request {i}: tell me about the sea."
        answer = await client.completions.create(
            model=fleet.model, prompt=prompt, max_tokens=12, **GREEDY
        )
        return answer.choices[0].text

    traffic = [asyncio.ensure_future(ask(i)) for i in range(9)]
    await asyncio.sleep(0.3)
    victim, survivors = fleet.workers[2], fleet.workers[:2]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    await asyncio.gather(*traffic, return_exceptions=True)  # its own calls may fail

    # The router takes it out of rotation: every later request is answered by the others.
    finished = "pagedserve_e2e_request_latency_seconds_count"
    before = fleet.total(finished, survivors)
    answers = [await ask(100 + i) for i in range(12)]
    assert all(answers), answers
    assert fleet.total(finished, survivors) == before + 12
