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
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import run_info  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
SHAPES = ((256, 700), (200, 1000), (128, 1300), (32, 1500))  # (sequences, context tokens)


# (name, page size): the engine's kernel first; the others are checked against its output.
VARIANTS = (
    ("cuda-core", 16),  # BatchDecodeWithPagedKVCacheWrapper, what the engine runs
    ("tensor-core", 16),  # the same wrapper on the prefill kernels (backend auto)
    ("tensor-core-fa3", 16),  # ... on the Hopper FA3 prefill kernels
    ("xqa", 16),  # TensorRT-LLM's XQA decode kernel (no plan: block table + lengths)
    ("cuda-core", 32),
    ("xqa", 32),
)


def decode_call(variant: str, q, cache, table, context: int, page_size: int, out):
    """One layer's decode as a no-argument call, its plan (if any) done here."""
    import flashinfer

    batch, pages_per_seq = table.shape
    scale = HEAD_DIM**-0.5
    if variant == "xqa":
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
        seq_lens = torch.full((batch,), context, dtype=torch.uint32, device="cuda")
        return lambda: xqa_batch_decode_with_kv_cache(
            q, cache, workspace, table, seq_lens, context, bmm1_scale=scale, out=out
        )
    indices = table.reshape(-1)
    indptr = torch.arange(batch + 1, dtype=torch.int32) * pages_per_seq
    last_page_len = torch.full(
        (batch,), context - (pages_per_seq - 1) * page_size, dtype=torch.int32
    )
    workspace = torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda")
    extra = {"backend": "fa3"} if variant == "tensor-core-fa3" else {}
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        "NHD",
        use_cuda_graph=True,
        use_tensor_cores=variant != "cuda-core",
        paged_kv_indptr_buffer=indptr.cuda(),
        paged_kv_indices_buffer=indices,
        paged_kv_last_page_len_buffer=last_page_len.cuda(),
        **extra,
    )
    wrapper.plan(
        indptr,
        indices,
        last_page_len,
        NUM_HEADS,
        NUM_KV_HEADS,
        HEAD_DIM,
        page_size,
        sm_scale=scale,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )
    return lambda: wrapper.run(q, cache, out=out)


def time_shape(batch: int, context: int, page_size: int, variants: list[str]) -> list[dict]:
    """Microseconds per call of one layer's decode, replayed in a CUDA graph, per variant;
    each variant's output is compared with the first's."""
    from triton.testing import do_bench_cudagraph

    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    cache = torch.randn(
        num_pages, 2, page_size, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"
    )
    # Pages shuffled over the pool, as a long-running engine's tables are.
    table = torch.randperm(num_pages, dtype=torch.int32, device="cuda").view(batch, -1)
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    kv_bytes = batch * context * 2 * NUM_KV_HEADS * HEAD_DIM * 2
    rows, reference = [], None
    for variant in variants:
        row = dict(batch=batch, context=context, variant=variant, page_size=page_size)
        out = torch.empty_like(q)
        try:
            call = decode_call(variant, q, cache, table, context, page_size, out)
            call()
            torch.cuda.synchronize()
            if reference is None:
                reference = out.clone()
            row["max_abs_diff"] = round((out.float() - reference.float()).abs().max().item(), 4)
            us = do_bench_cudagraph(call) * 1e3
            row.update(us=round(us, 1), kv_tb_s=round(kv_bytes / us / 1e6, 2))
        except Exception as error:  # one variant failing must not lose the others
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    rows = []
    for batch, context in SHAPES:
        for page_size in sorted({size for _, size in VARIANTS}):
            variants = [name for name, size in VARIANTS if size == page_size]
            rows += time_shape(batch, context, page_size, variants)
    if args.json_out:
        args.json_out.write_text(json.dumps({**run_info(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
