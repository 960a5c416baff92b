"""GPU micro-benchmark: flashinfer's paged decode kernels at the offline workload's shapes.

    python benchmarks/gpu_attention.py [--json-out FILE]

Decode attention is most of a steady decode step's GPU time (benchmarks/RESULTS.md), so
this times the choices the engine could make for it, in a CUDA graph as the engine runs
it: the CUDA-core decode kernel (what engine/attention/flashinfer_backend.py uses for
GQA groups up to 4) and the tensor-core one, at KV page sizes 16 and 32, with the pool in
flashinfer's NHD layout (what the engine uses: [page, token, head, dim]) and in HND
([page, head, token, dim], one head's page contiguous). Shapes are
Qwen3-0.6B's (16 q / 8 kv heads of 128, bf16) with batch x context pairs the workload
goes through; the figure is the KV bytes read per second, against the roofline's copy
bandwidth.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import run_info  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
SHAPES = ((256, 700), (200, 1000), (128, 1300), (32, 1500))  # (sequences, context tokens)


def time_decode(batch: int, context: int, page_size: int, tensor_cores: bool, layout: str) -> float:
    """Microseconds per call of one layer's decode, replayed in a CUDA graph."""
    import flashinfer
    from triton.testing import do_bench_cudagraph

    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    page_shape = (page_size, NUM_KV_HEADS) if layout == "NHD" else (NUM_KV_HEADS, page_size)
    cache = torch.randn(num_pages, 2, *page_shape, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    # Pages shuffled over the pool, as a long-running engine's tables are.
    indices = torch.randperm(num_pages, dtype=torch.int32, device="cuda")
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq
    last_page_len = torch.full(
        (batch,), context - (pages_per_seq - 1) * page_size, dtype=torch.int32
    )
    workspace = torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        layout,
        use_cuda_graph=True,
        use_tensor_cores=tensor_cores,
        paged_kv_indptr_buffer=indptr.cuda(),
        paged_kv_indices_buffer=indices,
        paged_kv_last_page_len_buffer=last_page_len.cuda(),
    )
    wrapper.plan(
        indptr,
        indices,
        last_page_len,
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        page_size,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    return do_bench_cudagraph(lambda: wrapper.run(q, cache, out=out)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    rows = []
    for batch, context in SHAPES:
        kv_bytes = batch * context * 2 * NUM_KV_HEADS * HEAD_DIM * 2
        for layout, page_size, tensor_cores in itertools.product(
            ("NHD", "HND"), (16, 32), (False, True)
        ):
            us = time_decode(batch, context, page_size, tensor_cores, layout)
            row = dict(
                batch=batch,
                context=context,
                layout=layout,
                page_size=page_size,
                tensor_cores=tensor_cores,
                us=round(us, 1),
                kv_tb_s=round(kv_bytes / us / 1e6, 2),
            )
            print(row, flush=True)
            rows.append(row)
    if args.json_out:
        args.json_out.write_text(json.dumps({**run_info(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
