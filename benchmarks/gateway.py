"""A fleet behind the Shepherd Model Gateway on this machine: cache-aware routing against
round robin, on a shared-prefix workload.

Three `pagedserve serve` workers (the embedded default model, each with a KV pool of
--num-blocks and one torch thread) behind `smg launch`, once with --policy round_robin and once with
cache_aware, each on its own prompts: 16 system prompts of about 90 tokens, 8 users each,
in a shuffled order, streamed as completions of --max-tokens tokens, --concurrency at a
time. It reports each policy's time to first token (p50, p99, from the client, through the
router) and the workers' prefix-cache hit rate over its requests (their metrics).

    python benchmarks/gateway.py --json-out benchmarks/results/cpu-gateway-<commit>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx2 as httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import run_info  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from tests.server_process import (  # noqa: E402
    RouterProcess,
    ServerProcess,
    start_router,
    start_server_process,
)

WORDS = ["river", "stone", "maple", "copper", "lantern", "harbor", "meadow", "signal"]


def shared_prefix_prompts(label: str, systems: int, users: int, seed: int) -> list[str]:
    """`systems` system prompts of 70 random words, `users` users each, shuffled."""
    rng = random.Random(seed)
    heads = [
        f"System {label}{i}: you are assistant {i}. " + " ".join(rng.choices(WORDS, k=70))
        for i in range(systems)
    ]
    prompts = [
        f"{head}\nUser {user}: hello, how are you?" for head in heads for user in range(users)
    ]
    rng.shuffle(prompts)
    return prompts


def total(workers: list[ServerProcess], name: str) -> float:
    return sum(worker.metrics().get(name, 0.0) for worker in workers)


async def first_token_seconds(
    http: httpx.AsyncClient, router: RouterProcess, model: str, prompt: str, max_tokens: int
) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    started = time.perf_counter()
    url = f"{router.base_url}/v1/completions"
    async with http.stream("POST", url, json={**body, "stream": True}) as answer:
        answer.raise_for_status()
        first = None
        async for line in answer.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
    return first


async def run_policy(
    workers: list[ServerProcess], policy: str, prompts: list[str], args: argparse.Namespace
) -> dict:
    router = start_router(workers, policy)
    try:
        router.wait_ready(60)
        async with httpx.AsyncClient(timeout=300) as http:
            model = (await http.get(f"{router.base_url}/v1/models")).json()["data"][0]["id"]
            queries, hits = (
                "pagedserve_prefix_cache_queries_total",
                "pagedserve_prefix_cache_hits_total",
            )
            queried, hit = total(workers, queries), total(workers, hits)
            pending = iter(prompts)
            ttfts: list[float] = []

            async def client() -> None:
                for prompt in pending:
                    ttfts.append(
                        await first_token_seconds(http, router, model, prompt, args.max_tokens)
                    )

            started = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(args.concurrency)))
            seconds = time.perf_counter() - started
            hit_rate = (total(workers, hits) - hit) / (total(workers, queries) - queried)
    finally:
        router.stop()
    ttfts.sort()
    return {
        "policy": policy,
        "requests": len(ttfts),
        "seconds": round(seconds, 2),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
        "prefix_cache_hit_rate": round(hit_rate, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=48, help="each worker's KV pool")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--systems", type=int, default=16)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--threads-per-worker",
        type=int,
        default=1,
        help="torch threads of each worker (OMP_NUM_THREADS): workers share the cores",
    )
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    model = resolve_model(None)
    worker_args = ["--num-blocks", str(args.num_blocks), "--block-size", str(args.block_size)]
    env = {"OMP_NUM_THREADS": str(args.threads_per_worker)}
    workers = [
        start_server_process(model, *worker_args, "--max-model-len", "512", env=env)
        for _ in range(args.workers)
    ]
    try:
        for worker in workers:
            worker.wait_ready(300)
        results = []
        for seed, policy in enumerate(("round_robin", "cache_aware")):
            prompts = shared_prefix_prompts(policy[0], args.systems, args.users, seed)
            result = asyncio.run(run_policy(workers, policy, prompts, args))
            print(json.dumps(result), flush=True)
            results.append(result)
    finally:
        for worker in workers:
            worker.stop()
    report = {**run_info(), "settings": vars(args) | {"json_out": None}, "results": results}
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
