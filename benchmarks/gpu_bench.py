"""GPU benchmarks: offline throughput against its roofline, and batch-1 latency.

    python benchmarks/gpu_bench.py --shape qwen3-0.6b --json-out result.json [--compare-transformers]

The model is random bf16 weights of a real model's shape: this tool writes its config and a
tokenizer, and the engine draws the weights as it loads (load_format="dummy"), so no
download and no checkpoint on disk; speed does not depend on the weights' values, except a
mixture of experts' through its routing, which random weights spread evenly.
The throughput workload is nano-vllm's: random.seed(0); 256 prompts of randint(100, 1024)
token ids drawn with randint(0, 10000), then 256 output lengths randint(100, 1024),
ignore_eos, temperature 0.6 — 142,827 prompt and 133,966 output tokens — run --repeats
times (default 3) on one engine after --warmup-runs untimed runs (default 1); the figures
are the median timed run's, each run's is kept, the warm-ups' too.

The roofline is this workload's time floor on this GPU, measured in the same run: every
decode step reads the weights once and each running sequence's whole KV; prefill runs at
the measured matmul rate. floor = decode bytes / copy bandwidth + prefill FLOPs / matmul
rate, where the copy bandwidth and matmul rate are timed here before the run. A mixture of
experts' decode step reads the experts its sequences chose (their expected number under
even routing) and its prefill multiplies by the chosen experts only; a sliding-window
layer reads at most its window of KV.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workload import Workload, WorkloadSpec, make_workload, run_info  # noqa: E402

NANO_VLLM_WORKLOAD = WorkloadSpec(
    num_prompts=256, min_in=100, max_in=1024, min_out=100, max_out=1024, max_token_id=10000
)


@dataclass(frozen=True)
class Shape:
    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 32768
    # A mixture of experts: every layer's MLP is num_experts SwiGLU experts of
    # moe_intermediate_size, experts_per_token of which run for each token.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    # Sliding-window attention: every global_every-th layer attends to the whole context,
    # the others to their last sliding_window tokens.
    sliding_window: int | None = None
    global_every: int = 1

    def kv_bytes_per_token(self, element_bytes: int = 2) -> int:
        """K and V of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * element_bytes

    @property
    def num_global_layers(self) -> int:
        return (
            self.num_layers if self.sliding_window is None else self.num_layers // self.global_every
        )

    def expert_params(self) -> int:
        """One expert's gate, up and down projections (0 for a dense model)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def shared_params(self) -> int:
        """Every weight but the experts': each token reads all of them."""
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        per_layer = h * (q + 2 * kv) + q * h + 2 * h
        per_layer += self.num_experts * h if self.num_experts else 3 * h * self.intermediate_size
        if self.model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
            per_layer += 2 * self.head_dim  # q_norm, k_norm
        if self.model_type == "gemma3_text":
            per_layer += 2 * h  # the pre- and post-feedforward norms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    def num_params(self) -> int:
        return self.shared_params() + self.num_layers * self.num_experts * self.expert_params()

    def active_params(self) -> int:
        """The weights one token's forward multiplies by: its chosen experts only."""
        chosen = self.num_layers * self.experts_per_token * self.expert_params()
        return self.shared_params() + chosen

    def unprojected_params(self) -> int:
        """The weights outside the linear projections (embeddings, head, norms, router),
        which stay 16-bit when the projections are quantized."""
        h = self.hidden_size
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        per_layer = 2 * h + self.num_experts * h
        if self.model_type in ("qwen3", "qwen3_moe", "gemma3_text"):
            per_layer += 2 * self.head_dim
        if self.model_type == "gemma3_text":
            per_layer += 2 * h
        return self.num_layers * per_layer + embeddings + h

    def decode_weight_bytes(self, running: int, projection_bytes: float = 2) -> float:
        """Bytes a decode step of `running` sequences reads: the shared weights, and in
        each layer the experts some sequence chose, in expectation under uniform routing
        (a random model's router): E * (1 - (1 - k/E)^running) distinct experts. The
        projections' weights take projection_bytes each (1 in fp8), the rest 2."""
        experts = 0.0
        if self.num_experts:
            unchosen = (1 - self.experts_per_token / self.num_experts) ** running
            experts = self.num_experts * (1 - unchosen)
        unprojected = self.unprojected_params()
        projections = self.shared_params() - unprojected
        projections += self.num_layers * experts * self.expert_params()
        return 2 * unprojected + projection_bytes * projections

    def kv_bytes_read(self, prompt_len: int, output_len: int, element_bytes: int = 2) -> float:
        """KV bytes a request's decode steps read: output token t reads its prompt and its
        t earlier outputs in global layers, at most the last sliding_window in the others."""
        contexts = torch.arange(prompt_len, prompt_len + output_len, dtype=torch.float64)
        tokens = self.num_global_layers * contexts.sum()
        if self.sliding_window is not None:
            sliding = self.num_layers - self.num_global_layers
            tokens += sliding * contexts.clamp(max=self.sliding_window).sum()
        return float(tokens) * self.kv_bytes_per_token(element_bytes)


SHAPES = {
    "qwen3-0.6b": Shape("Qwen3ForCausalLM", "qwen3", 1024, 28, 16, 8, 128, 3072, 151936, True),
    "smollm2-135m": Shape("LlamaForCausalLM", "llama", 576, 30, 9, 3, 64, 1536, 49152, True, 8192),
    "llama-3-8b": Shape(
        "LlamaForCausalLM", "llama", 4096, 32, 32, 8, 128, 14336, 128256, False, 8192
    ),
    # Models that need several GPUs (tensor parallelism) in bf16: 65 GB and 141 GB.
    "qwen3-32b": Shape(
        "Qwen3ForCausalLM", "qwen3", 5120, 64, 64, 8, 128, 25600, 151936, False, 40960
    ),
    "llama-3-70b": Shape(
        "LlamaForCausalLM", "llama", 8192, 80, 64, 8, 128, 28672, 128256, False, 8192
    ),
    "qwen3-30b-a3b": Shape(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        2048,
        48,
        32,
        4,
        128,
        6144,
        151936,
        False,
        40960,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=768,
    ),
    "gemma-3-12b": Shape(
        "Gemma3ForCausalLM",
        "gemma3_text",
        3840,
        48,
        16,
        8,
        256,
        15360,
        262208,
        True,
        131072,
        sliding_window=1024,
        global_every=6,
    ),
}


def write_random_model(shape: Shape, path: Path, weights: bool = True) -> Path:
    """An HF directory (config.json, tokenizer.json and, unless weights is False, safetensors
    of random bf16 weights). Without weights the engine loads it with load_format="dummy"."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    if (path / "config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    config_class = transformers.AutoConfig.for_model(shape.model_type).__class__
    family: dict = {}
    if shape.num_experts:
        family = dict(
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.experts_per_token,
            moe_intermediate_size=shape.moe_intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if shape.sliding_window is not None:
        # Gemma 3's own defaults give the pattern (5 sliding layers, then a global one).
        family = dict(sliding_window=shape.sliding_window)
    config = config_class(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        torch_dtype="bfloat16",
        bos_token_id=0,
        eos_token_id=1,
        **family,
    )
    if weights:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = transformers.AutoModelForCausalLM.from_config(
                config, torch_dtype=torch.bfloat16
            )
        model.save_pretrained(path, safe_serialization=True)
    else:
        config.save_pretrained(path)
    vocab = {f"<t{i}>": i for i in range(shape.vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


# ---- the roofline --------------------------------------------------------------------------


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    src = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / _median_seconds(lambda: dst.copy_(src))


def matmul_rate(fp8: bool = False) -> float:
    """8192^3 matmul FLOP/s on random data (median of 10): bf16, or e4m3 with per-tensor
    scales through torch._scaled_mm."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    if not fp8:
        return 2 * n**3 / _median_seconds(lambda: a @ b)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # column-major B
    one = torch.ones((), device="cuda")
    matmul = lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)  # noqa: E731
    return 2 * n**3 / _median_seconds(matmul)


def _median_seconds(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


@dataclass
class Roofline:
    copy_bandwidth_gb_s: float
    matmul_tflop_s: float
    decode_weight_bytes: float
    decode_kv_bytes: float
    prefill_flop: float
    floor_s: float
    floor_tok_s: float


def roofline(
    shape: Shape, work: Workload, fp8_weights: bool, fp8_kv: bool, num_gpus: int = 1
) -> Roofline:
    """The floor for `work` with every request running at once (the best schedule), for
    the bytes the engine reads: fp8 projections and KV take one byte an element, and fp8
    weights multiply at the fp8 matmul rate. Over num_gpus (tensor parallelism) each reads
    and multiplies its share at once: this GPU's bandwidth and rate, num_gpus times (the
    all-reduces' time is not in the floor)."""
    bandwidth = copy_bandwidth() * num_gpus
    rate = matmul_rate(fp8=fp8_weights) * num_gpus
    projection_bytes, kv_element_bytes = (1 if fp8_weights else 2), (1 if fp8_kv else 2)
    # Decode step s runs the requests with more than s outputs; each step reads the weights
    # (a mixture of experts: those its sequences chose) once.
    decode_weight_bytes = sum(
        shape.decode_weight_bytes(sum(n > step for n in work.output_lens), projection_bytes)
        for step in range(max(work.output_lens))
    )
    decode_kv_bytes = sum(
        shape.kv_bytes_read(len(p), n, kv_element_bytes)
        for p, n in zip(work.prompts, work.output_lens, strict=True)
    )
    prefill_flop = 2 * shape.active_params() * work.prompt_tokens
    floor = (decode_weight_bytes + decode_kv_bytes) / bandwidth + prefill_flop / rate
    return Roofline(
        round(bandwidth / 1e9, 1),
        round(rate / 1e12, 1),
        decode_weight_bytes,
        decode_kv_bytes,
        prefill_flop,
        round(floor, 3),
        round(work.output_tokens / floor, 1),
    )


# ---- pagedserve ----------------------------------------------------------------------------


def precision_settings(args: argparse.Namespace) -> dict:
    """The engine's KV and weight precision settings the flags change from the defaults."""
    settings = {"kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization}
    return {name: value for name, value in settings.items() if value not in (None, "auto")}


def start_engine(args: argparse.Namespace, model_dir: Path):
    """The engine on the random model in model_dir (weights drawn on load), as the flags of
    add_engine_arguments set it."""
    from engine.llm import LLM

    return LLM(
        str(model_dir),
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        tensor_parallel_size=args.tensor_parallel_size,
        **precision_settings(args),
    )


def run_offline(args: argparse.Namespace, model_dir: Path, work: Workload) -> dict:
    """The workload args.repeats times on one engine, after args.warmup_runs untimed runs:
    each run's figures, and the timed runs' median.

    Run r adds r to every prompt token id (ids stay under the vocabulary), so no run hits
    the prefix cache the runs before it filled; lengths, and so the work, are the same.
    Repeats in one process share its start-up and its machine, so they separate a change
    from run-to-run noise more cheaply than separate machines or processes (whose copy
    bandwidth alone moves by a few percent)."""
    from engine.sampling_params import SamplingParams

    llm = start_engine(args, model_dir)
    blocks = llm.engine.block_manager
    tokens_at_once = sum(len(p) + n for p, n in zip(work.prompts, work.output_lens, strict=True))
    print(
        f"KV pool: {blocks.num_blocks * blocks.block_size:,} tokens; the workload's "
        f"sequences at once: {tokens_at_once:,}"
    )
    params = workload_params(work)
    llm.generate([work.prompts[0][:16]], SamplingParams(max_tokens=8))  # warm-up
    # Whole untimed runs first: on a machine whose kernel cache lacks them, the first run
    # has stalled ~40 s in flashinfer's JIT build of the eager decode modules, which its
    # first step mixing prefill and decode rows plans, and a median of three with one such
    # run is the slower of the other two.
    # Their ids are shifted past the timed runs'.
    warmups = [
        run_workload(llm, work, params, args.repeats + i, f"warm-up {i + 1} of {args.warmup_runs}")
        for i in range(args.warmup_runs)
    ]
    runs = [
        run_workload(llm, work, params, shift, f"run {shift + 1} of {args.repeats}")
        for shift in range(args.repeats)
    ]
    median = sorted(runs, key=lambda run: run["elapsed_s"])[len(runs) // 2]
    latency = batch1_latency(llm)
    if args.tensor_parallel_size > 1:
        latency["all_reduce_ms_per_step"] = all_reduce_ms_per_step(llm)
    return {
        **median,
        "runs": runs,
        "warmup_runs": warmups,
        "kv_blocks": llm.engine.block_manager.num_blocks,
        "preemptions": llm.engine.scheduler.num_preemptions,
        **latency,
    }


def workload_params(work: Workload) -> list:
    """Each request's sampling: temperature 0.6, ignore_eos, its own output length."""
    from engine.sampling_params import SamplingParams

    return [
        SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in work.output_lens
    ]


def run_workload(llm, work: Workload, params: list, shift: int, label: str) -> dict:
    """One run of the workload, every prompt token id plus `shift`, and its timing."""
    prompts = [[token + shift for token in prompt] for prompt in work.prompts]
    preempted = llm.engine.scheduler.num_preemptions
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == work.output_tokens, (produced, work.output_tokens)
    run = {
        "elapsed_s": round(elapsed, 3),
        "output_tok_s": round(produced / elapsed, 1),
        "total_tok_s": round((produced + work.prompt_tokens) / elapsed, 1),
        # A KV pool too small for the workload's sequences at once recomputes some.
        "preemptions": llm.engine.scheduler.num_preemptions - preempted,
    }
    print(f"{label}: {run}")
    return run


def batch1_latency(llm, prompt_len: int = 128, new_tokens: int = 256) -> dict:
    """One stream, 128-token prompt, 256 new tokens: time per output token after the first."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    results = []
    for attempt in range(3):
        request = engine.add_request(f"latency-{attempt}", list(range(1, prompt_len + 1)), params)
        while engine.has_unfinished_requests:
            engine.step()
        timing = request.timing
        ttft = timing.first_token - timing.arrival
        tpot = (timing.finished - timing.first_token) / (new_tokens - 1)
        results.append((tpot, ttft))
    tpot, ttft = min(results)
    return {"batch1_tpot_ms": round(tpot * 1e3, 3), "batch1_ttft_ms": round(ttft * 1e3, 2)}


def all_reduce_ms_per_step(llm, new_tokens: int = 64) -> float:
    """Under tensor parallelism: the GPU time rank 0's NCCL all-reduce kernels take per
    step of a batch-1 decode (profiled, graphs included; it counts a rank's wait for the
    others, as a step does)."""
    from torch.profiler import ProfilerActivity, profile

    from engine.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    engine.add_request("all-reduce", list(range(1, 129)), params)
    steps = 0
    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        while engine.has_unfinished_requests:
            engine.step()
            steps += 1
        torch.cuda.synchronize()
    nccl_us = sum(
        event.device_time_total
        for event in profiled.key_averages()
        if "AllReduce" in event.key or "all_reduce" in event.key
    )
    return round(nccl_us / 1e3 / steps, 4)


# ---- transformers, for comparison ----------------------------------------------------------


def run_transformers(model_dir: Path, work: Workload) -> dict:
    """HF transformers' own continuous batching (generate_batch's manager) on the workload."""
    import transformers
    from transformers.generation import GenerationConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, device_map="cuda", attn_implementation="sdpa"
    )
    config = GenerationConfig(
        do_sample=True, temperature=0.6, max_new_tokens=max(work.output_lens), eos_token_id=-1
    )
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(work.prompts, work.output_lens, strict=True)):
        manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
    produced = finished = 0
    while finished < len(work.prompts):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            finished += 1
            produced += len(result.generated_tokens)
    elapsed = time.perf_counter() - start
    manager.stop(block=True)
    return {
        "transformers_version": transformers.__version__,
        "elapsed_s": round(elapsed, 3),
        "output_tokens": produced,
        "output_tok_s": round(produced / elapsed, 1),
    }


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The model shape and the engine settings, for start_engine."""
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/pagedserve-bench-models"))
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="the GPU memory share the engine may use (weights, KV pool, graphs)",
    )
    p.add_argument("--block-size", type=int, help="tokens per KV page (default: the engine's)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--kv-cache-dtype", default="auto", help="the KV pool's dtype: auto, bfloat16, fp8_e4m3"
    )
    p.add_argument(
        "--quantization",
        default=None,
        help="fp8: the projections' weights quantized on load (the roofline counts a byte each)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlap the host's next step with the GPU's current one (default: on)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over this many GPUs (the roofline counts each one's bandwidth "
        "and matmul rate)",
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_arguments(p)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs of the workload on one engine; the figures are the median run's",
    )
    p.add_argument(
        "--warmup-runs",
        type=int,
        default=1,
        help="untimed runs of the workload before the timed ones (their ids shifted past "
        "the timed runs', so none reuses another's prefix cache)",
    )
    p.add_argument("--compare-transformers", action="store_true")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args()

    shape = SHAPES[args.shape]
    work = make_workload(NANO_VLLM_WORKLOAD)
    print(f"workload: {work.describe()}")
    # transformers reads weights from disk; the engine draws its own.
    model_dir = write_random_model(
        shape, args.model_dir / args.shape, weights=args.compare_transformers
    )
    fp8_weights, fp8_kv = args.quantization == "fp8", args.kv_cache_dtype == "fp8_e4m3"
    floor = roofline(shape, work, fp8_weights, fp8_kv, args.tensor_parallel_size)
    print(f"roofline: {asdict(floor)}")
    ours = run_offline(args, model_dir, work)
    ours["of_roofline"] = round(ours["output_tok_s"] / floor.floor_tok_s, 3)
    # Batch-1 decode against the time to read the weights once (a token's own KV is small).
    weights_once_ms = shape.decode_weight_bytes(1, 1 if fp8_weights else 2) / (
        floor.copy_bandwidth_gb_s * 1e6
    )
    ours["batch1_tpot_over_weight_read"] = round(ours["batch1_tpot_ms"] / weights_once_ms, 3)
    print(f"pagedserve: {ours}")
    result = {
        **run_info(),
        "gpu": torch.cuda.get_device_name(),
        "shape": args.shape,
        "kv_cache_dtype": args.kv_cache_dtype,
        "quantization": args.quantization,
        "tensor_parallel_size": args.tensor_parallel_size,
        "workload": work.describe(),
        "roofline": asdict(floor),
        "pagedserve": ours,
    }
    if args.compare_transformers:
        theirs = run_transformers(model_dir, work)
        theirs["ratio"] = round(ours["output_tok_s"] / theirs["output_tok_s"], 2)
        print(f"transformers: {theirs}")
        result["transformers"] = theirs
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
