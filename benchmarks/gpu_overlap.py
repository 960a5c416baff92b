"""GPU micro-benchmark: a decode step as one batch, or as two half-batches on two streams.

    python benchmarks/gpu_overlap.py [--steps 50 300 600 850] [--json-out FILE]

Why: at the offline workload's large decode batches a layer's attention reads KV at
close to the copy bandwidth, while its four GEMMs and five small kernels sit at a
per-kernel floor of a few microseconds, far from any limit (RESULTS.md). Cut the batch in
two halves and give each its own chain of kernels on its own stream, and one half's
GEMMs can run while the other half's attention streams KV: the step could take about
its attention time plus one weight read per layer instead of the sum of everything.

It times the real engine model (Qwen3-0.6B shape, random bf16 weights, 64-token pages),
its whole forward captured in a CUDA graph per variant, at the workload's own decode
steps (gpu_attention.py's WORKLOAD_STEPS contexts), in microseconds per step:

- `one batch`: the engine's decode graph as it is (one chain, one decode plan);
- `one batch, longest first`: the same with the rows ordered longest context first, so
  that the attention kernel starts the thread blocks of the longest sequences first (no
  consistent gain: RESULTS.md);
- `halves, one stream`: the two half-batches one after the other (what splitting costs);
- `halves, two streams`: the halves as two independent chains (the GPU interleaves them
  as it likes);
- `halves, ping-pong`: two streams, and each half's attention of layer l waits for the
  other half's attention before it (layer l-1 for the first half, l for the second), so
  the attentions alternate and each runs beside the other half's GEMMs.

The halves are balanced by context (sorted, dealt alternately), each longest first.
Each variant's output is checked against the first variant's (`one batch` by default).

`--variants "one batch"` alone is the A/B for any change to the decode forward
(`run.sh forward forward-base`): on one machine it repeats within ~0.3%, where whole
offline runs spread by several percent.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_attention import WORKLOAD_STEPS, workload_contexts  # noqa: E402
from benchmarks.gpu_bench import SHAPES, write_random_model  # noqa: E402
from benchmarks.workload import run_info  # noqa: E402

PAGE = 64
# variant -> (its chains' rows, the chains on two streams, attentions alternating)
VARIANTS = {
    "one batch": ("arrival order", False, False),
    "one batch, longest first": ("longest first", False, False),
    "halves, one stream": ("halves", False, False),
    "halves, two streams": ("halves", True, False),
    "halves, ping-pong": ("halves", True, True),
}


class SwitchBackend:
    """An attention backend whose decode (and the events around it) the capture sets
    before each chain's layer: the captured kernels keep whatever was set."""

    def __init__(self) -> None:
        self.attn = None  # the chain's engine backend, planned for its graph decode
        self.wait_for: torch.cuda.Event | None = None
        self.done: torch.cuda.Event | None = None

    def plan(self, meta) -> None:  # planned outside, per chain
        pass

    def forward(self, q, kv_cache, meta, scale):
        if self.wait_for is not None:
            torch.cuda.current_stream().wait_event(self.wait_for)
        out = self.attn.forward(q, kv_cache, meta, scale)
        if self.done is not None:
            self.done.record()
        return out


class Chain:
    """One chain's static inputs (the whole batch or a half): token ids, positions, KV
    slots, and an engine attention backend planned for its CUDA-graph decode. Each chain
    has its own backend, so two chains running at once keep their split-KV partial results
    apart."""

    def __init__(
        self, token_ids: list[int], contexts: list[int], pages: list[list[int]], cfg, kv_dtype
    ) -> None:
        from engine.attention.base import AttentionMetadata
        from engine.attention.flashinfer_backend import FlashInferAttention

        n = len(contexts)
        dev = "cuda"
        self.input_ids = torch.tensor(token_ids, device=dev)
        self.positions = torch.tensor([c - 1 for c in contexts], device=dev)
        slots = [p[(c - 1) // PAGE] * PAGE + (c - 1) % PAGE for c, p in zip(contexts, pages)]
        self.meta = AttentionMetadata(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(contexts, dtype=torch.int32, device=dev),
            block_tables=None,
            slot_mapping=torch.tensor(slots, device=dev),
            query_lens_cpu=[1] * n,
            seq_lens_cpu=contexts,
            block_size=PAGE,
        )
        self.attn = FlashInferAttention(torch.device(dev))
        self.attn.configure(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, kv_dtype)
        num_pages = sum(map(len, pages))
        self.attn.add_graph_batch_size(n, torch.zeros(num_pages, dtype=torch.int32, device=dev))
        self.attn.plan_graph(contexts, pages, PAGE)


def run_layers(model, backend, chains, streams, kv_caches, ping_pong: bool) -> list:
    """Queue the model's forward for each chain on its stream, layer by layer in turn."""
    inner = model.model
    hidden, residual = [], []
    for chain, stream in zip(chains, streams):
        with torch.cuda.stream(stream):
            hidden.append(inner.embed_tokens(chain.input_ids))
            residual.append(None)
    cos_sin = []
    for chain, stream in zip(chains, streams):
        with torch.cuda.stream(stream):
            cos_sin.append(inner.rotary_emb(chain.positions))
    done_prev = None  # the last attention queued, of whichever chain
    for layer, kv in zip(inner.layers, kv_caches, strict=True):
        for i, (chain, stream) in enumerate(zip(chains, streams)):
            with torch.cuda.stream(stream):
                backend.attn = chain.attn
                backend.wait_for = done_prev if ping_pong else None
                backend.done = torch.cuda.Event() if ping_pong else None
                cos, sin = cos_sin[i]
                hidden[i], residual[i] = layer(hidden[i], residual[i], cos, sin, kv, chain.meta)
                done_prev = backend.done
    outs = []
    for i, stream in enumerate(streams):
        with torch.cuda.stream(stream):
            outs.append(inner.norm(hidden[i], residual[i])[0])
    backend.wait_for = backend.done = None
    return outs


def capture(model, backend, chains, kv_caches, two_streams: bool, ping_pong: bool):
    main = torch.cuda.Stream()
    side = torch.cuda.Stream() if two_streams else main
    streams = [main] + [side] * (len(chains) - 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(main):
        run_layers(model, backend, chains, streams, kv_caches, ping_pong)  # warm-up
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=main):
            side.wait_stream(main)
            outs = run_layers(model, backend, chains, streams, kv_caches, ping_pong)
            main.wait_stream(side)
    return graph, outs


def time_graph(graph: torch.cuda.CUDAGraph, repeats: int = 30) -> float:
    """Median microseconds per replay, each timed by events, the GPU kept busy before it."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2]


@torch.inference_mode()
def time_step(model, cfg, contexts: list[int], kv_caches, variants: list[str]) -> list[dict]:
    counts = [-(-c // PAGE) for c in contexts]
    # Pages shuffled over the pool, as a long-running engine's tables are.
    pages = [part.tolist() for part in torch.randperm(sum(counts)).split(counts)]
    # One new token per sequence, whichever chain it runs in, so every variant's output
    # can be compared with the first's.
    token_ids = torch.randint(0, 10000, (len(contexts),)).tolist()
    longest_first = sorted(range(len(contexts)), key=contexts.__getitem__, reverse=True)
    parts = {  # each chain's sequences, by index into contexts, in its row order
        "arrival order": [list(range(len(contexts)))],  # as the scheduler lays out a step
        "longest first": [longest_first],
        # balanced halves: sorted, dealt alternately
        "halves": [longest_first[0::2], longest_first[1::2]],
    }
    backend = model.model.layers[0].self_attn.backend
    rows, reference = [], None
    for variant in variants:
        order, two_streams, ping_pong = VARIANTS[variant]
        chains = [
            Chain(
                [token_ids[i] for i in part],
                [contexts[i] for i in part],
                [pages[i] for i in part],
                cfg,
                kv_caches[0].dtype,
            )
            for part in parts[order]
        ]
        graph, outs = capture(model, backend, chains, kv_caches, two_streams, ping_pong)
        graph.replay()
        torch.cuda.synchronize()
        out = outs[0].new_empty(len(contexts), outs[0].shape[1])  # back in arrival order
        for part, part_out in zip(parts[order], outs, strict=True):
            out[part] = part_out
        if reference is None:
            reference = out.clone()
        row = dict(
            batch=len(contexts),
            context=round(sum(contexts) / len(contexts)),
            variant=variant,
            us=round(time_graph(graph), 1),
            max_abs_diff=round((out.float() - reference.float()).abs().max().item(), 4),
        )
        print(row, flush=True)
        rows.append(row)
        del graph, outs, chains
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, nargs="+", default=list(WORKLOAD_STEPS[:4]))
    p.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        help="the first is the reference the others' outputs are compared with",
    )
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()

    from engine.model.loader import load_model

    path = write_random_model(SHAPES["qwen3-0.6b"], Path("/tmp/pagedserve-bench-models/qwen3-0.6b"))
    backend = SwitchBackend()
    model, cfg = load_model(path, torch.bfloat16, torch.device("cuda"), backend)
    steps = {step: workload_contexts(step) for step in args.steps}
    num_pages = max(sum(-(-c // PAGE) for c in ctx) for ctx in steps.values())
    kv_caches = [
        torch.empty(
            num_pages, 2, PAGE, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16, device="cuda"
        ).normal_()
        for _ in range(cfg.num_layers)
    ]
    rows = []
    for step, contexts in steps.items():
        for row in time_step(model, cfg, contexts, kv_caches, args.variants):
            rows.append({"step": step, **row})
    if args.json_out:
        args.json_out.write_text(json.dumps({**run_info(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
