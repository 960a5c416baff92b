"""GPU micro-benchmark: the paged decode kernels at the offline workload's shapes.

    python benchmarks/gpu_attention.py [--workload-only] [--variants NAME ...]
        [--kv-cache-dtype fp8_e4m3] [--triton-sweep] [--json-out FILE]

Decode attention is most of a steady decode step's GPU time (benchmarks/RESULTS.md's git
history), so this times the choices the engine could make for it, in a CUDA graph as the
engine runs it. Shapes are Qwen3-0.6B's (16 q / 8 kv heads of 128, bf16): equal-length
batch x context pairs, and the uneven lengths of the offline workload's own decode steps
(WORKLOAD_STEPS); the figure is the KV bytes read per second, against the roofline's copy
bandwidth. Variants: the CUDA-core kernel and the tensor-core one (flashinfer's prefill
kernels), which engine/attention/flashinfer_backend.py picks between by batch size, on the
engine's pool (NHD layout, 16-token pages), and the tensor-core path with its KV split off
or at a fixed length (each split costs a merge kernel) or on 32- and 64-token pages, and
both kernels on 64-token pages in the NHD and the HND layout, and the engine's own Triton
kernel (engine/kernels/decode_attention.py, which the CUDA-graph decode runs) on 64- and
16-token pages, with DecodeConfig.for_batch's settings; the
workload's steps also with the batch ordered longest context first (--workload-only: the
workload's steps as they come). TensorRT-LLM's XQA kernel
(flashinfer.decode.xqa_batch_decode_with_kv_cache) is still in decode_call, out of
VARIANTS. Earlier runs found no gain in the HND layout, in 32-token pages or in the FA3
backend of the tensor-core path (1.5-1.9 TB/s; benchmarks/RESULTS.md's git history).

--kv-cache-dtype fp8_e4m3 stores the pool in e4m3 (scales 1), as the engine's fp8 KV
cache does: every variant reads half the bytes, and the figure counts those.
--triton-sweep adds the Triton kernel at TRITON_SWEEP's launch settings (chunks per SM,
tokens per loop step, pipeline stages) beside DecodeConfig.for_batch's, each also on a
float16 q: with one-byte K and V a loop step of the same tokens reads half as much, and
widening e4m3 to bfloat16 takes more instructions than to float16, so the 16-bit choices
need not hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import run_info  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 128
SHAPES = (
    (256, 700),
    (200, 1000),
    (128, 1300),
    (32, 1500),
    (8, 1000),
    (1, 300),
)  # (sequences, context tokens)
# Decode steps of the offline workload itself (gpu_bench's nano-vllm workload, every prompt
# prefilled at once): after `step` decode steps the sequences still running have contexts
# of prompt + step tokens, from ~100 to ~2000. Lengths this uneven leave a kernel's longest
# sequences running after the rest are done, which equal-length shapes do not show.
WORKLOAD_STEPS = (50, 300, 600, 850, 950)


def workload_contexts(step: int) -> list[int]:
    from benchmarks.gpu_bench import NANO_VLLM_WORKLOAD
    from benchmarks.workload import make_workload

    work = make_workload(NANO_VLLM_WORKLOAD)
    return [
        len(prompt) + step
        for prompt, out in zip(work.prompts, work.output_lens, strict=True)
        if out > step
    ]


# (name, page size): the first variant's output is the reference the others are checked
# against. XQA, TensorRT-LLM's decode kernel (no plan: block table + lengths), was slower
# at every shape (benchmarks/RESULTS.md's git history, 2026-11-30) and is left out by default.
VARIANTS = (
    ("cuda-core", 16),  # BatchDecodeWithPagedKVCacheWrapper
    ("tensor-core", 16),  # the same wrapper on the prefill kernels (backend auto)
    # The tensor-core path's KV split, which costs a merge kernel per layer: none, or a
    # fixed split length instead of the planner's (flashinfer's plan() options).
    ("tensor-core, no split", 16),
    ("tensor-core, 128-token splits", 16),
    ("tensor-core, 512-token splits", 16),
    # Larger pages for the tensor-core path (the CUDA-core kernel's changed < 3% at 32).
    ("tensor-core", 32),
    # 64-token pages, the engine's default on CUDA since 6a52c8d: both kernels, on the NHD
    # pool and on the HND one (each head's page one contiguous 16 KiB run).
    ("tensor-core", 64),
    ("tensor-core, HND", 64),
    ("cuda-core", 64),
    ("cuda-core, HND", 64),
    # engine/kernels/decode_attention.py, the CUDA-graph decode's kernel (triton_call).
    ("triton", 64),
    ("triton", 16),
)
# "triton x<chunks per SM> n<tokens per loop step> s<pipeline stages>", on 64-token pages.
TRITON_SWEEP = tuple(
    (f"triton x{chunks} n{tokens} s{stages}{widen}", 64)
    for chunks in (1, 2)
    for tokens in (64, 128, 256)
    for stages in (2, 3, 4)
    for widen in ("", " fp16")
)
SPLIT_OPTIONS = {  # variant -> extra plan() arguments
    "tensor-core, no split": {"disable_split_kv": True},
    "tensor-core, 128-token splits": {"fixed_split_size": 8},  # in 16-token pages
    "tensor-core, 512-token splits": {"fixed_split_size": 32},
}


def triton_call(variant: str, q, cache, pages: list[torch.Tensor], contexts, out):
    """engine/kernels/decode_attention.py as the engine configures it ("triton"), or with
    "triton x<chunks per SM> n<tokens per loop step> s<pipeline stages>". A last word
    "fp16" runs it on a float16 q (copied back into out, a microsecond), so that an fp8
    pool's tiles widen to float16, one conversion instruction a pair, not to bfloat16."""
    from engine.kernels.decode_attention import (
        DecodeConfig,
        DecodeWorkspace,
        paged_decode_attention,
    )

    words = variant.split()[1:]
    half = words[-1:] == ["fp16"]
    options = {word[0]: int(word[1:]) for word in words[: len(words) - half]}
    config = DecodeConfig(options["x"], options["n"], options["s"]) if options else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    work = DecodeWorkspace(len(contexts), NUM_HEADS, HEAD_DIM, sms, "cuda", config)
    lens = np.asarray(contexts, dtype=np.int32)
    indptr = np.zeros(len(pages) + 1, dtype=np.int32)
    np.cumsum([len(p) for p in pages], out=indptr[1:])
    work.plan.copy_(torch.from_numpy(work.host_plan(lens, indptr)))
    indices = torch.cat(pages)
    print(f"{variant}: {work.config}, chunk {work.split[1].item()}, {work.split[0].item()} items")
    if half:
        q16, out16 = q.half(), torch.empty_like(q, dtype=torch.float16)
        return lambda: out.copy_(
            paged_decode_attention(q16, cache, indices, work, HEAD_DIM**-0.5, out=out16)
        )
    return lambda: paged_decode_attention(q, cache, indices, work, HEAD_DIM**-0.5, out=out)


def decode_call(variant: str, q, cache, pages: list[torch.Tensor], contexts, page_size: int, out):
    """One layer's decode as a no-argument call, its plan (if any) done here."""
    import flashinfer

    scale = HEAD_DIM**-0.5
    if variant == "xqa":
        from flashinfer.decode import xqa_batch_decode_with_kv_cache

        workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
        seq_lens = torch.tensor(contexts, dtype=torch.uint32, device="cuda")
        table = torch.nn.utils.rnn.pad_sequence(pages, batch_first=True)
        return lambda: xqa_batch_decode_with_kv_cache(
            q, cache, workspace, table, seq_lens, max(contexts), bmm1_scale=scale, out=out
        )
    if variant.startswith("triton"):
        return triton_call(variant, q, cache, pages, contexts, out)
    indices = torch.cat(pages)
    counts = torch.tensor([len(p) for p in pages], dtype=torch.int32)
    indptr = torch.nn.functional.pad(counts.cumsum(0, dtype=torch.int32), (1, 0))
    last_page_len = torch.tensor(contexts, dtype=torch.int32) - (counts - 1) * page_size
    workspace = torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda")
    extra = {"backend": "fa3"} if variant == "tensor-core-fa3" else {}
    layout = "HND" if "HND" in variant else "NHD"
    if layout == "HND":  # the same pages, each head's tokens contiguous
        cache = cache.transpose(2, 3).contiguous()
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace,
        layout,
        use_cuda_graph=True,
        use_tensor_cores=not variant.startswith("cuda-core"),
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
        kv_data_type=cache.dtype,
        **SPLIT_OPTIONS.get(variant, {}),
    )
    return lambda: wrapper.run(q, cache, out=out)


def time_shape(
    name: str, contexts: list[int], page_size: int, variants: list[str], kv_dtype: torch.dtype
) -> list[dict]:
    """Microseconds per call of one layer's decode over sequences of the given context
    lengths, replayed in a CUDA graph, per variant; each variant's output is compared with
    the first's."""
    from triton.testing import do_bench_cudagraph

    batch = len(contexts)
    counts = [-(-n // page_size) for n in contexts]
    cache = torch.randn(
        sum(counts), 2, page_size, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda"
    ).to(kv_dtype)
    # Pages shuffled over the pool, as a long-running engine's tables are.
    pages = list(torch.randperm(sum(counts), dtype=torch.int32, device="cuda").split(counts))
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
    kv_bytes = sum(contexts) * 2 * NUM_KV_HEADS * HEAD_DIM * cache.element_size()
    rows, reference = [], None
    for variant in variants:
        row = dict(shape=name, batch=batch, context=round(sum(contexts) / batch), variant=variant)
        row.update(page_size=page_size, kv_dtype=str(kv_dtype).removeprefix("torch."))
        out = torch.empty_like(q)
        try:
            call = decode_call(variant, q, cache, pages, contexts, page_size, out)
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
    p.add_argument(
        "--workload-only", action="store_true", help="only the workload's own steps, as given"
    )
    p.add_argument("--variants", nargs="+", help="only these variants (by name)")
    p.add_argument(
        "--kv-cache-dtype", choices=("bfloat16", "fp8_e4m3"), default="bfloat16", help="the pool's"
    )
    p.add_argument(
        "--triton-sweep", action="store_true", help="and the Triton kernel at TRITON_SWEEP"
    )
    args = p.parse_args()
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
    chosen = [(v, size) for v, size in VARIANTS if not args.variants or v in args.variants]
    chosen += TRITON_SWEEP if args.triton_sweep else ()
    shapes = {f"workload step {step}": workload_contexts(step) for step in WORKLOAD_STEPS}
    if not args.workload_only:
        shapes |= {f"{batch} x {context}": [context] * batch for batch, context in SHAPES}
        # The same steps with the batch ordered longest context first: the GPU hands out
        # thread blocks in batch order, so the longest sequences start first and the short
        # ones fill in behind them (longest-processing-time-first scheduling).
        shapes |= {
            f"workload step {step}, longest first": sorted(workload_contexts(step), reverse=True)
            for step in WORKLOAD_STEPS
        }
    rows = []
    for name, contexts in shapes.items():
        for page_size in sorted({size for _, size in chosen}):
            variants = [variant for variant, size in chosen if size == page_size]
            rows += time_shape(name, contexts, page_size, variants, kv_dtype)
    if args.json_out:
        args.json_out.write_text(json.dumps({**run_info(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
