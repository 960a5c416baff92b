"""What the engine tells its callers about itself, as immutable values.

EngineInfo: the facts fixed at start-up (the model, its limits, the KV pool), read once.
EngineStats: a snapshot of load and cumulative counters. The engine's loop builds one
(LLMEngine.stats) after every iteration and AsyncEngine (or EngineProcess) publishes it by
swapping a single reference, so a reader on another thread (a metrics scrape) never
touches live engine state and never sees a half-updated snapshot.

Both are plain values so they cross a process boundary as they are.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StartupTimes:
    """Seconds each start-up phase took in the process that built the engine (0: not run),
    and the device memory its CUDA graphs hold."""

    model_load: float = 0.0  # tokenizer and weights onto the device
    kv_profile: float = 0.0  # the largest step profiled (CUDA), the KV pool sized and allocated
    cuda_graphs: float = 0.0  # decode graphs captured
    warmup: float = 0.0  # engine/core/warmup.py: every kernel path run once
    cuda_graph_bytes: int = (
        0  # held by the graphs (engine/core/cuda_graphs.py: device_memory_taken)
    )

    def describe(self) -> str:
        graphs = f"CUDA graphs {self.cuda_graphs:.2f} s"
        if self.cuda_graph_bytes:
            graphs += f" ({self.cuda_graph_bytes / 2**30:.2f} GiB)"
        return (
            f"model load {self.model_load:.2f} s, KV profile {self.kv_profile:.2f} s, "
            f"{graphs}, warm-up {self.warmup:.2f} s"
        )


@dataclass(frozen=True)
class EngineInfo:
    model_path: str  # the resolved model directory or GGUF file
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # sorted
    kv_block_size: int
    kv_num_blocks: int
    kv_capacity_tokens: int
    startup: StartupTimes = field(default_factory=StartupTimes)


# Upper bounds, in seconds, of the grammar build-time histogram's buckets.
GRAMMAR_BUILD_SECONDS_BOUNDS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


@dataclass(frozen=True)
class GrammarStats:
    """Cumulative: how the engine's constraints were compiled (engine/structured/grammar.py)."""

    cache_hits: int = 0
    # Builds (cache misses), each counted when it ends, whether or not its caller still
    # waits for it: how many took at most each of GRAMMAR_BUILD_SECONDS_BOUNDS, how many in
    # all, and their seconds in all.
    builds_within: tuple[int, ...] = (0,) * len(GRAMMAR_BUILD_SECONDS_BOUNDS)
    builds: int = 0
    build_seconds: float = 0.0


@dataclass(frozen=True)
class EngineStats:
    num_running_requests: int  # requests with at least one candidate in the running batch
    num_waiting_requests: int  # admitted, unfinished, none running (new or preempted)
    num_kv_blocks_used: int  # referenced by a live sequence; cached-but-free blocks are not
    num_kv_blocks_total: int
    kv_block_size: int  # tokens per KV block
    prefix_cache_queried_tokens: int  # cumulative: prompt tokens looked up in the prefix cache
    prefix_cache_hit_tokens: int  # cumulative: of those, tokens whose KV was reused
    num_preemptions: int  # cumulative
    num_prompt_tokens_computed: int  # cumulative: prompt positions run through the model
    num_generated_tokens: int  # cumulative: output tokens (sampled or forced), every candidate
    num_forced_tokens: int  # cumulative: of those, appended unsampled (a grammar forced them)
    num_steps: int  # cumulative: model steps run
    # cumulative: requests aborted, as (door, stage, count); door says who asked (the front
    # door a caller left by, or cancel_rpc), stage where the request was (Request.stage,
    # or inbox: cancelled before the loop admitted it)
    aborts: tuple[tuple[str, str, int], ...] = ()
    grammar: GrammarStats = field(default_factory=GrammarStats)

    @property
    def kv_cache_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total

    @property
    def prefix_cache_hit_rate(self) -> float:
        queried = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / queried if queried else 0.0
