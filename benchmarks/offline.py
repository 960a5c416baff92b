"""Offline throughput: pagedserve vs HF transformers `generate` on the same workload.

    python benchmarks/offline.py --compare-transformers

Default workload (the CPU one): 32 prompts of random token ids with lengths uniform in
[16, 256], output lengths uniform in [16, 128], seeded, ignore_eos — the mixed-length
case continuous batching exists for. transformers runs the same prompts as one
left-padded batch generating max(output lengths) tokens; only the requested output
tokens count for both.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.llm import LLM  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(args: argparse.Namespace) -> Workload:
    rng = random.Random(args.seed)
    prompts = [
        [rng.randint(0, args.max_token_id) for _ in range(rng.randint(args.min_in, args.max_in))]
        for _ in range(args.num_prompts)
    ]
    output_lens = [rng.randint(args.min_out, args.max_out) for _ in range(args.num_prompts)]
    return Workload(prompts, output_lens)


def run_pagedserve(args: argparse.Namespace, work: Workload) -> list[float]:
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        # Each repeat sends the same prompts: it must not reuse the previous run's KV.
        enable_prefix_caching=False,
    )
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens
    ]
    llm.generate(work.prompts[:2], params[:2])  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.generate(work.prompts, params, use_tqdm=True)
        times.append(time.perf_counter() - start)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        assert produced == work.output_tokens, (produced, work.output_tokens)
    return times


def run_transformers(args: argparse.Namespace, work: Workload) -> list[float]:
    from transformers import AutoModelForCausalLM

    path = resolve_model(args.model)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    pad = 0
    width = max(len(p) for p in work.prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in work.prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in work.prompts])
    max_new = max(work.output_lens)
    gen = dict(do_sample=False, max_new_tokens=max_new, min_new_tokens=max_new, pad_token_id=pad)
    with torch.inference_mode():
        model.generate(
            input_ids=input_ids[:2],
            attention_mask=mask[:2],
            **{**gen, "max_new_tokens": 4, "min_new_tokens": 4},
        )
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            model.generate(input_ids=input_ids, attention_mask=mask, **gen)
            times.append(time.perf_counter() - start)
        return times


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--min-in", type=int, default=16)
    p.add_argument("--max-in", type=int, default=256)
    p.add_argument("--min-out", type=int, default=16)
    p.add_argument("--max-out", type=int, default=128)
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--repeats", type=int, default=1, help="timed runs of each engine; the median counts"
    )
    p.add_argument("--compare-transformers", action="store_true")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args()

    work = make_workload(args)
    print(
        f"workload: {len(work.prompts)} prompts, {work.prompt_tokens} prompt tokens, {work.output_tokens} output tokens"
    )
    times = run_pagedserve(args, work)
    elapsed = statistics.median(times)
    result = {
        "command": " ".join(sys.argv),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "hardware": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "workload": {
            "prompts": len(work.prompts),
            "prompt_tokens": work.prompt_tokens,
            "output_tokens": work.output_tokens,
        },
        "pagedserve_runs_s": [round(t, 2) for t in times],
        "pagedserve_tok_s": round(work.output_tokens / elapsed, 1),
    }
    print(
        f"pagedserve:   {elapsed:8.2f} s  {result['pagedserve_tok_s']:9.1f} output tok/s (median of {len(times)})"
    )
    if args.compare_transformers:
        hf_times = run_transformers(args, work)
        hf = statistics.median(hf_times)
        result["transformers_runs_s"] = [round(t, 2) for t in hf_times]
        result["transformers_tok_s"] = round(work.output_tokens / hf, 1)
        result["ratio"] = round(hf / elapsed, 2)
        print(
            f"transformers: {hf:8.2f} s  {result['transformers_tok_s']:9.1f} output tok/s (median of {len(hf_times)})"
        )
        print(f"ratio pagedserve / transformers: {result['ratio']:.2f}x")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
