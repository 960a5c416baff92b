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
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import (  # noqa: E402
    Workload,
    WorkloadSpec,
    add_workload_args,
    make_workload,
    run_info,
)
from engine.llm import LLM  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


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
    add_workload_args(p)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--repeats", type=int, default=1, help="timed runs of each engine; the median counts"
    )
    p.add_argument("--compare-transformers", action="store_true")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args()

    work = make_workload(WorkloadSpec.from_args(args))
    print(
        f"workload: {len(work.prompts)} prompts, {work.prompt_tokens} prompt tokens, {work.output_tokens} output tokens"
    )
    times = run_pagedserve(args, work)
    elapsed = statistics.median(times)
    result = {
        **run_info(),
        "torch_threads": torch.get_num_threads(),
        "workload": work.describe(),
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
