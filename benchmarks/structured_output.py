"""Structured output's cost: output tok/s with a JSON schema on every request against the
same requests free, and grammar compile time per schema.

    python benchmarks/structured_output.py [--shape qwen3-0.6b] [--tokenizer PATH] --json-out F

The model is random weights of a real model's shape (gpu_bench.write_random_model) given
a real tokenizer, SmolLM2's byte-level BPE (the embedded default's GGUF, or --tokenizer: an
HF tokenizer directory or a .gguf), with the model's vocabulary sized to match it.

The workload: --requests (64) requests at once through the offline API, each asking for
an array of --documents (8) documents of one of the JSON schemas in tests/json_schemas.py
(in turn) at temperature 0.6, seeded.
The free run sends the same prompts with ignore_eos and, per request, max_tokens equal to
the tokens its constrained answer had: both runs produce the same tokens per request, so
their output tok/s compare the same work. Each run is timed --repeats times on one
engine after a warm-up; the figures are the median's. Compile time: every schema compiled
--compile-repeats times by a fresh compiler (no cache), p50 and p99 over all compiles.
With --phases, one more run of each kind with the engine's parts timed (host_overhead's
timers): wall ms per step in each, the device's waits included (the collect's sync, the
masks' fill).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_bench import SHAPES, write_random_model  # noqa: E402
from benchmarks.host_overhead import time_parts  # noqa: E402
from benchmarks.workload import run_info  # noqa: E402
from engine.llm import LLM  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured.constraints import Constraint  # noqa: E402
from engine.structured.grammar import GrammarCompiler  # noqa: E402
from engine.text.tokenizer import Tokenizer  # noqa: E402
from tests.json_schemas import SCHEMAS  # noqa: E402


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    """The tokenizer as an HF tokenizer directory's files: tokenizer.json and its EOS."""
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    special = {"eos_token": tokenizer.backend.id_to_token(tokenizer.eos_token_ids[0])}
    (path / "tokenizer_config.json").write_text(json.dumps(special))


def model_with_tokenizer(shape_name: str, tokenizer_path: Path, root: Path) -> Path:
    """The shape's random model with the tokenizer's vocabulary, and the tokenizer."""
    tokenizer = Tokenizer.from_path(tokenizer_path)
    shape = dataclasses.replace(SHAPES[shape_name], vocab_size=tokenizer.vocab_size)
    path = write_random_model(shape, root / f"{shape_name}-vocab{shape.vocab_size}")
    save_tokenizer(tokenizer, path)  # in place of the shape's own
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = list(tokenizer.eos_token_ids)
    (path / "config.json").write_text(json.dumps(config))
    return path


def documents(schema: dict, count: int) -> dict:
    """An array of exactly `count` documents of the schema: answers long enough that the
    steps, not a request's first ones, are what the run times."""
    schema = dict(schema)
    defs = schema.pop("$defs", None)
    array = {"type": "array", "items": schema, "minItems": count, "maxItems": count}
    return {**array, "$defs": defs} if defs else array


def timed_runs(llm: LLM, prompts: list[str], params: list[SamplingParams], repeats: int):
    llm.generate(prompts[:4], params[:4])  # warm-up (kernels, the first compiles)
    runs = []
    for _ in range(repeats):
        steps, forced = llm.engine.num_steps, getattr(llm.engine, "num_forced_tokens", 0)
        replayed = getattr(llm.engine.runner, "num_graph_steps", 0)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        runs.append(
            {
                "seconds": round(elapsed, 3),
                "output_tokens": produced,
                "steps": llm.engine.num_steps - steps,
                "forced_tokens": getattr(llm.engine, "num_forced_tokens", 0) - forced,
                "graph_steps": getattr(llm.engine.runner, "num_graph_steps", 0) - replayed,
                "outputs": outputs,
            }
        )
    median = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    return median, [{k: v for k, v in r.items() if k != "outputs"} for r in runs]


def phase_times(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> dict:
    """Wall ms per step of the engine's parts over one run (nested parts count in both;
    a part an engine does not have is left out, so engines of other layouts compare)."""
    engine, runner = llm.engine, llm.engine.runner
    engine_module = sys.modules[type(engine).__module__]
    runner_module = sys.modules[type(runner).__module__]
    filler = getattr(sys.modules["engine.structured.grammar"], "_MaskFiller", None)
    totals: dict[str, float] = defaultdict(float)
    parts = [
        (engine, "step", "step"),
        (engine, "_collect", "collect: sync, events, masks advanced"),
        (engine, "_read", "a step read back: the sync, masks advanced"),
        (runner, "collect", "  the sync and the read-back"),
        (engine.scheduler, "schedule", "schedule"),
        (engine, "_plan", "plan"),
        (engine_module, "fill_masks", "masks filled"),
        (engine_module, "start_filling", "masks: their fill begun"),
        (filler, "start", "  the hand-over to the filling thread"),
        (engine, "_sample", "a step sampled later: its fill waited for, its sampling queued"),
        (runner, "forward", "forward queued"),
        (runner, "sample", "sampling queued"),
        (runner_module, "upload", "  uploads: the forward's, the masks'"),
    ]
    restore = time_parts(totals, parts)
    steps_before = engine.num_steps
    try:
        llm.generate(prompts, params)
    finally:
        restore()
    steps = engine.num_steps - steps_before
    return {"steps": steps, **{name: round(t / steps * 1e3, 3) for name, t in totals.items()}}


def compile_times(tokenizer_path: Path, vocab_size: int, repeats: int) -> dict:
    tokenizer = Tokenizer.from_path(tokenizer_path)
    times = []
    for _ in range(repeats):
        compiler = GrammarCompiler(tokenizer, vocab_size, tokenizer.eos_token_ids)
        for _, schema in SCHEMAS:
            start = time.perf_counter()
            compiler.compile(Constraint("json_schema", json.dumps(schema)))
            times.append(time.perf_counter() - start)
    times.sort()
    return {
        "compiles": len(times),
        "p50_ms": round(1000 * statistics.median(times), 2),
        "p99_ms": round(1000 * times[min(len(times) - 1, int(0.99 * len(times)))], 2),
        "max_ms": round(1000 * times[-1], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument(
        "--tokenizer", type=Path, help="an HF tokenizer directory or a .gguf; default SmolLM2's"
    )
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/pagedserve-bench-models"))
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--documents", type=int, default=8, help="documents of its schema per answer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile-repeats", type=int, default=5)
    p.add_argument("--device", default="auto")
    p.add_argument("--phases", action="store_true", help="time the engine's parts per step")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="queue each step before the last one is read back (default: on a GPU only)",
    )
    p.add_argument(
        "--grammar-fast-forward",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="append the tokens a grammar forces without a step each (default: the engine's)",
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()

    tokenizer_path = args.tokenizer or resolve_model(None)
    model = model_with_tokenizer(args.shape, tokenizer_path, args.model_dir)
    # Only when asked: the engines an A/B stages may predate the setting.
    given = (
        {}
        if args.grammar_fast_forward is None
        else {"grammar_fast_forward": args.grammar_fast_forward}
    )
    llm = LLM(
        str(model),
        device=args.device,
        enable_prefix_caching=False,
        async_scheduling=args.async_scheduling,
        **given,
    )
    prompts, constrained = [], []
    for i in range(args.requests):
        prompt, schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(f"Request {i}. {prompt} Answer in JSON, {args.documents} of them.")
        constraint = Constraint("json_schema", json.dumps(documents(schema, args.documents)))
        constrained.append(
            SamplingParams(
                temperature=0.6, seed=i, max_tokens=args.max_tokens, constraint=constraint
            )
        )
    with_schema, schema_runs = timed_runs(llm, prompts, constrained, args.repeats)
    lengths = [len(o.outputs[0].token_ids) for o in with_schema["outputs"]]
    free = [
        SamplingParams(temperature=0.6, seed=i, max_tokens=n, ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    without, free_runs = timed_runs(llm, prompts, free, args.repeats)
    tok_s = {
        "json_schema": with_schema["output_tokens"] / with_schema["seconds"],
        "none": without["output_tokens"] / without["seconds"],
    }
    overhead = 1 - tok_s["json_schema"] / tok_s["none"]
    compiled = compile_times(
        tokenizer_path, llm.engine.model_config.vocab_size, args.compile_repeats
    )
    result = {
        **run_info(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "shape": args.shape,
        "vocab_size": llm.engine.model_config.vocab_size,
        "requests": args.requests,
        "async_scheduling": llm.engine.config.uses_async_scheduling,
        "grammar_fast_forward": getattr(llm.engine.config, "grammar_fast_forward", False),
        "output_tokens": with_schema["output_tokens"],
        "output_tok_s": {k: round(v, 1) for k, v in tok_s.items()},
        "overhead": round(overhead, 4),
        "runs": {"json_schema": schema_runs, "none": free_runs},
        "compile": compiled,
    }
    print(
        f"{args.requests} requests, {with_schema['output_tokens']} output tokens: "
        f"json_schema {tok_s['json_schema']:,.0f} tok/s in {with_schema['steps']} steps "
        f"({with_schema['graph_steps']} in CUDA graphs; {with_schema['forced_tokens']} "
        f"tokens forced), none {tok_s['none']:,.0f} tok/s in {without['steps']} steps "
        f"({without['graph_steps']} in CUDA graphs), "
        f"overhead {100 * overhead:.1f}%; compile p50 {compiled['p50_ms']} ms, "
        f"p99 {compiled['p99_ms']} ms"
    )
    if args.phases:
        result["phases"] = {
            "json_schema": phase_times(llm, prompts, constrained),
            "none": phase_times(llm, prompts, free),
        }
        for name in result["phases"]["json_schema"]:
            row = [result["phases"][kind].get(name, 0.0) for kind in ("json_schema", "none")]
            print(f"  {name:45} {row[0]:8.3f} {row[1]:8.3f}")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
