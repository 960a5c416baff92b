"""The CPU projections' matmul: MKL (F.linear) against oneDNN, by row count.

    python benchmarks/cpu_linear.py [--rows 1 2 4 8 15 16 31 32 64 256 2048] [--json-out F]

Every projection of SmolLM2-135M (the embedded default: 30 layers of qkv, o, gate_up and
down, then the LM head), random float32 weights, run one after the other as a step runs
them: the weights come from memory, not from the cache, unlike a loop over one matrix.
For each row count, the best of --repeats passes over all of them, in ms and GFLOP/s.
engine/model/llama.py's linear() takes oneDNN on the CPU for what this measures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import run_info  # noqa: E402

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152  # SmolLM2-135M
LAYER_SHAPES = [(960, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]
KERNELS = {
    "mkl": lambda x, w: F.linear(x, w),
    "mkl_transposed": lambda x, w: (w @ x.T).T,  # the same product, MKL's other layout
    "onednn": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
}


def one_pass(kernel, weights: list[torch.Tensor], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for weight in weights:
        kernel(inputs[weight.shape[1]], weight)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--rows", type=int, nargs="+", default=[1, 2, 4, 8, 15, 16, 31, 32, 64, 256, 2048]
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()

    torch.manual_seed(0)
    weights = [torch.randn(shape) for _ in range(LAYERS) for shape in LAYER_SHAPES]
    weights.append(torch.randn(VOCAB, HIDDEN))  # the LM head (tied to the embeddings)
    params = sum(w.numel() for w in weights)
    rows_out = []
    for rows in args.rows:
        inputs = {width: torch.randn(rows, width) for width in (HIDDEN, INTERMEDIATE)}
        row = {"rows": rows}
        for name, kernel in KERNELS.items():
            one_pass(kernel, weights, inputs)  # first touch: pages, kernel choice
            seconds = min(one_pass(kernel, weights, inputs) for _ in range(args.repeats))
            row[f"{name}_ms"] = round(seconds * 1e3, 2)
            row[f"{name}_gflops"] = round(2 * rows * params / seconds / 1e9, 1)
        rows_out.append(row)
        print(f"{rows:5} rows:", *(f"{k} {row[k + '_ms']:8.2f} ms" for k in KERNELS), flush=True)
    if args.json_out:
        result = {**run_info(), "torch_threads": torch.get_num_threads(), "rows": rows_out}
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
