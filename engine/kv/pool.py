"""The KV pool: its dtype, how many blocks fit beside the weights and the largest step,
and the tensors themselves (layout: engine/attention/base.py; an fp8 pool:
engine/kv/fp8.py)."""

from __future__ import annotations

import numpy as np
import torch

from engine.config import EngineConfig
from engine.core.batch import BatchChanges
from engine.core.runner import ModelRunner, StepPlan
from engine.core.sampler import SamplingRows
from engine.errors import ValidationError
from engine.kv.fp8 import FP8_DTYPE
from engine.model.config import ModelConfig
from engine.sampling_params import MAX_LOGPROBS, SamplingParams

_KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "fp8_e4m3": FP8_DTYPE}


def kv_cache_dtype(config: EngineConfig) -> torch.dtype:
    """The pool's dtype: kv_cache_dtype resolved for the model's dtype and the device, or
    a ValidationError naming it where that pool cannot run."""
    dtype, device = config.torch_dtype, config.torch_device
    if config.cache.kv_cache_dtype == "auto":
        return dtype
    kv_dtype = _KV_DTYPES[config.cache.kv_cache_dtype]
    if device.type != "cuda":
        # The torch backend computes in float32 whatever the pool holds, so any pool runs
        # under any model dtype: a 16-bit pool under a float32 model halves the KV memory
        # for K and V rounded once, as fp8 quarters it.
        return kv_dtype
    if kv_dtype == FP8_DTYPE:
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValidationError(
                "kv_cache_dtype",
                f"fp8_e4m3 needs a GPU of compute capability 8.9 or later (Ada, Hopper), "
                f"this one is {capability[0]}.{capability[1]}",
            )
    elif kv_dtype != dtype:  # flashinfer and the decode kernel read 16-bit KV as q's dtype
        raise ValidationError(
            "kv_cache_dtype",
            f"{config.cache.kv_cache_dtype} needs dtype {config.cache.kv_cache_dtype} on CUDA, "
            f"got {config.dtype}: a 16-bit pool holds the model's dtype there",
        )
    return kv_dtype


def allocate_kv_pool(runner: ModelRunner, num_blocks: int) -> list[torch.Tensor]:
    """One zeroed [num_blocks, 2, block_size, num_kv_heads, head_dim] tensor per layer, of
    the runner's kv_dtype, for the KV heads the model's shard holds."""
    cfg = runner.config
    shape = (num_blocks, 2, runner.block_size, runner.model.shard.num_kv_heads, cfg.head_dim)
    return [
        torch.zeros(shape, dtype=runner.kv_dtype, device=runner.device)
        for _ in range(cfg.num_layers)
    ]


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
) -> int:
    """A block's bytes over every layer, for num_kv_heads KV heads (None: the model's; a
    tensor-parallel rank holds its shard's)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
    per_layer = 2 * block_size * heads * config.head_dim * element_size
    return config.num_layers * per_layer


def runner_block_bytes(runner: ModelRunner) -> int:
    """A block's bytes in the runner's pool: its KV dtype, the KV heads its shard holds."""
    heads = runner.model.shard.num_kv_heads
    return kv_bytes_per_block(runner.config, runner.block_size, runner.kv_dtype, heads)


def num_kv_blocks(config: EngineConfig, runner: ModelRunner, graph_reserve: int) -> int:
    """The blocks to allocate: as configured, else what fits the GPU's share
    (fit_kv_blocks) or, on the CPU, kv_cache_memory_gib."""
    cache, sched = config.cache, config.scheduler
    if cache.num_blocks:
        return cache.num_blocks
    if runner.device.type == "cuda":
        return fit_kv_blocks(
            runner,
            cache.gpu_memory_utilization,
            sched.max_num_batched_tokens,
            sched.max_num_seqs,
            graph_reserve,
        )
    return max(1, int(cache.kv_cache_memory_gib * 2**30 // runner_block_bytes(runner)))


def fit_kv_blocks(
    runner: ModelRunner,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    graph_reserve: int,
) -> int:
    """How many KV blocks fit in gpu_memory_utilization of the GPU's memory, beside what
    the weights, the peak of the largest step (run here once), other users of the GPU
    (CUDA context, other processes) and the CUDA graphs (graph_reserve bytes) take."""
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    _run_largest_step(runner, max_num_batched_tokens, max_num_seqs)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    peak = torch.cuda.max_memory_allocated(device)
    budget = total * gpu_memory_utilization - outside_torch - peak - graph_reserve
    num_blocks = int(budget // runner_block_bytes(runner))
    if num_blocks < 1:
        gib = 2**30
        raise ValidationError(
            "gpu_memory_utilization",
            f"{gpu_memory_utilization} of {total / gib:.1f} GiB leaves no room for the KV "
            f"cache: the weights and a {max_num_batched_tokens}-token step peak at "
            f"{peak / gib:.2f} GiB, {outside_torch / gib:.2f} GiB is in use outside torch "
            f"and {graph_reserve / gib:.2f} GiB is kept for CUDA graphs",
        )
    return num_blocks


def _run_largest_step(runner: ModelRunner, num_tokens: int, num_seqs: int) -> None:
    """The largest step the scheduler can make: num_tokens of prompt with logits for every
    row (prompt logprobs), and num_seqs samples using every sampling feature. Every
    sequence is on the padding slot, which writes no KV and reads block 0 of a one-block
    pool: only the memory use is of interest."""
    limit = min(runner.config.max_position_embeddings, runner.token_width - 1)
    lens = [min(limit, num_tokens - start) for start in range(0, num_tokens, limit)]
    lens += [1] * max(0, num_seqs - len(lens))  # decodes, to sample num_seqs rows
    batch = len(lens)
    params = SamplingParams(
        temperature=1.0,
        top_k=50,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logprobs=MAX_LOGPROBS,
    )
    plan = StepPlan(
        slots=np.full(batch, runner.batch.padding_slot, dtype=np.int32),
        query_lens=np.array(lens, dtype=np.int32),
        seq_lens=np.array(lens, dtype=np.int32),
        num_samples=np.ones(batch, dtype=np.int32),
        num_prompt_tokens=np.array(lens, dtype=np.int32),  # all prompt: logits for each
        sampling=SamplingRows.build(
            [params] * batch, [0] * batch, [0] * batch, [[0]] * batch, runner.config.vocab_size
        ),
        prompt_logprobs={i: MAX_LOGPROBS for i, n in enumerate(lens) if n > 1},
        changes=BatchChanges(*(np.zeros(0, dtype=t) for t in (np.int64, np.int32) * 2)),
    )
    runner.kv_caches = allocate_kv_pool(runner, 1)
    try:
        runner.collect(runner.sample(runner.forward(plan)))
    finally:
        runner.kv_caches = []
