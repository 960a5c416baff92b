"""One config tree for the engine, validated once at construction and never mutated."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import ValidationError
from engine.model_hub import HubModel

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8_e4m3")


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per KV block. None: 64 on CUDA, 16 on the CPU. Larger pages make flashinfer's
    # page tables (built on the host every step) 4x shorter and its decode a little faster:
    # +0.6-2.2% offline throughput on the H200, same machine, against 16-token blocks
    # (benchmarks/RESULTS.md's git history); the price is coarser prefix caching (a hit is
    # whole blocks), which the CPU path keeps at 16.
    block_size: int | None = None
    # None: size the pool from kv_cache_memory_gib (CPU) or free GPU memory (GPU).
    num_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    # On CUDA: the share of the GPU's memory this engine may use, KV pool included.
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # What the KV pool holds: auto (the model's dtype), bfloat16, float16 or fp8_e4m3
    # (half the bytes of a 16-bit pool; engine/kv/fp8.py).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValidationError(
                "block_size", f"must be a power of two in [1, 128], got {self.block_size}"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValidationError("num_blocks", f"must be >= 1, got {self.num_blocks}")
        if not self.kv_cache_memory_gib > 0:
            raise ValidationError(
                "kv_cache_memory_gib", f"must be > 0, got {self.kv_cache_memory_gib}"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValidationError(
                "gpu_memory_utilization",
                f"must be in (0, 1], got {self.gpu_memory_utilization}",
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValidationError(
                "kv_cache_dtype",
                f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256  # running sequences (candidates) at once
    max_num_batched_tokens: int = 2048  # tokens per step, prefill and decode together
    enable_chunked_prefill: bool = True
    # Cut each step's prefill to what a step of this many seconds holds at the measured
    # rate (engine/core/step_budget.py): a step is what a leaving caller or a stream's next
    # token waits for. None: CPU_TARGET_STEP_SECONDS on the CPU, untimed on CUDA, whose
    # steps take milliseconds at the whole budget; 0: untimed.
    target_step_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValidationError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValidationError(
                "max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.target_step_seconds is not None:
            if not 0 <= self.target_step_seconds < float("inf"):
                raise ValidationError(
                    "target_step_seconds",
                    f"must be a finite number >= 0, got {self.target_step_seconds}",
                )
            if self.target_step_seconds > 0 and not self.enable_chunked_prefill:
                raise ValidationError(
                    "target_step_seconds",
                    "needs chunked prefill: unchunked, a prompt runs whole in one step",
                )


# A quarter of a second: a leaving caller's work stops well within a second, and
# SmolLM2-135M on the two-core VM still prefills 115-160 prompt tokens a step beside 32
# decodes (a step of 2,048 prompt tokens there: 3.5 s, at much the same rate per token).
CPU_TARGET_STEP_SECONDS = 0.25

LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("fp8",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    # A local HF dir or .gguf file, a Hugging Face repo id (org/name[@revision]) or an alias;
    # None = the embedded default.
    model: str | None = None
    revision: str | None = None  # a repo id's branch, tag or commit; None = its default branch
    # The hub cache repo ids are fetched into and found in. None: huggingface_hub's own
    # (HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub).
    download_dir: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (cpu: float32, cuda: bfloat16) | float32 | bfloat16 | float16
    # auto: the checkpoint's weights. dummy: random weights of the config's shapes, no
    # checkpoint read (a directory with config.json and a tokenizer is enough): a model's
    # speed without its gigabytes on disk, for benchmarks.
    load_format: str = "auto"
    # fp8: quantize the checkpoint's projections to fp8 as they load (one scale per output
    # row, activations scaled per token as they run), on CUDA GPUs of compute capability 8.9
    # or newer. None: the checkpoint's own weights; an fp8 checkpoint runs in fp8 where it
    # can and is dequantized to `dtype` elsewhere (engine/model/fp8.py).
    quantization: str | None = None
    max_model_len: int | None = None  # None = the model's own context length
    # Ranks the model is split over (engine/parallel/): one process and one GPU each, this
    # one and tensor_parallel_size - 1 workers it starts; CUDA's take consecutive GPUs from
    # the device's index.
    tensor_parallel_size: int = 1
    # Seconds a tensor-parallel collective may wait for a rank before the engine fails.
    tensor_parallel_timeout: float = 120.0
    engine_seed: int = 0  # seeds the draws for requests that bring no seed
    enforce_eager: bool = False  # CUDA: never replay CUDA graphs (run every step eagerly)
    # Queue step t+1 before reading step t's tokens back (engine.step). None: on for CUDA,
    # off for the CPU, where the host computes the step itself and nothing would overlap.
    async_scheduling: bool | None = None
    # Where Triton and flashinfer keep the kernels they build (<dir>/triton, flashinfer's
    # <dir>/.cache/flashinfer), so a kernel built once (`pagedserve warmup`) is loaded, not
    # compiled, by every later start. None: their own defaults under the home directory.
    kernel_cache_dir: str | None = None
    # Structured output: a constraint whose grammar builds for longer than this many
    # seconds is refused (the build finishes unread on the compiler's thread); one that
    # waits as long for a compile thread is told to retry.
    grammar_compile_timeout: float = 10.0
    # Structured output: a candidate's grammar work for one token (its token mask, moving
    # its matcher past a token) that takes more CPU time than this fails its request,
    # naming the constraint's field. A mask takes microseconds to a few milliseconds, and
    # llguidance's own limits stop one near 20 ms; an ambiguous grammar's grow with every
    # token, and every row of a step waits for the slowest mask.
    grammar_step_timeout: float = 0.05
    # Structured output: the tokens a grammar forces (its mask would allow each alone) are
    # appended without a step each, and computed with the token before them in one chunk.
    grammar_fast_forward: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValidationError(
                "dtype", f"must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValidationError(
                "load_format", f"must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}"
            )
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValidationError("device", f"must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValidationError(
                "quantization",
                f"must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}",
            )
        if self.dtype == "float32" and self.torch_device.type == "cuda":
            # flashinfer's attention kernels are built for 16-bit activations only
            raise ValidationError("dtype", "float32 is not served on CUDA; use bfloat16 or float16")
        for name in ("kernel_cache_dir", "revision", "download_dir"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValidationError(name, "must not be empty")
        if self.model is not None:
            HubModel.parse(self.model, self.revision)  # org/name@rev and revision must agree
        if not 0 < self.grammar_compile_timeout < float("inf"):
            raise ValidationError(
                "grammar_compile_timeout",
                f"must be a finite number > 0, got {self.grammar_compile_timeout}",
            )
        if not 0 < self.grammar_step_timeout < float("inf"):
            raise ValidationError(
                "grammar_step_timeout",
                f"must be a finite number > 0, got {self.grammar_step_timeout}",
            )
        if self.tensor_parallel_size < 1:
            raise ValidationError(
                "tensor_parallel_size", f"must be >= 1, got {self.tensor_parallel_size}"
            )
        if not 0 < self.tensor_parallel_timeout < float("inf"):
            raise ValidationError(
                "tensor_parallel_timeout",
                f"must be a finite number > 0, got {self.tensor_parallel_timeout}",
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValidationError("max_model_len", f"must be >= 1, got {self.max_model_len}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def uses_async_scheduling(self) -> bool:
        """async_scheduling, the default resolved for the device."""
        if self.async_scheduling is None:
            return self.torch_device.type == "cuda"
        return self.async_scheduling

    @property
    def target_step_seconds(self) -> float | None:
        """The scheduler's target_step_seconds, the default resolved for the device; None:
        steps are not timed (0, CUDA by default, unchunked prefill)."""
        scheduler = self.scheduler
        if scheduler.target_step_seconds is None:
            timed = self.torch_device.type == "cpu" and scheduler.enable_chunked_prefill
            return CPU_TARGET_STEP_SECONDS if timed else None
        return scheduler.target_step_seconds or None

    @property
    def block_size(self) -> int:
        """Tokens per KV block, the default resolved for the device."""
        if self.cache.block_size is None:
            return 64 if self.torch_device.type == "cuda" else 16
        return self.cache.block_size

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]


def engine_config_from_flat(**values: object) -> EngineConfig:
    """Build the tree from flat knob names (as CLI flags, env vars and config files use them).

    Unknown names are an error, so a typo never silently falls back to a default.
    """
    sections = {
        "cache": (CacheConfig, set(CacheConfig.__dataclass_fields__)),
        "scheduler": (SchedulerConfig, set(SchedulerConfig.__dataclass_fields__)),
    }
    top_fields = set(EngineConfig.__dataclass_fields__) - set(sections)
    parts: dict[str, dict[str, object]] = {name: {} for name in sections}
    top: dict[str, object] = {}
    for key, value in values.items():
        if value is None and key != "model":
            continue  # not given: keep the default
        if key in top_fields:
            top[key] = value
            continue
        for name, (_, fields) in sections.items():
            if key in fields:
                parts[name][key] = value
                break
        else:
            raise ValidationError(key, "unknown engine setting")
    built = {name: cls(**parts[name]) for name, (cls, _) in sections.items()}
    return EngineConfig(**top, **built)
