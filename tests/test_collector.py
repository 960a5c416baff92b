"""engine/collector.py: the garbage collector's full passes run between engine steps only.

A cycle of objects in the oldest generation, dropped (unreachable: only a full pass of the
collector frees it), tells whether a full pass ran.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from engine import collector
from engine.collector import FullPasses
from engine.sampling_params import SamplingParams
from tests.tiny_models import write_tiny_model


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def old_cycle() -> weakref.ref:
    """A two-object cycle nothing refers to, in the oldest generation: no young pass
    looks at it again, only a full pass can free it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    gc.collect(1)  # still reachable: the young passes move it to the oldest generation
    alive = weakref.ref(a)
    del a, b
    return alive


@pytest.fixture
def restored_collector():
    thresholds = gc.get_threshold()
    yield
    gc.set_threshold(*thresholds)


def test_automatic_passes_are_young_ones_only(restored_collector) -> None:
    young, middle, _ = gc.get_threshold()
    FullPasses()
    assert gc.get_threshold()[:2] == (young, middle)
    assert gc.get_threshold()[2] >= 10**9  # after a billion middle passes: never, in effect
    assert gc.isenabled()


def test_a_full_pass_when_the_engine_falls_idle_after_work(restored_collector) -> None:
    passes = FullPasses()
    first = old_cycle()
    passes.after_step()  # busy: no full pass
    assert first() is not None and passes.passes == 0
    passes.collect_if_worked()  # fell idle after work: one pass
    assert first() is None and passes.passes == 1
    second = old_cycle()
    passes.collect_if_worked()  # still idle, no work since: no pass
    assert second() is not None and passes.passes == 1
    gc.collect()


def test_a_full_pass_under_continuous_load_once_the_interval_is_up(
    restored_collector, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr(collector.time, "monotonic", lambda: clock[0])
    passes = FullPasses()
    cycle = old_cycle()
    clock[0] += collector.FULL_PASS_INTERVAL_S - 1
    passes.after_step()
    assert cycle() is not None and passes.passes == 0
    clock[0] += 1
    passes.after_step()
    assert cycle() is None and passes.passes == 1


async def test_the_engine_loop_makes_a_full_pass_when_it_falls_idle(
    tmp_path, restored_collector
) -> None:
    """AsyncEngine's loop (thread placement): after the last request's events, one pass."""
    from engine.async_engine import AsyncEngine, EngineThread
    from engine.config import engine_config_from_flat
    from engine.engine import LLMEngine

    model = write_tiny_model(tmp_path, "llama")
    core = LLMEngine(engine_config_from_flat(model=str(model), num_blocks=64, block_size=4))
    engine = AsyncEngine(EngineThread(core))
    engine.start()
    try:
        passes = core._full_passes
        before = passes.passes
        cycle = old_cycle()
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        async for _ in engine.generate("a", [1, 2, 3], params):
            pass
        for _ in range(100):  # the pass runs on the loop's thread, after the delivery
            if passes.passes > before:
                break
            await asyncio.sleep(0.01)
        assert passes.passes == before + 1
        assert cycle() is None
    finally:
        engine.shutdown(timeout=5)
