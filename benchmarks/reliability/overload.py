"""Overload: a burst of several times the queue limit, all at once.

    python benchmarks/reliability/overload.py --model DIR --max-queued-requests 16 --max-num-seqs 8 \
        --burst 4 --max-tokens 64

Starts a server (serving.py's started_server) with REST and /metrics on, then sends
`--burst` x max_queued_requests Generate calls at once over gRPC, and after they all ended
the same burst of /v1/completions over REST. Each call is timed from the burst's start.
Printed per door: how many were served (and whether each got all its tokens), how many
were refused and with what (RESOURCE_EXHAUSTED + retry-after-ms, 429 + Retry-After), how
fast the refusals came (p50 / p99 / max) against the served calls' latency, and whether
the engine generated exactly the served requests' tokens: nothing refused reached it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.serving import (  # noqa: E402
    add_engine_args,
    free_port,
    percentiles,
    request_message,
    started_server,
)
from benchmarks.workload import run_info  # noqa: E402
from pagedserve.v1 import inference_pb2_grpc  # noqa: E402
from tests.server_process import scrape_metrics  # noqa: E402

PROMPT = list(range(1, 17))  # 16 token ids, the same for every call


@dataclass
class Outcome:
    answer: str  # OK / 200, or the status that refused it
    seconds: float  # from the burst's start to the answer
    retry_hint: bool  # a refusal carried retry-after-ms (gRPC) / Retry-After (REST)
    tokens: int  # tokens served (0 when refused)


async def grpc_call(stub, max_tokens: int, start: float) -> Outcome:
    try:
        reply = await stub.Generate(request_message(PROMPT, max_tokens), timeout=600)
        tokens = len(reply.candidates[0].token_ids)
        return Outcome("OK", time.perf_counter() - start, False, tokens)
    except grpc.aio.AioRpcError as err:
        hint = any(key == "retry-after-ms" for key, _ in err.trailing_metadata() or ())
        return Outcome(err.code().name, time.perf_counter() - start, hint, 0)


async def rest_call(http: httpx.AsyncClient, max_tokens: int, start: float) -> Outcome:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    reply = await http.post("/v1/completions", json=body)
    seconds = time.perf_counter() - start
    if reply.status_code != 200:
        return Outcome(str(reply.status_code), seconds, "retry-after" in reply.headers, 0)
    return Outcome("200", seconds, False, reply.json()["usage"]["completion_tokens"])


async def burst(calls) -> list[Outcome]:
    start = time.perf_counter()
    return await asyncio.gather(*(call(start) for call in calls))


def report(door: str, outcomes: list[Outcome], max_tokens: int, ok: str) -> dict:
    served = [o for o in outcomes if o.answer == ok]
    refused = [o for o in outcomes if o.answer != ok]
    answers: dict[str, int] = {}
    for o in outcomes:
        answers[o.answer] = answers.get(o.answer, 0) + 1
    result = {
        "door": door,
        "calls": len(outcomes),
        "answers": answers,
        "served_complete": all(o.tokens == max_tokens for o in served),
        "refusals_with_retry_hint": sum(o.retry_hint for o in refused),
        "refusal_ms": {
            k: v and round(v * 1e3, 1) for k, v in percentiles([o.seconds for o in refused]).items()
        },
        "refusal_max_ms": round(max((o.seconds for o in refused), default=0) * 1e3, 1),
        "served_ms": {
            k: v and round(v * 1e3, 1) for k, v in percentiles([o.seconds for o in served]).items()
        },
    }
    print(
        f"{door}: {len(outcomes)} at once -> {answers}; served complete: "
        f"{result['served_complete']}; retry hint on {result['refusals_with_retry_hint']} of "
        f"{len(refused)} refusals\n  refused after (ms) {result['refusal_ms']}, max "
        f"{result['refusal_max_ms']}\n  served after  (ms) {result['served_ms']}"
    )
    return result


async def run(target: str, http_port: int, metrics_url: str, args: argparse.Namespace) -> None:
    n = args.burst * args.max_queued_requests
    tokens_before = scrape_metrics(metrics_url)["pagedserve_generation_tokens_total"]
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        grpc_outcomes = await burst([lambda start: grpc_call(stub, args.max_tokens, start)] * n)
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{http_port}", timeout=600, limits=limits
    ) as http:
        rest_outcomes = await burst([lambda start: rest_call(http, args.max_tokens, start)] * n)
    generated = scrape_metrics(metrics_url)["pagedserve_generation_tokens_total"] - tokens_before
    print(f"\nburst of {n} = {args.burst} x max_queued_requests {args.max_queued_requests}")
    results = [
        report("gRPC Generate", grpc_outcomes, args.max_tokens, "OK"),
        report("REST /v1/completions", rest_outcomes, args.max_tokens, "200"),
    ]
    served = sum(o.tokens for o in grpc_outcomes + rest_outcomes)
    print(
        f"engine generated {generated:.0f} tokens; the served calls got {served}: "
        + ("nothing refused reached the engine" if generated == served else "MISMATCH")
    )
    print({**run_info(), "results": results, "generated": generated, "served_tokens": served})


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--max-queued-requests", type=int, default=16)
    p.add_argument("--burst", type=int, default=4, help="calls at once, x max_queued_requests")
    p.add_argument("--max-tokens", type=int, default=64)
    add_engine_args(p, "the started server", "running sequences", max_num_seqs=8)
    args = p.parse_args()
    http_port, metrics_port = free_port(), free_port()
    extra = [
        "--max-queued-requests", str(args.max_queued_requests),
        "--http-port", str(http_port),
        "--metrics-port", str(metrics_port),
    ]  # fmt: skip
    with started_server(args, extra) as (target, _, _):
        asyncio.run(run(target, http_port, f"http://127.0.0.1:{metrics_port}/metrics", args))


if __name__ == "__main__":
    main()
