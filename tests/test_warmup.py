"""engine/core/warmup.py on the CPU: what it runs, and that it leaves the engine as if fresh."""

from __future__ import annotations

import random

import pytest

from engine.config import engine_config_from_flat
from engine.core.engine import LLMEngine
from engine.core.warmup import warm_up
from engine.outputs import RequestOutputBuilder
from engine.sampling_params import SamplingParams
from tests.invariants import check_invariants
from tests.tiny_models import write_tiny_model

# Engine settings the warm-up must scale to: the default, a small budget that chunks its
# prompts, a budget that does not chunk, one sequence at a time, the device a step ahead.
CONFIGS = {
    "default": {},
    "small-budget": dict(max_num_seqs=8, max_num_batched_tokens=32),
    "unchunked": dict(max_num_seqs=3, max_num_batched_tokens=48, enable_chunked_prefill=False),
    "one-seq": dict(max_num_seqs=1, max_num_batched_tokens=16, block_size=4),
    "async": dict(max_num_seqs=8, max_num_batched_tokens=32, async_scheduling=True),
    "no-prefix-cache": dict(max_num_seqs=8, enable_prefix_caching=False),
}


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return write_tiny_model(
        tmp_path_factory.mktemp("warmup-tiny"), "qwen3", max_position_embeddings=512
    )


def engine_for(model, **settings) -> LLMEngine:
    return LLMEngine(engine_config_from_flat(model=str(model), num_blocks=256, **settings))


def workload(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    """Greedy prompts sharing a prefix (cache hits), one longer than the small budgets,
    and unseeded sampling, whose seeds come from the engine's own generator."""
    rng = random.Random(3)
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts = [shared + [rng.randrange(vocab) for _ in range(k)] for k in (1, 5, 9)]
    prompts += [[rng.randrange(vocab) for _ in range(70)], [rng.randrange(vocab)]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, n=2)
    return [(p, greedy) for p in prompts] + [(prompts[0], unseeded)]


def run(engine: LLMEngine, work) -> list[list[list[int]]]:
    builders = {}
    for i, (prompt, params) in enumerate(work):
        request = engine.add_request(f"r{i}", prompt, params)
        builders[request.request_id] = RequestOutputBuilder.start(
            request.request_id, request.prompt_token_ids, params.n
        )
    while engine.has_unfinished_requests:
        for event in engine.step():
            builders[event.request_id].add(event)
    return [[c.token_ids for c in builders[f"r{i}"].build().outputs] for i in range(len(work))]


def assert_fresh(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert not engine.requests and not engine.has_unfinished_requests
    assert stats.num_running_requests == stats.num_waiting_requests == 0
    assert stats.num_kv_blocks_used == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.block_manager._cached_block_ids, "the prefix cache kept warm-up blocks"
    assert stats.prefix_cache_queried_tokens == stats.prefix_cache_hit_tokens == 0
    assert stats.num_preemptions == 0
    assert stats.num_steps == stats.num_prompt_tokens_computed == stats.num_generated_tokens == 0
    check_invariants(engine.block_manager)


@pytest.mark.parametrize("settings", CONFIGS.values(), ids=CONFIGS.keys())
def test_warm_up_leaves_a_fresh_engine_that_serves_the_same_tokens(tiny_qwen3, settings):
    # Untimed steps: a budget cut by the clock (target_step_seconds) would chunk the two
    # runs apart, and the warm engine's is measured (the test below), the cold one's not.
    settings = {"target_step_seconds": 0, **settings}
    cold = engine_for(tiny_qwen3, **settings)
    warm = engine_for(tiny_qwen3, **settings)
    report = warm_up(warm)
    assert report.num_requests > 0 and report.num_steps > 0
    assert warm.info.startup.warmup == report.seconds > 0  # crosses a process boundary there
    assert_fresh(warm)

    work = workload(warm.model_config.vocab_size)
    assert run(warm, work) == run(cold, work)
    assert warm.stats() == cold.stats()  # counters and cache hits: only this traffic


class StepSpy:
    """What the warm-up's steps ran: every step the engine planned for the runner."""

    def __init__(self, engine: LLMEngine):
        self.steps: list[dict] = []
        plan_step = engine._plan

        def spy_plan(chunks):
            plan, samplers, masks = plan_step(chunks)
            self.steps.append(
                dict(
                    decodes=sum(c.end - c.start == 1 and c.start > 0 for c in chunks),
                    prefills=[(c.start, c.end, c.seq.num_prompt_tokens) for c in chunks
                              if c.start < c.seq.num_prompt_tokens],
                    hit=any(c.start > 0 and c.start == c.seq.num_cached_tokens
                            for c in chunks if c.start < c.seq.num_prompt_tokens),
                    # a later candidate starting from its first's prompt blocks
                    sibling_hit=any(c.seq.index > 0 and 0 < c.start < c.seq.num_prompt_tokens
                                    for c in chunks),
                    params=[seq.request.params for seq, rows, _ in samplers for _ in range(rows)],
                    prompt_logprobs=bool(plan.prompt_logprobs),
                    banned=plan.sampling.banned_ids is not None,
                )
            )  # fmt: skip
            return plan, samplers, masks

        engine._plan = spy_plan


def test_warm_up_runs_every_path_traffic_can_take(tiny_qwen3):
    engine = engine_for(tiny_qwen3, max_num_seqs=8, max_num_batched_tokens=32)
    spy = StepSpy(engine)
    report = warm_up(engine)
    steps = spy.steps
    assert len(steps) == report.num_steps

    # Prefill alone at 1 and 2 tokens, a chunked prompt longer than the budget, a hit.
    alone = [s["prefills"] for s in steps if not s["decodes"] and len(s["prefills"]) == 1]
    assert [(0, 1, 1)] in alone and [(0, 2, 2)] in alone
    assert any(end < total for s in steps for _, end, total in s["prefills"]), "no chunk"
    assert any(s["hit"] for s in steps), "no prefix-cache hit"
    # A step mixing decode rows with a prefill, and the sampler's paths.
    assert any(s["decodes"] and s["prefills"] for s in steps), "no mixed step"
    params = [p for s in steps for p in s["params"]]
    assert any(p.greedy for p in params) and any(not p.greedy for p in params)
    assert any(p.top_k > 0 and p.top_p < 1 and p.min_p > 0 for p in params)
    assert any(p.uses_penalties for p in params)
    assert any(p.logprobs == 20 for p in params) and any(p.logprobs == 0 for p in params)
    assert any(p.stop and p.stop_token_ids for p in params)
    assert any(s["banned"] for s in steps), "no min_tokens ban"
    assert any(s["prompt_logprobs"] for s in steps)
    assert any(p.n > 1 for p in params) and any(s["sibling_hit"] for s in steps), "no n > 1"
    assert any(p.constraint is not None for p in params), "no token mask (structured output)"
    # A step whose rows all take the one-pass sampler (no penalty, ban or filter).
    assert any(
        s["params"] and all(not (p.uses_penalties or p.top_k > 0) for p in s["params"])
        and not s["banned"]
        for s in steps
    )  # fmt: skip
    assert_fresh(engine)


def test_warm_up_measures_the_step_budget_of_timed_steps(tiny_qwen3):
    """Traffic's first long prompt is cut to the target step, not run at the whole budget."""
    engine = engine_for(tiny_qwen3)
    assert engine.scheduler.budget.target_seconds == engine.config.target_step_seconds > 0
    assert engine.scheduler.budget.tokens_per_second is None
    warm_up(engine)
    assert engine.scheduler.budget.tokens_per_second > 0


def test_the_engine_thread_warms_up_before_its_first_stats(tiny_qwen3):
    from engine.serving.async_engine import EngineThread

    engine = engine_for(tiny_qwen3, max_num_seqs=4, max_num_batched_tokens=32)
    core = EngineThread(engine)
    delivered = []
    core.start(delivered.append, lambda error: None)
    try:
        assert core.info.startup.warmup > 0
        assert delivered and delivered[0].stats.num_steps == 0
    finally:
        core.shutdown(5)


def test_kernel_cache_dir_points_triton_and_flashinfer_at_one_directory(tmp_path, monkeypatch):
    import os

    from engine.core.kernel_cache import FLASHINFER_ENV, TRITON_ENV, apply_kernel_cache_dir

    monkeypatch.delenv(TRITON_ENV, raising=False)
    monkeypatch.delenv(FLASHINFER_ENV, raising=False)
    apply_kernel_cache_dir(None)
    assert TRITON_ENV not in os.environ and FLASHINFER_ENV not in os.environ
    apply_kernel_cache_dir(tmp_path / "k")
    # flashinfer keeps its JIT cache under $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer.
    assert os.environ[FLASHINFER_ENV] == str((tmp_path / "k").resolve())
    assert os.environ[TRITON_ENV] == str((tmp_path / "k" / "triton").resolve())
    assert (tmp_path / "k" / "triton").is_dir()


def test_the_engine_process_warms_up_and_applies_the_kernel_cache_in_the_child(
    tiny_qwen3, tmp_path
):
    from engine.serving.async_engine import AsyncEngine
    from engine.serving.engine_process import EngineProcess

    cache = tmp_path / "kernels"
    config = engine_config_from_flat(
        model=str(tiny_qwen3), num_blocks=128, max_num_seqs=4, kernel_cache_dir=str(cache)
    )
    engine = AsyncEngine(EngineProcess(config))
    engine.start()
    try:
        # Applied where the engine was built: this process never built one.
        assert (cache / "triton").is_dir()
        assert engine.info.startup.warmup > 0 and engine.info.startup.model_load > 0
        assert engine.stats.num_steps == 0 and engine.stats.num_kv_blocks_used == 0
    finally:
        engine.shutdown(timeout=10)
