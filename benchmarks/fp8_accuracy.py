"""What each fp8 mode costs in accuracy: teacher-forced top-1 agreement with bf16, and NLL.

    python benchmarks/fp8_accuracy.py [--model PATH | --random-shape NAME [--tokenizer PATH]]
        [--device cpu|cuda] --json-out result.json

The model (default: the embedded SmolLM2-135M-Instruct) reads a fixed English text once per
mode, through the engine's prompt logprobs: at every position its top-2 next tokens and the
logprob of the text's own next token. Against the bf16 run on the same weights, a mode's
agreement is the share of positions where its top-1 token is bf16's, overall and on the
decisive positions (bf16's top two at least 0.1 apart); its NLL is the mean negative
logprob of the text's tokens. A mode the device cannot run (fp8 weights on the CPU) is
reported with the one line that refuses it.

With --random-shape the weights are random bf16 ones in a shape of benchmarks/gpu_bench.py
(transformers' initialisation), reading the same text as the embedded model's tokens (or
--tokenizer's: an HF tokenizer directory or a .gguf); its NLL means nothing, its agreement
says what fp8 does to weights that were never trained.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import run_info  # noqa: E402

# The opening of Darwin's "On the Origin of Species" (1859, public domain).
TEXT = (
    "When on board H.M.S. Beagle, as naturalist, I was much struck with certain facts in the "
    "distribution of the inhabitants of South America, and in the geological relations of "
    "the present to the past inhabitants of that continent. These facts seemed to me to "
    "throw some light on the origin of species, that mystery of mysteries, as it has been "
    "called by one of our greatest philosophers. On my return home, it occurred to me, in "
    "1837, that something might perhaps be made out on this question by patiently "
    "accumulating and reflecting on all sorts of facts which could possibly have any "
    "bearing on it. After five years' work I allowed myself to speculate on the subject, and "
    "drew up some short notes; these I enlarged in 1844 into a sketch of the conclusions, "
    "which then seemed to me probable: from that period to the present day I have steadily "
    "pursued the same object. I hope that I may be excused for entering on these personal "
    "details, as I give them to show that I have not been hasty in coming to a decision. "
    "My work is now nearly finished; but as it will take me two or three more years to "
    "complete it, and as my health is far from strong, I have been urged to publish this "
    "Abstract. I have more especially been induced to do this, as Mr. Wallace, who is now "
    "studying the natural history of the Malay archipelago, has arrived at almost exactly "
    "the same general conclusions that I have on the origin of species."
)
DECISIVE_GAP = 0.1
MODES = {
    "bf16": {},
    "fp8 KV": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8 weights": {"quantization": "fp8"},
    "fp8 weights + fp8 KV": {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3"},
}


def read_text(
    model: str | None, device: str, settings: dict, text: str | list[int] = TEXT
) -> list | str:
    """Each position's TokenLogprob (top 2) for the text (or its token ids), or the line
    refusing the mode."""
    from engine.errors import ModelLoadError, ValidationError
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    try:
        llm = LLM(model, device=device, dtype="bfloat16", **settings)
    except (ValidationError, ModelLoadError, ValueError) as exc:
        return str(exc)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    (output,) = llm.generate([text], params)
    return [p for p in output.prompt_logprobs if p is not None]


def compare(reference: list, positions: list) -> dict:
    agree = decisive = decisive_agree = 0
    for ref, got in zip(reference, positions, strict=True):
        same = ref.top[0][0] == got.top[0][0]
        agree += same
        if ref.top[0][1] - ref.top[1][1] >= DECISIVE_GAP:
            decisive += 1
            decisive_agree += same
    return {
        "top1_agreement": round(agree / len(reference), 4),
        "decisive_positions": decisive,
        "decisive_agreement": round(decisive_agree / max(decisive, 1), 4),
    }


def random_model(shape: str, tokenizer: Path | None) -> tuple[str, list[int]]:
    """A random-weight model of `shape` (written once, under the temp dir) and the text as
    the tokenizer's tokens (default: the embedded model's), which must index its vocabulary."""
    import tempfile

    from benchmarks.gpu_bench import SHAPES, write_random_model
    from engine.model_store import resolve_model
    from engine.text.tokenizer import Tokenizer

    path = Path(tempfile.gettempdir()) / "pagedserve-bench-models" / shape
    write_random_model(SHAPES[shape], path)
    ids = Tokenizer.from_path(tokenizer or resolve_model(None)).encode(TEXT)
    assert max(ids) < SHAPES[shape].vocab_size, "the text's tokens are not in its vocabulary"
    return str(path), ids


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument(
        "--random-shape", default=None, help="random weights in this gpu_bench shape instead"
    )
    p.add_argument(
        "--tokenizer", type=Path, default=None, help="--random-shape's tokens (default: embedded)"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args()

    model, text = args.model, TEXT
    if args.random_shape is not None:
        model, text = random_model(args.random_shape, args.tokenizer)
    results: dict = {}
    reference = None
    for mode, settings in MODES.items():
        positions = read_text(model, args.device, settings, text)
        if isinstance(positions, str):
            results[mode] = {"not_run": positions}
        else:
            nll = -sum(p.logprob for p in positions) / len(positions)
            results[mode] = {"positions": len(positions), "nll": round(nll, 4)}
            reference = reference or positions
            results[mode] |= compare(reference, positions)
        print(f"{mode}: {results[mode]}")
    if args.json_out:
        name = args.model or "embedded default"
        if args.random_shape is not None:
            name = f"random weights, {args.random_shape} shape"
        result = {**run_info(), "model": name, "device": args.device}
        args.json_out.write_text(json.dumps({**result, "modes": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
