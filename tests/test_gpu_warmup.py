"""After the warm-up nothing compiles on traffic (GPU): a workload that touches every path
(chunked prefill, a prefix hit, mixed steps below and from 64 decode rows, every CUDA-graph
batch size and the sizes between them, every sampler option, n > 1, logprobs, prompt
logprobs, penalties) builds no flashinfer module and compiles no Triton kernel.

Each case runs in a fresh spawned process: compiled kernels are cached per process, so
one that an earlier test built would hide a path the warm-up missed. The build functions
are hooked there before the engine exists:

  - Triton: `triton.compiler.compile`, which a JITFunction calls on a miss of its
    in-memory cache (whether or not the disk cache has the kernel), wrapped where it can
    be looked up; and `triton.knobs.runtime.jit_post_compile_hook` where it exists;
  - flashinfer: `JitSpec.build_and_load` and `JitSpec.build` (flashinfer.jit.core), the
    first use of a JIT module in a process, and the older `load_cuda_ops` if present.

Skipped without CUDA.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import traceback
from pathlib import Path

import pytest
import torch

from tests.test_gpu import model_dir  # noqa: F401 (a fixture)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_NUM_SEQS = 96  # > 64 decode rows in a mixed step, and 13 graph batch sizes
BUDGET = 256  # max_num_batched_tokens


class BuildLog:
    """Every kernel build the hooks saw, tagged with the phase it happened in."""

    def __init__(self) -> None:
        self.phase = "start-up"
        self.events: list[tuple[str, str, str]] = []  # (phase, hook, what)
        self.installed: list[str] = []

    def record(self, hook: str, what: str) -> None:
        self.events.append((self.phase, hook, what))

    def after(self, phase: str) -> list[str]:
        return [f"{hook}: {what}" for p, hook, what in self.events if p == phase]


def _describe_triton_source(src: object) -> str:
    fn = getattr(src, "fn", None)
    name = getattr(fn, "__name__", None) or getattr(src, "name", None) or repr(src)
    signature = getattr(src, "signature", "")
    constants = getattr(src, "constants", None) or getattr(src, "constexprs", "")
    attrs = getattr(src, "attrs", "")
    return f"{name} signature={signature} constants={constants} attrs={attrs}"[:600]


def install_hooks(log: BuildLog) -> None:
    import importlib

    # Triton: compile() on an in-memory cache miss.
    import triton

    original = None
    for module_name in ("triton.compiler.compiler", "triton.compiler", "triton.runtime.jit"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        current = getattr(module, "compile", None)
        if not callable(current):
            continue
        original = original or current

        def compile_hook(src, *args, _original=original, **kwargs):
            log.record("triton.compiler.compile", _describe_triton_source(src))
            return _original(src, *args, **kwargs)

        module.compile = compile_hook
        log.installed.append(f"{module_name}.compile")
    runtime_knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime_knobs is not None and hasattr(runtime_knobs, "jit_post_compile_hook"):
        previous = runtime_knobs.jit_post_compile_hook

        def post_compile(*args, **kwargs):
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or getattr(fn, "module", "?")
            log.record("triton.knobs.runtime.jit_post_compile_hook", f"{name} {kwargs.get('repr')}")
            return previous(*args, **kwargs) if previous else None

        runtime_knobs.jit_post_compile_hook = post_compile
        log.installed.append("triton.knobs.runtime.jit_post_compile_hook")

    # flashinfer: a JIT module's first use in the process, and its actual build.
    try:
        import flashinfer.jit as fi_jit
    except ImportError:
        return
    core = getattr(fi_jit, "core", None)
    spec_class = getattr(core, "JitSpec", None) or getattr(fi_jit, "JitSpec", None)
    for method in ("build_and_load", "build"):
        original_method = getattr(spec_class, method, None) if spec_class else None
        if original_method is None:
            continue

        def spec_hook(self, *args, _original=original_method, _method=method, **kwargs):
            log.record(f"flashinfer JitSpec.{_method}", str(getattr(self, "name", self)))
            return _original(self, *args, **kwargs)

        setattr(spec_class, method, spec_hook)
        log.installed.append(f"flashinfer.jit JitSpec.{method}")
    for module in (fi_jit, core):
        load = getattr(module, "load_cuda_ops", None) if module is not None else None
        if callable(load):

            def load_hook(name, *args, _original=load, **kwargs):
                log.record("flashinfer load_cuda_ops", str(name))
                return _original(name, *args, **kwargs)

            module.load_cuda_ops = load_hook
            log.installed.append(f"{module.__name__}.load_cuda_ops")


def traffic(engine) -> None:
    """Every path again, at sizes other than the warm-up's."""
    from engine.sampling_params import SamplingParams

    rng = random.Random(17)
    vocab = engine.model_config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    ids = iter(range(10**6))

    def add(prompt: list[int], params: SamplingParams) -> None:
        engine.add_request(f"traffic-{next(ids)}", prompt, params)

    def finish() -> None:
        while engine.has_unfinished_requests:
            engine.step()

    def greedy(max_tokens: int, **more) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **more)

    def until_decoding() -> None:
        for _ in range(50):
            if all(
                s.num_computed_tokens >= s.num_prompt_tokens
                for r in engine.requests.values()
                for s in r.sequences
            ):
                return
            engine.step()

    # A chunked prompt (3 chunks, an odd remainder), then a hit on its blocks.
    long_prompt = tokens(2 * BUDGET + 77)
    add(long_prompt, greedy(3))
    finish()
    add(long_prompt[: 2 * BUDGET] + tokens(9), greedy(3))
    add(long_prompt[:64] + tokens(1), greedy(3))
    finish()

    # Mixed steps at 5, 64, 70 and 95 decode rows, every sampler option among them.
    def sampled(**more) -> SamplingParams:
        return SamplingParams(max_tokens=12, ignore_eos=True, **more)

    options = [
        sampled(temperature=0.6, top_k=7, top_p=0.8, min_p=0.1, seed=21),
        sampled(temperature=1.3, repetition_penalty=0.9, frequency_penalty=-0.4, seed=22),
        sampled(n=3, temperature=1.0, presence_penalty=1.0, seed=23),
        SamplingParams(min_tokens=4, stop_token_ids=[5, 6], stop=["a", "b c"], max_tokens=12),
        greedy(12, logprobs=3),
    ]
    for rows in (5, 64, 70, MAX_NUM_SEQS - 1):
        used = 0
        for i in range(rows):
            params = options[i % len(options)] if i < 2 * len(options) else greedy(12)
            if used + params.n > rows:
                params = greedy(12)
            if used == rows:
                break
            add(tokens(2 + i % 5), params)
            used += params.n
        until_decoding()
        add(tokens(45 + rows), greedy(2, prompt_logprobs=7, logprobs=20))
        finish()

    # Pure decode through every batch size from MAX_NUM_SEQS down to 1: each graph bucket
    # and the padded sizes between them; greedy, plain seeded and logprob rows together.
    for i in range(MAX_NUM_SEQS):
        kind = i % 3
        params = (
            greedy(i + 2)
            if kind == 0
            else SamplingParams(seed=i, max_tokens=i + 2, ignore_eos=True, logprobs=kind - 1)
        )
        add(tokens(3), params)
    finish()

    # Everything at once, behind a hit and across chunks: n > 1 with penalties, filters,
    # bans, stops, logprobs and prompt logprobs.
    add(
        long_prompt[: BUDGET + 13],
        SamplingParams(
            n=4,
            temperature=0.9,
            top_k=50,
            top_p=0.95,
            min_p=0.01,
            repetition_penalty=1.3,
            presence_penalty=0.2,
            frequency_penalty=0.2,
            seed=5,
            max_tokens=10,
            min_tokens=3,
            stop=["zz"],
            stop_token_ids=[3],
            logprobs=20,
            prompt_logprobs=20,
        ),
    )
    add(long_prompt[: BUDGET + 30], greedy(6))
    finish()


def _child(model: str, block_size: int, results: mp.Queue) -> None:
    log = BuildLog()
    try:
        install_hooks(log)
        from engine.config import engine_config_from_flat
        from engine.core.engine import LLMEngine
        from engine.core.warmup import warm_up

        config = engine_config_from_flat(
            model=model,
            device="cuda",
            num_blocks=2048,
            block_size=block_size,
            max_num_seqs=MAX_NUM_SEQS,
            max_num_batched_tokens=BUDGET,
        )
        engine = LLMEngine(config)
        log.phase = "warm-up"
        report = warm_up(engine)
        log.phase = "traffic"
        traffic(engine)
        torch.cuda.synchronize()
        results.put(
            dict(
                installed=log.installed,
                start_up=log.after("start-up"),
                warm_up=log.after("warm-up"),
                traffic=log.after("traffic"),
                report=repr(report),
                stats=repr(engine.stats()),
            )
        )
    except BaseException:
        results.put(dict(error=traceback.format_exc(), installed=log.installed))


@pytest.mark.parametrize("block_size", [16, 64])  # 64: the default on CUDA
def test_nothing_compiles_on_traffic_after_the_warm_up(model_dir: Path, block_size):  # noqa: F811
    context = mp.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_child, args=(str(model_dir), block_size, results))
    child.start()
    try:
        out = results.get(timeout=1800)
    finally:
        child.join(60)
        if child.is_alive():
            child.terminate()
    assert "error" not in out, out["error"]
    print("hooks installed:", out["installed"])
    print(out["report"])
    print(f"built at start-up: {len(out['start_up'])}, in the warm-up: {len(out['warm_up'])}")
    assert out["installed"], "no build function to hook: flashinfer / triton changed"
    # The hooks see builds at all: a fresh process builds (or loads) its kernels first.
    assert out["start_up"] + out["warm_up"], "the hooks saw no build before the traffic"
    built = out["traffic"]
    assert not built, "built after the warm-up, on traffic:\n  " + "\n  ".join(built)
