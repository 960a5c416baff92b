"""Start-up: from an EngineConfig to the model on its runner, the KV pool sized and
allocated, the CUDA graphs captured; each phase logged and timed (StartupTimes), and
what the engine then is (EngineInfo).

Under tensor parallelism every rank builds its own runner (build_rank) at once, the
driver here and each worker in its process (engine/parallel/worker.py): the phases run
collectives (the largest step's all-reduces, the pool's size agreed, the graphs' capture),
so they happen on every rank in the same order."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention.torch_backend import TorchPagedAttention
from engine.config import EngineConfig
from engine.core.cuda_graphs import CudaGraphRunner, graph_batch_sizes, graph_memory_reserve
from engine.core.kernel_cache import apply_kernel_cache_dir
from engine.core.runner import ModelRunner
from engine.errors import EngineError
from engine.kv.fp8 import FP8_DTYPE, read_kv_scales, set_kv_scales
from engine.kv.pool import allocate_kv_pool, kv_cache_dtype, num_kv_blocks, runner_block_bytes
from engine.model.config import ModelConfig
from engine.model.loader import load_model, safetensors_files
from engine.model_store import resolve_model
from engine.parallel.group import SINGLE_PROCESS, TensorParallel
from engine.parallel.workers import Workers, rank_device
from engine.stats import EngineInfo, StartupTimes
from engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    tokenizer: Tokenizer
    model_config: ModelConfig
    runner: ModelRunner  # its KV pool allocated, its CUDA graphs captured
    workers: Workers | None  # the other tensor-parallel ranks, if any
    # Its max_model_len is the most tokens one sequence holds: the model's context, capped
    # by the max_model_len setting and by the pool. A sequence must fit the pool on its
    # own; that is what makes preemption deadlock-free.
    info: EngineInfo


@dataclass
class RankParts:
    """One rank's model on its runner, and how long each phase took."""

    model_config: ModelConfig
    runner: ModelRunner
    num_blocks: int  # in its KV pool
    model_len: int  # the model's context, capped by the max_model_len setting
    times: StartupTimes


def start_up(config: EngineConfig) -> EngineParts:
    # Before anything imports triton or flashinfer: both read their cache paths then.
    apply_kernel_cache_dir(config.kernel_cache_dir)
    started = time.monotonic()
    model_path = resolve_model(config.model, config.revision, config.download_dir)
    tokenizer = Tokenizer.from_path(model_path)
    device = rank_device(config, 0)
    workers, tp = None, SINGLE_PROCESS
    if config.tensor_parallel_size > 1:  # the other ranks build theirs alongside
        workers, tp = Workers.start(config, model_path, device)
    try:
        rank = build_rank(config, model_path, tp, device, started)
    except Exception as exc:
        if workers is None:
            raise
        failure = workers.failure(exc)  # before the stop: which rank, if one exited
        workers.stop()
        raise (exc if isinstance(exc, EngineError) else failure) from exc
    mc, runner = rank.model_config, rank.runner
    runner.channel = workers.channel if workers is not None else None
    num_blocks, block_size = rank.num_blocks, runner.block_size
    pool_tokens = num_blocks * block_size
    max_model_len = min(rank.model_len, pool_tokens)
    log.info(
        "engine ready: %s on %s/%s%s, KV pool %d blocks of %d tokens (%s, %.2f GiB%s, %d "
        "tokens), max_model_len %d, %s",
        mc.architecture,
        device,
        runner.dtype,
        f" and {tp.size - 1} more ranks" if tp.size > 1 else "",
        num_blocks,
        block_size,
        str(runner.kv_dtype).removeprefix("torch."),
        num_blocks * runner_block_bytes(runner) / 2**30,
        " a rank" if tp.size > 1 else "",
        pool_tokens,
        max_model_len,
        "CUDA graphs" if runner.graphs is not None else "eager",
    )
    info = EngineInfo(
        model_path=str(model_path),
        architecture=mc.architecture,
        max_model_len=max_model_len,
        vocab_size=mc.vocab_size,
        eos_token_ids=tuple(sorted({*tokenizer.eos_token_ids, *mc.eos_token_ids})),
        kv_block_size=block_size,
        kv_num_blocks=num_blocks,
        kv_capacity_tokens=pool_tokens,
        startup=rank.times,
    )
    return EngineParts(tokenizer, mc, runner, workers, info)


def build_rank(
    config: EngineConfig,
    model_path: Path,
    tp: TensorParallel,
    device: torch.device,
    started: float,
) -> RankParts:
    """This rank's shard of the model on a runner with its KV pool (as many blocks as the
    smallest rank fits) and its CUDA graphs; `started`: when start-up began."""
    dtype = config.torch_dtype
    kv_dtype = kv_cache_dtype(config)  # before the load: a pool that cannot run fails first
    if device.type == "cuda":
        from engine.attention.cuda import CudaAttention

        attn = CudaAttention(device)
    else:
        attn = TorchPagedAttention()
    model, mc = load_model(
        model_path,
        dtype,
        device,
        attn,
        random_weights=config.load_format == "dummy",
        quantization=config.quantization,
        tp=tp,
    )
    if kv_dtype == FP8_DTYPE and model_path.is_dir() and config.load_format != "dummy":
        set_kv_scales(model, read_kv_scales(safetensors_files(model_path), mc.num_layers))
    attn.configure(  # the heads this rank holds
        model.shard.num_heads,
        model.shard.num_kv_heads,
        mc.head_dim,
        dtype,
        mc.attention_scale,
        mc.attention_windows,
        kv_dtype,
    )
    loaded = time.monotonic()
    log.info("model loaded in %.2f s: %s", loaded - started, model_path)

    sched, block_size = config.scheduler, config.block_size
    use_graphs = attn.supports_cuda_graphs and not config.enforce_eager
    model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    runner = ModelRunner(
        model, mc, block_size, device, dtype, attn, sched.max_num_seqs, model_len, kv_dtype
    )
    graph_sizes = graph_batch_sizes(sched.max_num_seqs)
    graph_bytes = graph_memory_reserve(graph_sizes, attn) if use_graphs else 0
    num_blocks = tp.smallest(num_kv_blocks(config, runner, graph_bytes), device)
    runner.kv_caches = allocate_kv_pool(runner, num_blocks)
    sized = time.monotonic()
    log.info("KV pool sized and allocated in %.2f s", sized - loaded)
    if use_graphs:
        runner.graphs = CudaGraphRunner(
            model,
            attn,
            runner.kv_caches,
            runner.batch,
            block_size,
            graph_sizes,
            mc.hidden_size,
            dtype,
        )
        log.info("CUDA graphs captured in %.2f s", time.monotonic() - sized)
    times = StartupTimes(
        model_load=loaded - started,
        kv_profile=sized - loaded,
        cuda_graphs=time.monotonic() - sized if use_graphs else 0.0,
        cuda_graph_bytes=runner.graphs.memory_bytes if use_graphs else 0,
    )
    return RankParts(mc, runner, num_blocks, model_len, times)
