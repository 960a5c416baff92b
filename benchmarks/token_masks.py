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
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import llguidance
import llguidance.numpy
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import run_info  # noqa: E402
from engine.constraints import Constraint  # noqa: E402
from engine.grammar import GrammarCompiler  # noqa: E402
from engine.kernels.race import unpack_bitmask  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from engine.tokenizer import Tokenizer  # noqa: E402

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--device", default="cpu", help="where the unpacking runs")
    p.add_argument("--tokenizer", type=Path, help="default: the embedded default's")
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

    result = {**run_info(), "device": str(device), "vocab_size": vocab_size, "results": results}
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
