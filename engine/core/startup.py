"""Start-up: from an EngineConfig to the model on its runner, the KV pool sized and
allocated, the CUDA graphs captured; each phase logged and timed (StartupTimes), and
what the engine then is (EngineInfo)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.attention.torch_backend import TorchPagedAttention
from engine.config import EngineConfig
from engine.core.cuda_graphs import CudaGraphRunner, graph_batch_sizes, graph_memory_reserve
from engine.core.kernel_cache import apply_kernel_cache_dir
from engine.core.runner import ModelRunner
from engine.kv.fp8 import FP8_DTYPE, read_kv_scales, set_kv_scales
from engine.kv.pool import allocate_kv_pool, kv_cache_dtype, num_kv_blocks, runner_block_bytes
from engine.model.config import ModelConfig
from engine.model.loader import load_model, safetensors_files
from engine.model_store import resolve_model
from engine.stats import EngineInfo, StartupTimes
from engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    tokenizer: Tokenizer
    model_config: ModelConfig
    runner: ModelRunner  # its KV pool allocated, its CUDA graphs captured
    # Its max_model_len is the most tokens one sequence holds: the model's context, capped
    # by the max_model_len setting and by the pool. A sequence must fit the pool on its
    # own; that is what makes preemption deadlock-free.
    info: EngineInfo


def start_up(config: EngineConfig) -> EngineParts:
    # Before anything imports triton or flashinfer: both read their cache paths then.
    apply_kernel_cache_dir(config.kernel_cache_dir)
    started = time.monotonic()
    model_path = resolve_model(config.model, config.revision, config.download_dir)
    tokenizer = Tokenizer.from_path(model_path)
    device, dtype = config.torch_device, config.torch_dtype
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
    )
    if kv_dtype == FP8_DTYPE and model_path.is_dir() and config.load_format != "dummy":
        set_kv_scales(model, read_kv_scales(safetensors_files(model_path), mc.num_layers))
    attn.configure(  # the heads this rank holds: all of them in one process
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
    num_blocks = num_kv_blocks(config, runner, graph_bytes)
    runner.kv_caches = allocate_kv_pool(runner, num_blocks)
    pool_tokens = num_blocks * block_size
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
    startup = StartupTimes(
        model_load=loaded - started,
        kv_profile=sized - loaded,
        cuda_graphs=time.monotonic() - sized if use_graphs else 0.0,
        cuda_graph_bytes=runner.graphs.memory_bytes if use_graphs else 0,
    )
    max_model_len = min(model_len, pool_tokens)
    log.info(
        "engine ready: %s on %s/%s, KV pool %d blocks of %d tokens (%s, %.2f GiB, %d tokens), "
        "max_model_len %d, %s",
        mc.architecture,
        device,
        dtype,
        num_blocks,
        block_size,
        str(kv_dtype).removeprefix("torch."),
        num_blocks * runner_block_bytes(runner) / 2**30,
        pool_tokens,
        max_model_len,
        "CUDA graphs" if use_graphs else "eager",
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
        startup=startup,
    )
    return EngineParts(tokenizer, mc, runner, info)
