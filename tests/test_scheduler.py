"""Scheduler + block manager, driven by a fake model step (no tensors).

The fake step does what the engine does after a forward: advance num_computed_tokens,
publish full blocks, append a token when a chunk samples, finish at a target length.
"""

from __future__ import annotations

import itertools
from array import array

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from engine.config import CPU_TARGET_STEP_SECONDS, EngineConfig, SchedulerConfig
from engine.core.batch import SlotBook
from engine.core.request import Request, Sequence, SequenceStatus
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.step_budget import MIN_PREFILL_TOKENS, StepBudget
from engine.errors import ValidationError
from engine.kv.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from tests.invariants import check_invariants

_arrivals = itertools.count()


def make_seq(prompt: list[int], max_tokens: int, priority: int = 0) -> Sequence:
    request = Request(
        request_id=f"r{next(_arrivals)}",
        prompt_token_ids=tuple(prompt),
        params=SamplingParams(max_tokens=max_tokens),
        max_tokens=max_tokens,
        priority=priority,
        arrival_order=next(_arrivals),
    )
    seq = Sequence(request, 0, 0, array("q", prompt), detokenizer=None, stop_matcher=None)
    request.sequences.append(seq)
    return seq


def fake_step(sched: Scheduler, out: SchedulerOutput, next_token: int = 7) -> list[Sequence]:
    """Apply a step's results; returns the sequences that finished."""
    finished = []
    for chunk in out.chunks:
        seq = chunk.seq
        assert seq.num_computed_tokens == chunk.start
        seq.num_computed_tokens = chunk.end
        sched.block_manager.register_full_blocks(seq.block_table, seq.token_ids, chunk.end)
        if chunk.samples:
            seq.token_ids.append(next_token)
            seq.num_tokens += 1
            if seq.num_output_tokens >= seq.request.max_tokens:
                sched.remove(seq)
                finished.append(seq)
    return finished


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    seqs = [c.seq for c in out.chunks]
    assert len(seqs) == len(set(map(id, seqs))), "a sequence scheduled twice in one step"
    # Unchunked prompts longer than the budget run whole, alone in their step.
    alone = not cfg.enable_chunked_prefill and len(out.chunks) == 1
    assert out.num_tokens == sum(c.end - c.start for c in out.chunks)
    assert out.num_tokens <= out.budget <= cfg.max_num_batched_tokens or alone
    assert len(sched.running) <= cfg.max_num_seqs
    for c in out.chunks:
        assert c.seq.status is SequenceStatus.RUNNING
        assert c.end - c.start >= 1
        assert len(c.seq.block_table.block_ids) * sched.block_manager.block_size >= c.end
    for p in out.preempted:
        assert p not in seqs and p.status is SequenceStatus.WAITING and not p.block_table.block_ids
        assert p.slot is None
    slots = [s.slot for s in sched.running]
    assert None not in slots and len(set(slots)) == len(slots), "two sequences in one slot"
    assert len(sched.slots._free) == cfg.max_num_seqs - len(sched.running)


def has_work(sched: Scheduler) -> bool:
    return bool(sched.waiting or sched.running)


def new_scheduler(
    num_blocks=64, block_size=4, max_seqs=8, budget=32, chunked=True, target_step_seconds=None
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    slots = SlotBook(max_seqs, token_width=num_blocks * block_size + 1, block_width=num_blocks + 1)
    config = SchedulerConfig(max_seqs, budget, chunked)
    return Scheduler(config, bm, slots, target_step_seconds)


def run_to_completion(sched: Scheduler, max_steps: int = 10_000) -> int:
    steps = 0
    while has_work(sched):
        out = sched.schedule()
        check_step(sched, out)
        assert not out.is_empty, "scheduler stalled with work left (deadlock)"
        fake_step(sched, out)
        check_invariants(sched.block_manager)
        steps += 1
        assert steps < max_steps
    return steps


def test_an_unchunked_prompt_that_waits_holds_no_cached_blocks():
    # Holding them, it could starve the running sequences of blocks: each preempts itself
    # for want of them, and nothing is left to run (hypothesis found such a stall).
    sched = new_scheduler(num_blocks=16, block_size=1, budget=4, chunked=False)
    sched.add(make_seq([5, 6, 7], max_tokens=1))
    run_to_completion(sched)  # leaves [5, 6, 7] in the prefix cache
    decoding = make_seq([1], max_tokens=10)
    sched.add(decoding)
    fake_step(sched, sched.schedule())
    waiting = make_seq([5, 6, 7, 20, 21, 22, 23, 24], max_tokens=1)  # 5 uncached > budget 4
    sched.add(waiting)
    out = sched.schedule()
    assert [c.seq for c in out.chunks] == [decoding]
    assert waiting.block_table.block_ids == [] and waiting.num_computed_tokens == 0
    check_invariants(sched.block_manager)
    run_to_completion(sched)
    assert sched.block_manager.num_used_blocks == 0


def test_chunked_prefill_splits_long_prompt_while_decodes_continue():
    sched = new_scheduler(budget=16)
    short = make_seq(list(range(4)), max_tokens=50)
    sched.add(short)
    fake_step(sched, sched.schedule())  # short prefilled, now decoding
    long = make_seq(list(range(100, 160)), max_tokens=2)
    sched.add(long)
    chunk_sizes = []
    while long.num_computed_tokens < 60:
        out = sched.schedule()
        sizes = {id(c.seq): c.end - c.start for c in out.chunks}
        assert sizes.get(id(short)) == 1, "decode starved"
        chunk_sizes.append(sizes[id(long)])
        fake_step(sched, out)
    assert len(chunk_sizes) > 1 and sum(chunk_sizes) == 60
    assert max(chunk_sizes) <= 15  # budget 16 minus the decode token


def test_without_chunked_prefill_prompts_run_whole():
    sched = new_scheduler(budget=16, chunked=False)
    a, b = make_seq(list(range(10)), 1), make_seq(list(range(20, 30)), 1)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(c.seq, c.end - c.start) for c in out.chunks] == [(a, 10)]


class SimulatedCPU:
    """A step costs a fixed part and a part per token (the CPU's prefill, roughly)."""

    def __init__(self, fixed: float, per_token: float):
        self.fixed, self.per_token = fixed, per_token

    def step(self, sched: Scheduler) -> tuple[SchedulerOutput, float]:
        """Schedule and run one step, telling the scheduler its time; returns both."""
        out = sched.schedule()
        check_step(sched, out)
        seconds = self.fixed + self.per_token * out.num_tokens
        sched.budget.record(out.num_tokens, out.budget, seconds)
        fake_step(sched, out)
        return out, seconds

    def on_target(self, times: list[float], target: float) -> bool:
        """Every step within a token's time of the target (budgets are whole tokens)."""
        return all(abs(t - target) < 1.01 * self.per_token for t in times)


def long_prompts_scheduler(target: float | None) -> Scheduler:
    sched = new_scheduler(num_blocks=4096, block_size=16, max_seqs=4, budget=2048,
                          target_step_seconds=target)  # fmt: skip
    for i in range(4):
        sched.add(make_seq([i] * 8000, max_tokens=1000))
    return sched


def test_timed_steps_take_their_target_and_follow_the_machines_speed():
    target, cpu = 0.25, SimulatedCPU(fixed=0.02, per_token=0.001)  # 2,048 tokens: 2.1 s
    sched = long_prompts_scheduler(target)
    # Nothing measured yet: the whole budget, once; then what the target holds at the rate
    # of the last full step, over it by at most the fixed part, and soon on it.
    out, seconds = cpu.step(sched)
    assert out.num_tokens == 2048
    times = [cpu.step(sched)[1] for _ in range(6)]
    assert all(t <= target + cpu.fixed for t in times), times
    assert cpu.on_target(times[2:], target), times

    # Other processes take the cores: a step of the same size now takes 3x as long. That
    # one step is over; the next ones are back within the target and its fixed part.
    cpu.fixed, cpu.per_token = 0.04, 0.003
    first, *later = [cpu.step(sched)[1] for _ in range(6)]
    assert first > 2 * target
    assert all(t <= target + cpu.fixed for t in later), later
    assert cpu.on_target(later[2:], target), later
    # They leave: the budget grows back to the target's within a few steps.
    cpu.fixed, cpu.per_token = 0.02, 0.001
    times = [cpu.step(sched)[1] for _ in range(6)]
    assert cpu.on_target(times[3:], target), times


def test_a_timed_step_always_carries_every_decode_and_a_little_prompt():
    """However slow the machine, the streams get their token each step and prompts move."""
    sched = new_scheduler(num_blocks=4096, block_size=16, max_seqs=40, budget=2048,
                          target_step_seconds=0.25)  # fmt: skip
    decoding = [make_seq([i], max_tokens=1000) for i in range(32)]
    long = make_seq([7] * 4000, max_tokens=1)
    for seq in [*decoding, long]:
        sched.add(seq)
    cpu = SimulatedCPU(fixed=0.5, per_token=0.05)  # a one-token step overruns the target
    cpu.step(sched)  # the 32 one-token prompts and the long one's first chunk: measured
    for _ in range(5):
        out, _ = cpu.step(sched)
        sizes = {id(c.seq): c.end - c.start for c in out.chunks}
        assert all(sizes.get(id(seq)) == 1 for seq in decoding), "a decode starved"
        assert sizes[id(long)] == MIN_PREFILL_TOKENS


def test_a_full_step_measures_the_rate_and_a_smaller_one_only_raises_it():
    budget = StepBudget(max_tokens=2048, target_seconds=0.25)
    assert budget.tokens([]) == 2048  # nothing measured yet
    budget.record(num_tokens=500, budget=2048, seconds=1.0)  # less work than allowed: a bound
    assert budget.tokens([]) == 125
    budget.record(num_tokens=250, budget=250, seconds=0.125)  # full: 2,000 tokens a second
    assert budget.tokens([]) == 500
    budget.record(num_tokens=4, budget=500, seconds=0.2)  # decodes alone: slower, says nothing
    assert budget.tokens([]) == 500
    budget.record(num_tokens=400, budget=500, seconds=0.1)  # not full, yet quicker: faster
    assert budget.tokens([]) == 1000
    budget.record(num_tokens=1000, budget=1000, seconds=1.0)  # full and slower: slower
    assert budget.tokens([]) == 250
    budget.record(num_tokens=0, budget=250, seconds=0.001)  # nothing ran
    assert budget.tokens([]) == 250
    assert budget.tokens([1] * 300) == 300 + MIN_PREFILL_TOKENS  # every decode, and a little
    assert budget.tokens([1] * 3000) == 2048  # never over max_num_batched_tokens
    untimed = StepBudget(max_tokens=2048, target_seconds=None)
    untimed.record(num_tokens=2048, budget=2048, seconds=100.0)
    assert untimed.tokens([]) == 2048


def test_steps_are_timed_on_the_cpu_by_default_and_only_with_chunked_prefill():
    assert EngineConfig(device="cpu").target_step_seconds == CPU_TARGET_STEP_SECONDS
    assert EngineConfig(device="cuda").target_step_seconds is None  # milliseconds a step
    unchunked = SchedulerConfig(enable_chunked_prefill=False)
    assert EngineConfig(device="cpu", scheduler=unchunked).target_step_seconds is None
    off = SchedulerConfig(target_step_seconds=0)
    assert EngineConfig(device="cpu", scheduler=off).target_step_seconds is None
    on = SchedulerConfig(target_step_seconds=0.1)
    assert EngineConfig(device="cuda", scheduler=on).target_step_seconds == 0.1
    with pytest.raises(ValidationError, match="needs chunked prefill"):
        SchedulerConfig(enable_chunked_prefill=False, target_step_seconds=0.5)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValidationError, match="finite number >= 0"):
            SchedulerConfig(target_step_seconds=bad)


def test_priority_then_fcfs():
    sched = new_scheduler(max_seqs=1)
    low, high1, high2 = make_seq([1, 2], 1, 0), make_seq([3, 4], 1, 5), make_seq([5, 6], 1, 5)
    for s in (low, high1, high2):
        sched.add(s)
    order = []
    while has_work(sched):
        out = sched.schedule()
        order.extend(c.seq for c in out.chunks if c.start == 0)
        fake_step(sched, out)
    assert order == [high1, high2, low]


def test_preemption_under_kv_pressure_then_everyone_finishes():
    sched = new_scheduler(num_blocks=8, block_size=4, max_seqs=8, budget=64)
    seqs = [make_seq(list(range(i * 10, i * 10 + 6)), max_tokens=20) for i in range(4)]
    for s in seqs:
        sched.add(s)
    run_to_completion(sched)
    assert sched.num_preemptions > 0
    assert all(s.num_output_tokens == 20 for s in seqs)
    assert sched.block_manager.num_used_blocks == 0


def test_victim_is_lowest_priority_latest_arrival():
    sched = new_scheduler(num_blocks=6, block_size=4, max_seqs=8, budget=64)
    old = make_seq(list(range(8)), max_tokens=30, priority=1)
    young = make_seq(list(range(50, 58)), max_tokens=30, priority=1)
    low = make_seq(list(range(90, 94)), max_tokens=30, priority=0)
    for s in (old, young, low):
        sched.add(s)
    preempted = []
    while not preempted:
        out = sched.schedule()
        preempted = out.preempted
        fake_step(sched, out)
    assert preempted[0] is low


def test_prefix_hit_skips_computed_tokens():
    sched = new_scheduler(block_size=4)
    a = make_seq(list(range(12)), max_tokens=1)
    sched.add(a)
    run_to_completion(sched)
    b = make_seq(list(range(12)) + [99], max_tokens=1)
    sched.add(b)
    out = sched.schedule()
    assert out.chunks[0].start == 12 and out.chunks[0].end == 13
    assert b.num_cached_tokens == 12


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 24),
        block_size=st.sampled_from([1, 2, 4]),
        max_seqs=st.integers(1, 6),
        budget=st.integers(1, 24),
        chunked=st.booleans(),
        timed=st.booleans(),
    )
    def setup(self, num_blocks, block_size, max_seqs, budget, chunked, timed):
        target = 0.25 if timed and chunked else None
        self.sched = new_scheduler(num_blocks, block_size, max_seqs, budget, chunked, target)
        self.capacity = num_blocks * block_size
        self.live: list[Sequence] = []

    @rule(
        prompt=st.lists(st.integers(0, 3), min_size=1, max_size=30),
        max_tokens=st.integers(1, 10),
        priority=st.integers(0, 2),
    )
    def submit(self, prompt, max_tokens, priority):
        if len(prompt) + max_tokens > self.capacity:  # the engine rejects these at admission
            return
        seq = make_seq(prompt, max_tokens, priority)
        self.sched.add(seq)
        self.live.append(seq)

    @rule(seconds=st.floats(1e-4, 10.0))
    def step(self, seconds):
        out = self.sched.schedule()
        check_step(self.sched, out)
        if self.live and not out.chunks:
            assert not has_work(self.sched)
        self.sched.budget.record(out.num_tokens, out.budget, seconds)
        for seq in fake_step(self.sched, out):
            self.live.remove(seq)

    @rule(data=st.data())
    def cancel(self, data):
        if not self.live:
            return
        seq = data.draw(st.sampled_from(self.live))
        self.sched.remove(seq)
        self.live.remove(seq)

    @invariant()
    def pool_consistent(self):
        if hasattr(self, "sched"):
            check_invariants(self.sched.block_manager)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        run_to_completion(self.sched)
        bm = self.sched.block_manager
        assert bm.num_used_blocks == 0
        assert bm.num_free_blocks == bm.num_blocks


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_later_candidate_runs_once_its_first_ended_with_the_prompt_uncomputed():
    """Candidate 0 can end while preempted (its last token read back a step late, under
    async scheduling), its prompt no longer computed: candidate 1 must not wait for it."""
    sched = new_scheduler()
    first = make_seq(list(range(10)), max_tokens=4)
    request = first.request
    second = Sequence(request, 1, 1, array("q", request.prompt_token_ids), None, None)
    request.sequences.append(second)
    sched.add(first)
    sched.add(second)
    out = sched.schedule()
    assert [c.seq for c in out.chunks] == [first]  # the second waits for the prompt
    sched.remove(first)  # ends as a preempted one would: nothing computed
    first.num_computed_tokens = 0
    out = sched.schedule()
    assert [c.seq for c in out.chunks] == [second]
