"""engine/collector.py: the garbage collector's full passes run between engine steps only.

A cycle of objects in the oldest generation, dropped (unreachable: only a full pass of the
collector frees it), tells whether a full pass ran.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from engine import collector
from engine.collector import FullPasses
from engine.llm import LLM
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


def test_automatic_passes_are_young_and_rarer(restored_collector) -> None:
    FullPasses()
    young, _, full = gc.get_threshold()
    assert young == collector.YOUNG_THRESHOLD > 700
    assert full >= 10**9  # after a billion middle passes: never, in effect
    assert gc.isenabled()


def test_a_full_pass_when_the_engine_falls_idle_after_work(restored_collector) -> None:
    passes = FullPasses()
    first = old_cycle()
    passes.after_step(idle=False)  # busy: no full pass
    assert first() is not None and passes.passes == 0
    passes.after_step(idle=True)  # fell idle after work: one pass
    assert first() is None and passes.passes == 1
    second = old_cycle()
    passes.after_step(idle=True)  # still idle, no work since: no pass
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
    passes.after_step(idle=False)
    assert cycle() is not None and passes.passes == 0
    clock[0] += 1
    passes.after_step(idle=False)
    assert cycle() is None and passes.passes == 1


def test_the_engine_makes_its_full_pass_when_generate_is_done(tmp_path, restored_collector):
    llm = LLM(str(write_tiny_model(tmp_path, "llama")), num_blocks=64, block_size=4)
    passes = llm.engine._full_passes
    before = passes.passes
    cycle = old_cycle()
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert passes.passes == before + 1
    assert cycle() is None
