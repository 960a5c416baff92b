"""Inter-token latency of running streams when a long prompt arrives.

    python benchmarks/reliability/long_prompt_itl.py --long-prompt 1024 --stream-tokens 64 --chunk 256 64

For chunked prefill on (`--chunk` tokens per step, one or more budgets) and off (a step
budget that fits the whole prompt beside the decodes), a server is started (serving.py's,
prefix caching off) and runs `--rounds` rounds of two cases: the streams alone, and the
streams with one long prompt (max_tokens 1) sent `--arrive-after` seconds after them, when
they are decoding.
Every request is a StreamGenerate timed on the client per message (serving.py's send()).
Printed per setting and case: the streams' inter-token gaps (p50, p99, max, over every
gap of every round) and the long prompt's TTFT. The structural property behind it (no
step above the budget; running streams get a token every step of the long prefill) is
tested in CI: tests/reliability/test_long_prompt.py.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.serving import send, started_server, wait_ready  # noqa: E402
from benchmarks.workload import (  # noqa: E402
    CpuShare,
    Workload,
    WorkloadSpec,
    make_workload,
    run_info,
)
from pagedserve.v1 import inference_pb2_grpc  # noqa: E402


async def one_round(target: str, work: Workload, streams: int, long: bool, after: float):
    """The streams' records and, if sent, the long prompt's (the last prompt of work)."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        running = [asyncio.create_task(send(stub, work, i, 600)) for i in range(streams)]
        long_record = None
        if long:
            await asyncio.sleep(after)
            long_record = await send(stub, work, streams, 600)
        records = await asyncio.gather(*running)
    for record in [*records, long_record]:
        if record is not None and record.error:
            raise SystemExit(f"a request failed: {record.error}")
    return records, long_record


def measure(args: argparse.Namespace, chunk: int | None, work: Workload) -> dict:
    """Chunked prefill with a step budget of `chunk` tokens, or off (chunk None)."""
    chunked = chunk is not None
    budget = chunk if chunked else args.long_prompt + args.streams
    settings = argparse.Namespace(
        **vars(args), max_num_seqs=args.streams + 1, max_num_batched_tokens=budget
    )
    extra = () if chunked else ("--no-chunked-prefill",)
    rows = {}
    with started_server(settings, extra) as (target, pid, _):
        asyncio.run(wait_ready(target, args.server_timeout))
        asyncio.run(one_round(target, work, args.streams, True, args.arrive_after))  # warm-up
        for case in ("streams alone", "long prompt arrives"):
            cpu = CpuShare([pid]).start()
            gaps, ttfts = [], []
            for _ in range(args.rounds):
                long = case != "streams alone"
                records, long_record = asyncio.run(
                    one_round(target, work, args.streams, long, args.arrive_after)
                )
                gaps += [gap for r in records for gap in r.itls]
                if long_record is not None:
                    ttfts.append(long_record.ttft)
            p50, p99 = np.percentile(gaps, (50, 99))
            print(f"budget {budget}, {case}: done", flush=True)
            rows[case] = {
                "itl_ms": {"p50": p50 * 1e3, "p99": p99 * 1e3, "max": max(gaps) * 1e3},
                "gaps": len(gaps),
                "long_ttft_ms": float(np.mean(ttfts)) * 1e3 if ttfts else None,
                "cpu": cpu.stop(),
            }
    return {"budget": budget, "cases": rows}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--streams", type=int, default=4, help="running streams")
    p.add_argument("--stream-tokens", type=int, default=96, help="each stream's output")
    p.add_argument("--long-prompt", type=int, default=1536, help="the long prompt's tokens")
    p.add_argument(
        "--chunk", type=int, nargs="+", default=[256], help="step budgets with chunked prefill"
    )
    p.add_argument("--arrive-after", type=float, default=0.5, help="s after the streams")
    p.add_argument("--rounds", type=int, default=3, help="rounds per case")
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--server-timeout", type=float, default=300.0)
    args = p.parse_args()
    args.num_blocks = args.kv_cache_memory_gib = None  # serving.py's engine flags
    spec = WorkloadSpec(max_token_id=args.max_token_id, seed=3)
    out = args.stream_tokens
    short = make_workload(
        replace(spec, num_prompts=args.streams, min_in=16, max_in=16, min_out=out, max_out=out)
    )
    n = args.long_prompt
    long = make_workload(replace(spec, num_prompts=1, min_in=n, max_in=n, min_out=1, max_out=1))
    work = Workload(short.prompts + long.prompts, short.output_lens + long.output_lens)
    print(run_info())
    results = {f"chunked {chunk}": measure(args, chunk, work) for chunk in args.chunk}
    results["unchunked"] = measure(args, None, work)
    print(
        f"\n{args.streams} streams x {args.stream_tokens} tokens; a {args.long_prompt}-token "
        f"prompt arrives {args.arrive_after} s after them; {args.rounds} rounds per case"
    )
    print(f"{'prefill':12} {'budget':>6} {'case':20} {'ITL p50':>8} {'p99':>8} {'max':>8} "
          f"{'long TTFT':>10}")  # fmt: skip
    for name, result in results.items():
        for case, row in result["cases"].items():
            itl, ttft = row["itl_ms"], row["long_ttft_ms"]
            print(
                f"{name:12} {result['budget']:6} {case:20} "
                f"{itl['p50']:8.1f} {itl['p99']:8.1f} {itl['max']:8.1f} "
                f"{'-' if ttft is None else f'{ttft:.0f}':>10}   (ms; cpu {row['cpu']})"
            )


if __name__ == "__main__":
    main()
