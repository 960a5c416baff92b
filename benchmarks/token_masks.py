"""Token masks on the host: filling them (llguidance) and unpacking them (torch), by rows.

    python benchmarks/token_masks.py [--rows 1 2 4 8 16 64] [--device cpu] [--tokenizer PATH]
        [--json-out F]

Fill: a grammar of a JSON schema for the embedded default's tokenizer (its GGUF's
vocabulary, 49,152 ids; or --tokenizer, an HF tokenizer directory or a .gguf); each row's
matcher stands at a different place in one document of that schema, as a batch's
candidates do. A row at a time on this thread (fill_next_token_bitmask) against all rows
on llguidance's threads (fill_next_token_bitmask_par), the median of --repeats in
microseconds, two ways: "first", each repeat a grammar compiled anew, so that every state
is filled for the first time, as a step meets most of its states; and "again", the same
states filled over and over, which llguidance answers from what it kept.

Unpack: the bitmask to one bool per token, as the sampler needs it wherever masks are not
applied inside a Triton kernel (the CPU; filters on CUDA): a word gathered per token
against each word shifted by 0..31 at once (engine/kernels/race.py's unpack_bitmask).

Walk: a step's fill as benchmarks/structured_output.py's workload meets it. --walk-rows
candidates, each answering an array of 8 documents of one of tests/json_schemas.py's 20
schemas in turn, go --walk-steps steps, each picking a seeded random token among those its
mask allows (a new answer where one ends). Per step: all rows filled one at a time, and on
llguidance's threads as the engine fills them (each on copies of the same matchers, filled
for the first time), the slowest row, the share of rows (and of the one-at-a-time time)
over 100 us, and the share of rows whose mask allows a single token (the grammar forces
it: a forward is not needed to choose it).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.structured_output import documents  # noqa: E402
from benchmarks.workload import run_info  # noqa: E402
from engine.kernels.race import unpack_bitmask  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.structured.constraints import Constraint  # noqa: E402
from engine.structured.grammar import GrammarCompiler  # noqa: E402
from engine.text.tokenizer import Tokenizer  # noqa: E402
from tests.json_schemas import SCHEMAS  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
DOCUMENT = '{"name": "Ada Lovelace of London", "age": 36, "tags": ["maths", "engines", "notes"]}'


def unpack_by_gather(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The other formulation: for each token, its word gathered and shifted."""
    vocab = torch.arange(vocab_size, device=words.device)
    return (words[:, vocab // 32] >> (vocab % 32).to(torch.int32)) & 1 == 1


def median_us(run, args: tuple, repeats: int, sync=lambda: None) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(*args)
        sync()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def fill_one_at_a_time(matchers: list, allowed: np.ndarray) -> None:
    for row, matcher in enumerate(matchers):
        llguidance.numpy.fill_next_token_bitmask(matcher, allowed, row)


@functools.cache
def _parallel() -> llguidance.LLExecutor:
    return llguidance.LLExecutor()  # as the engine's: threads for 80% of the CPUs, up to 32


def fill_in_parallel(matchers: list, allowed: np.ndarray) -> None:
    pairs = [(matcher, row) for row, matcher in enumerate(matchers)]
    llguidance.numpy.fill_next_token_bitmask_par(_parallel(), pairs, allowed)


def placed_matchers(start: llguidance.LLMatcher, document: list[int], rows: int) -> list:
    """rows matchers of the grammar, row r past the document's first 7r tokens (wrapping)."""
    matchers = []
    for row in range(rows):
        matcher = start.deep_copy()
        for token in document[: (row * 7) % len(document)]:
            assert matcher.consume_token(token), matcher.get_error()
        matchers.append(matcher)
    return matchers


def first_fill_us(
    fill, compiler, words: int, document: list[int], rows: int, repeats: int
) -> float:
    """The median over repeats of one fill of rows matchers, each repeat of a new grammar."""
    times = []
    for repeat in range(repeats):
        schema = {**SCHEMA, "title": f"{fill.__name__} {rows} {repeat}"}  # not in the cache
        start = compiler.compile(Constraint("json_schema", json.dumps(schema)))
        matchers = placed_matchers(start, document, rows)
        allowed = np.full((rows, words), -1, dtype=np.int32)
        began = time.perf_counter()
        fill(matchers, allowed)
        times.append(time.perf_counter() - began)
    return round(statistics.median(times) * 1e6, 1)


def walk(compiler: GrammarCompiler, vocab_size: int, rows: int, steps: int) -> dict:
    """Per step of the structured-output workload's rows: the fill's times (module doc)."""
    starts = [
        compiler.compile(Constraint("json_schema", json.dumps(documents(schema, 8))))
        for _, schema in SCHEMAS
    ]
    words, rng = -(-vocab_size // 32), random.Random(0)
    matchers = [starts[row % len(starts)].deep_copy() for row in range(rows)]
    one, parallel = (np.empty((rows, words), dtype=np.int32) for _ in range(2))
    per_step: dict[str, list[float]] = {"one": [], "parallel": [], "slowest": []}
    row_times: list[float] = []
    forced = 0  # rows whose mask allows one token only: no forward needed to choose it
    for step in range(steps):
        # A grammar's copies share what its lexer learns: the way that fills a state first
        # pays for it, so the two ways take turns going first.
        times = []
        for way in ("parallel", "one") if step % 2 else ("one", "parallel"):
            copies = [matcher.deep_copy() for matcher in matchers]
            if way == "parallel":
                began = time.perf_counter()
                fill_in_parallel(copies, parallel)
                per_step["parallel"].append(time.perf_counter() - began)
                continue
            for row, copy in enumerate(copies):
                began = time.perf_counter()
                llguidance.numpy.fill_next_token_bitmask(copy, one, row)
                times.append(time.perf_counter() - began)
        assert np.array_equal(one, parallel)
        per_step["one"].append(sum(times))
        per_step["slowest"].append(max(times))
        row_times += times
        bits = np.unpackbits(one.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
        forced += int((bits.sum(axis=1) == 1).sum())
        for row, matcher in enumerate(matchers):
            token = int(rng.choice(np.flatnonzero(bits[row])))
            if not matcher.consume_token(token) or matcher.is_stopped():
                matchers[row] = starts[rng.randrange(len(starts))].deep_copy()  # a new answer
    slow = [t for t in row_times if t > 100e-6]
    return {
        "rows": rows,
        "steps": steps,
        "one_at_a_time_ms": round(1e3 * statistics.mean(per_step["one"]), 3),
        "in_parallel_ms": round(1e3 * statistics.mean(per_step["parallel"]), 3),
        "slowest_row_ms": round(1e3 * statistics.mean(per_step["slowest"]), 3),
        "rows_over_100us": round(len(slow) / len(row_times), 3),
        "time_in_rows_over_100us": round(sum(slow) / sum(row_times), 3),
        "rows_with_one_token": round(forced / len(row_times), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--device", default="cpu", help="where the unpacking runs")
    p.add_argument("--tokenizer", type=Path, help="default: the embedded default's")
    p.add_argument("--walk-rows", type=int, nargs="*", default=[28, 64])
    p.add_argument("--walk-steps", type=int, default=200)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()

    tokenizer = Tokenizer.from_path(args.tokenizer or resolve_model(None))
    vocab_size = tokenizer.vocab_size
    compiler = GrammarCompiler(tokenizer, vocab_size, tokenizer.eos_token_ids)
    start = compiler.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    document = tokenizer.encode(DOCUMENT)
    words = -(-vocab_size // 32)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    results = []
    for rows in args.rows:
        matchers = placed_matchers(start, document, rows)
        allowed = np.full((rows, words), -1, dtype=np.int32)
        fills = (matchers, allowed)
        fill_in_parallel(*fills)
        on_device = torch.from_numpy(allowed).to(device)
        assert torch.equal(
            unpack_bitmask(on_device, vocab_size), unpack_by_gather(on_device, vocab_size)
        )
        unpack = (on_device, vocab_size)
        first = (compiler, words, document, rows, min(args.repeats, 50))
        row = {
            "rows": rows,
            "first_fill_one_at_a_time_us": first_fill_us(fill_one_at_a_time, *first),
            "first_fill_in_parallel_us": first_fill_us(fill_in_parallel, *first),
            "fill_again_one_at_a_time_us": median_us(fill_one_at_a_time, fills, args.repeats),
            "fill_again_in_parallel_us": median_us(fill_in_parallel, fills, args.repeats),
            "unpack_gather_us": median_us(unpack_by_gather, unpack, args.repeats, sync),
            "unpack_shift_us": median_us(unpack_bitmask, unpack, args.repeats, sync),
        }
        print("  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        results.append(row)

    walks = []
    for rows in args.walk_rows:
        walks.append(walk(compiler, vocab_size, rows, args.walk_steps))
        print("  ".join(f"{k} {v}" for k, v in walks[-1].items()), flush=True)
    result = {
        **run_info(),
        "device": str(device),
        "vocab_size": vocab_size,
        "results": results,
        "walk": walks,
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
