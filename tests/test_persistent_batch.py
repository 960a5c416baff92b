"""The engine core's device-side batch: slots whose token and block rows live on the
device, a runner driven by plain step plans, multi-token steps that verify proposed
tokens and roll back the rest, and the per-row logits mask."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.core.batch import SlotBook
from engine.core.request import Sequence
from engine.core.runner import MAX_GRAPH_ROWS_KV_READS, MAX_GRAPH_ROWS_PER_SEQ, StepPlan
from engine.core.sampler import SamplingRows
from engine.llm import LLM
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams
from tests.invariants import check_invariants
from tests.test_engine import GREEDY, assert_pool_empty, random_prompts
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


def make_llm(tiny_llama, **kwargs) -> LLM:
    return LLM(str(tiny_llama), num_blocks=kwargs.pop("num_blocks", 64), block_size=4, **kwargs)


# ---- the slot book ------------------------------------------------------------------------


def test_slot_book_sends_rows_once_then_only_what_changed():
    book = SlotBook(num_slots=2, token_width=10, block_width=3)
    a = book.place([5, 6, 7], [4])
    b = book.place([8], [2])
    assert (a, b) == (0, 1)
    changes = book.take_changes()
    assert changes.token_index.tolist() == [0, 1, 2, 10]
    assert changes.token_ids.tolist() == [5, 6, 7, 8]
    assert changes.block_index.tolist() == [0, 3] and changes.block_ids.tolist() == [4, 2]

    book.sync_blocks(a, [4])  # nothing new
    book.sync_blocks(b, [2, 9])  # one block appended
    changes = book.take_changes()
    assert changes.token_index.size == 0
    assert changes.block_index.tolist() == [4] and changes.block_ids.tolist() == [9]

    book.sync_blocks(b, [2])  # rolled back: forgets, sends nothing
    book.sync_blocks(b, [2, 11])
    assert book.take_changes().block_ids.tolist() == [11]
    book.release(a)
    assert book.place([1], [3]) == a and len(book._free) == 0


# ---- the device rows follow the sequences -------------------------------------------------


def assert_rows_match(llm: LLM) -> None:
    """Every running sequence's slot holds its tokens and blocks on the device."""
    batch = llm.engine.runner.batch
    for seq in llm.engine.scheduler.running:
        known = len(seq.token_ids)
        row = batch.token_ids[seq.slot, :known].tolist()
        assert row == seq.token_ids.tolist(), "token row differs from the sequence"
        blocks = seq.block_table.block_ids
        assert batch.block_table[seq.slot, : len(blocks)].tolist() == blocks


def test_slots_hold_each_running_sequence_and_decodes_send_only_new_blocks(tiny_llama, monkeypatch):
    llm = make_llm(tiny_llama, num_blocks=40, async_scheduling=False)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    steps = []  # per step: (token ids sent, block ids sent, sequences, all decodes)
    placed = []  # tokens of every sequence placed in a slot
    forward, place = engine.runner.forward, engine.scheduler.slots.place

    def spy_forward(plan: StepPlan):
        decodes = bool((plan.query_lens == 1).all())
        sent = (plan.changes.token_ids.size, plan.changes.block_ids.size)
        steps.append((*sent, len(plan.slots), decodes))
        return forward(plan)

    def spy_place(token_ids, block_ids):
        placed.append(len(token_ids))
        return place(token_ids, block_ids)

    monkeypatch.setattr(engine.runner, "forward", spy_forward)
    monkeypatch.setattr(engine.scheduler.slots, "place", spy_place)
    prompts = random_prompts(6, vocab, seed=3, lo=5, hi=30)
    for i, prompt in enumerate(prompts):  # 40 blocks of 4: preemption recomputes some
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=24, **GREEDY))
    while engine.has_unfinished_requests:
        engine.step()
        assert_rows_match(llm)
    assert engine.scheduler.num_preemptions > 0
    # Token ids travel when a sequence is placed in a slot, never again; a decode step
    # sends at most the one block each sequence grows into.
    assert sum(t for t, _, _, _ in steps) == sum(placed)
    decode_steps = [(t, b, n) for t, b, n, decodes in steps if decodes and not t]
    assert len(decode_steps) > len(steps) / 2
    assert all(b <= n for _, b, n in decode_steps)
    assert any(b == 0 for _, b, _ in decode_steps)
    assert_pool_empty(llm)


def test_penalties_and_candidates_run_ahead_without_a_sync(tiny_llama):
    """Penalties read the token rows on the device, and n > 1 needs no fork: neither
    makes the async engine wait for a step's tokens before queueing the next."""
    llm = make_llm(tiny_llama, num_blocks=128, async_scheduling=True)
    sync = make_llm(tiny_llama, num_blocks=128, async_scheduling=False)
    params = [
        SamplingParams(max_tokens=16, seed=1, repetition_penalty=1.4, frequency_penalty=0.6),
        SamplingParams(max_tokens=16, n=3, seed=2, temperature=0.9, presence_penalty=0.5),
    ]
    prompts = random_prompts(2, llm.engine.model_config.vocab_size, seed=4, lo=6, hi=20)
    engine = llm.engine
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, sp)
    ran_ahead = 0
    while engine.has_unfinished_requests:
        engine.step()
        ran_ahead += bool(engine._in_flight)
    assert ran_ahead > 10
    want = sync.generate(prompts, params)
    got = llm.generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]


# ---- the runner takes plain arrays --------------------------------------------------------


def test_runner_decodes_from_a_hand_written_plan(tiny_llama):
    """No scheduler, no sequences: slots, lengths and sampling rows make the same greedy
    tokens as the engine."""
    llm = make_llm(tiny_llama, async_scheduling=False)
    prompt = random_prompts(1, llm.engine.model_config.vocab_size, seed=9, lo=9, hi=9)[0]
    want = llm.generate([prompt], SamplingParams(max_tokens=6, **GREEDY))[0].outputs[0].token_ids

    runner = llm.engine.runner
    book = SlotBook(2, runner.token_width, runner.block_width)
    slot = book.place(prompt, [3, 4, 5, 6])  # 16 positions in blocks the pool has free
    greedy = SamplingParams(max_tokens=6, **GREEDY)
    got, length, query = [], len(prompt), len(prompt)
    for _ in range(6):
        plan = StepPlan(
            slots=np.array([slot], dtype=np.int32),
            query_lens=np.array([query], dtype=np.int32),
            seq_lens=np.array([length], dtype=np.int32),
            num_samples=np.array([1], dtype=np.int32),
            num_prompt_tokens=np.array([len(prompt)], dtype=np.int32),
            sampling=SamplingRows.build(
                [greedy], [0], [length - len(prompt)], [[]], runner.config.vocab_size
            ),
            prompt_logprobs={},
            changes=book.take_changes(),
        )
        got += runner.collect(runner.sample(runner.forward(plan))).token_ids
        length, query = length + 1, 1
    assert got == want
    assert runner.batch.token_ids[slot, : len(prompt) + 6].tolist() == prompt + want


def step_plan(runner, query_lens, seq_lens, num_samples, prompt_logprobs=None) -> StepPlan:
    """A plan of greedy sequences in slots 3, 0, 5, ... whose prompts are 2 tokens."""
    slots = np.array([3, 0, 5, 1, 2, 4][: len(query_lens)], dtype=np.int32)
    rows = sum(num_samples)
    return StepPlan(
        slots=slots,
        query_lens=np.array(query_lens, dtype=np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        num_samples=np.array(num_samples, dtype=np.int32),
        num_prompt_tokens=np.full(len(slots), 2, dtype=np.int32),
        sampling=SamplingRows.build(
            [SamplingParams(**GREEDY)] * rows,
            [0] * rows,
            [0] * rows,
            [[]] * rows,
            runner.config.vocab_size,
        ),
        prompt_logprobs=prompt_logprobs or {},
        changes=SlotBook(6, runner.token_width, runner.block_width).take_changes(),
    )


def graph_sizes(runner, size: int = 8, largest: int = 8) -> None:
    """Graph sizing alone (batch_size_for, max_batch_size): what the row builders read."""
    sizes = {"batch_size_for": lambda self, n: size, "max_batch_size": largest}
    runner.graphs = type("Sizes", (), sizes)()


def test_a_graph_steps_rows_are_the_eager_rows_padded_with_the_padding_slot(tiny_llama):
    """A CUDA graph's decode step builds its rows its own quicker way: the same slots,
    positions and sampled places as the eager rows, then padding rows (the padding slot,
    position 0, length 1) up to the graph's size."""
    runner = make_llm(tiny_llama).engine.runner
    graph_sizes(runner)
    plan = step_plan(runner, [1, 1, 1], [17, 4, 9], [1, 1, 1])
    eager, graph = runner._eager_rows(plan), runner._graph_rows(plan)
    padding = runner.batch.padding_slot
    assert graph.uploads[0].tolist() == [[3, 0, 5] + [padding] * 5, [16, 3, 8] + [0] * 5]
    assert np.array_equal(graph.uploads[0][:, :3], eager.uploads[0])
    assert graph.slots.tolist() == [3, 0, 5] + [padding] * 5
    assert graph.seq_lens.tolist() == [17, 4, 9] + [1] * 5
    assert np.array_equal(graph.sample_slots, eager.sample_slots)
    assert np.array_equal(graph.sample_ends, eager.sample_ends)
    assert len(eager.uploads[3]) == len(graph.sample_slots) == 3 and not graph.spans
    assert len(graph.uploads) == 1  # the hidden rows are the samples' own: no gather


def test_a_sequence_computing_several_tokens_runs_in_a_graph_as_one_row_each(tiny_llama):
    """A sequence whose step computes a few positions (forced tokens, a proposer's guesses)
    replays as that many decode rows, each as long as its own prefix, so each attends as
    its row of a causal chunk does; the rows read back are the eager step's sampled ones."""
    runner = make_llm(tiny_llama).engine.runner
    graph_sizes(runner)
    # 1 token of slot 3; 3 of slot 0 (forced tokens, one sample); 2 of slot 5, both sampled
    plan = step_plan(runner, [1, 3, 2], [17, 4, 9], [1, 1, 2])
    assert runner._replayable(plan)
    eager, graph = runner._eager_rows(plan), runner._graph_rows(plan)
    padding = runner.batch.padding_slot
    assert graph.uploads[0].tolist() == [
        [3, 0, 0, 0, 5, 5, padding, padding],
        [16, 1, 2, 3, 7, 8, 0, 0],
    ]
    assert np.array_equal(graph.uploads[0][:, :6], eager.uploads[0])
    assert graph.seq_lens.tolist() == [17, 2, 3, 4, 8, 9, 1, 1]
    assert graph.uploads[1].tolist() == eager.uploads[3].tolist() == [0, 3, 4, 5]
    assert np.array_equal(graph.sample_slots, eager.sample_slots)
    assert np.array_equal(graph.sample_ends, eager.sample_ends)


def test_steps_a_graph_cannot_run_run_eagerly(tiny_llama):
    """Eager: a sequence of more than MAX_GRAPH_ROWS_PER_SEQ positions or whose rows would
    read more than MAX_GRAPH_ROWS_KV_READS KV tokens, a middle piece of a prefill (nothing
    sampled), prompt logprobs, more rows than the largest graph."""
    runner = make_llm(tiny_llama).engine.runner
    graph_sizes(runner, largest=64)
    longest = MAX_GRAPH_ROWS_PER_SEQ
    assert runner._replayable(step_plan(runner, [longest], [longest + 2], [1]))
    assert not runner._replayable(step_plan(runner, [longest + 1], [longest + 2], [1]))
    context = MAX_GRAPH_ROWS_KV_READS // 4
    assert runner._replayable(step_plan(runner, [1, 4], [9, context], [1, 1]))
    assert not runner._replayable(step_plan(runner, [1, 4], [9, context + 1], [1, 1]))
    assert runner._replayable(step_plan(runner, [1], [context * 8], [1]))  # one row: no more
    graph_sizes(runner, largest=8)
    assert not runner._replayable(step_plan(runner, [1, 4], [9, 6], [1, 0]))
    assert not runner._replayable(step_plan(runner, [1], [9], [1], prompt_logprobs={0: 1}))
    assert runner._replayable(step_plan(runner, [4, 4], [9, 9], [1, 1]))
    assert not runner._replayable(step_plan(runner, [4, 4, 1], [9, 9, 9], [1, 1, 1]))
    runner.graphs = None
    assert not runner._replayable(step_plan(runner, [1], [9], [1]))


def test_graph_room_is_the_most_tokens_a_sequence_may_add_and_still_replay(tiny_llama):
    """runner.graph_room(n), for a sequence of n tokens whose last is not yet computed: the
    tokens appended to it that leave its next step replayable, one more not (the engine
    appends forced tokens by it). None may be added where one row already reads the most."""
    runner = make_llm(tiny_llama).engine.runner
    graph_sizes(runner, largest=64)
    assert runner.max_graph_rows == 64
    for num_tokens in (3, 100, MAX_GRAPH_ROWS_KV_READS // 8, MAX_GRAPH_ROWS_KV_READS // 3):
        room = runner.graph_room(num_tokens)
        plan = step_plan(runner, [room + 1], [num_tokens + room], [1])
        over = step_plan(runner, [room + 2], [num_tokens + room + 1], [1])
        assert runner._replayable(plan) and not runner._replayable(over), num_tokens
    assert runner.graph_room(3) == MAX_GRAPH_ROWS_PER_SEQ - 1
    assert runner.graph_room(MAX_GRAPH_ROWS_KV_READS) == 0
    runner.graphs = None
    assert runner.max_graph_rows is None


# ---- multi-token steps ----------------------------------------------------------------------


class StubProposer:
    """Proposes the tokens a reference run produced, with some deliberately wrong."""

    def __init__(self, reference: dict[tuple[str, int], list[int]], wrong_every: int, seed: int):
        self.reference = reference
        self.wrong_every = wrong_every
        self.rng = random.Random(seed)
        self.proposed = 0

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        known = self.reference[seq.request.request_id, seq.index]
        done = seq.num_output_tokens
        guesses = list(known[done : done + self.rng.randint(0, 4)])[:max_tokens]
        for i in range(len(guesses)):
            if self.rng.randrange(self.wrong_every) == 0:
                guesses[i] = (guesses[i] + 1) % 400
        self.proposed += len(guesses)
        return guesses


@pytest.mark.parametrize("wrong_every", [1000, 3, 1])  # mostly right, mixed, always wrong
def test_verified_proposals_equal_the_plain_path_token_for_token(tiny_llama, wrong_every):
    vocab = 400
    prompts = random_prompts(6, vocab, seed=11, lo=4, hi=30)
    sampled = dict(temperature=0.9, top_k=30, ignore_eos=True)
    params = [
        SamplingParams(max_tokens=20, **GREEDY),
        SamplingParams(max_tokens=18, seed=1, **sampled),
        SamplingParams(max_tokens=15, seed=2, repetition_penalty=1.3, **sampled),
        SamplingParams(max_tokens=12, n=2, seed=3, **sampled),
        SamplingParams(max_tokens=16, logprobs=2, **GREEDY),
        SamplingParams(max_tokens=20, stop=["a"], seed=4, temperature=1.0),
    ]
    plain = make_llm(tiny_llama, num_blocks=48, async_scheduling=False).generate(prompts, params)
    reference = {
        (f"p{i}", o.index): o.token_ids for i, out in enumerate(plain) for o in out.outputs
    }
    llm = make_llm(tiny_llama, num_blocks=48, async_scheduling=True)
    engine = llm.engine
    engine.proposer = StubProposer(reference, wrong_every, seed=wrong_every)
    verified = []  # per step: proposed tokens verified
    forward = engine.runner.forward
    engine.runner.forward = lambda plan: (
        verified.append(int((plan.num_samples - 1).clip(0).sum())) or forward(plan)
    )
    outputs: dict[str, list] = {}
    for i, (prompt, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"p{i}", prompt, sp)
    while engine.has_unfinished_requests:
        for event in engine.step():
            outputs.setdefault((event.request_id, event.index), []).append(event)
        check_invariants(engine.block_manager)
    assert sum(verified) > 20
    assert engine.scheduler.num_preemptions > 0  # rollbacks under block pressure too
    for i, out in enumerate(plain):
        for o in out.outputs:
            events = outputs[f"p{i}", o.index]
            assert [t for e in events for t in e.token_ids] == o.token_ids, (i, o.index)
            assert "".join(e.text for e in events) == o.text
            assert events[-1].finish_reason is o.finish_reason
    assert_pool_empty(llm)


# ---- the logits mask ----------------------------------------------------------------------


class AllowOnly:
    """A trivial mask: the same few tokens at every position; records what it accepted."""

    matcher = None  # no grammar: fill_next fills its row

    def __init__(self, allowed: list[int]):
        self.allowed = allowed
        self.accepted: list[int] = []

    def fill_next(self, bitmask: np.ndarray) -> None:
        bitmask[:] = 0
        for token in self.allowed:
            bitmask[token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))

    def accept(self, token_id: int) -> None:
        self.accepted.append(token_id)

    def forced(self) -> list[int]:
        return []  # it declares none: each token is sampled


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_mask_restricts_its_rows_and_no_other(tiny_llama, async_scheduling):
    llm = make_llm(tiny_llama, num_blocks=128, async_scheduling=async_scheduling)
    engine = llm.engine
    prompts = random_prompts(3, 400, seed=13, lo=5, hi=20)
    free = SamplingParams(max_tokens=10, seed=5, temperature=1.0, ignore_eos=True)
    want = llm.generate([prompts[2]], free)[0].outputs[0].token_ids

    masks: list[AllowOnly] = []

    def mask_of(allowed: list[int]):
        def make() -> AllowOnly:
            masks.append(AllowOnly(allowed))
            return masks[-1]

        return make

    engine.add_request("few", prompts[0], free, token_mask=mask_of([7, 300, 31, 32]))
    engine.add_request(
        "one", prompts[1], SamplingParams(max_tokens=10, **GREEDY), token_mask=mask_of([399])
    )
    engine.add_request("free", prompts[2], free)
    tokens: dict[str, list[int]] = {"few": [], "one": [], "free": []}
    while engine.has_unfinished_requests:
        for event in engine.step():
            tokens[event.request_id] += event.token_ids
    assert set(tokens["few"]) <= {7, 300, 31, 32} and len(tokens["few"]) == 10
    assert len(set(tokens["few"])) > 1  # sampled among them, not stuck on one
    assert tokens["one"] == [399] * 10
    assert tokens["free"] == want  # its neighbours' masks leave it as it was
    assert [m.accepted for m in masks] == [tokens["few"], tokens["one"]]
    assert_pool_empty(llm)


def test_unpack_bitmask_reads_bit_v_of_word_v_over_32():
    from engine.kernels.race import unpack_bitmask

    words = np.zeros((2, 2), dtype=np.int32)
    words[0, 0] = 1 << 3
    words[1, 1] = np.uint32(1 << 31).view(np.int32)  # the sign bit: token 63
    mask = unpack_bitmask(torch.from_numpy(words), 64)
    assert mask[0].nonzero().flatten().tolist() == [3]
    assert mask[1].nonzero().flatten().tolist() == [63]


class History(AllowOnly):
    """A mask that records, at each fill, how many tokens it had accepted."""

    def __init__(self, allowed: list[int]):
        super().__init__(allowed)
        self.seen_at_fill: list[int] = []

    def fill_next(self, bitmask: np.ndarray) -> None:
        self.seen_at_fill.append(len(self.accepted))
        super().fill_next(bitmask)


@pytest.mark.parametrize("fast_forward", [False, True])
def test_a_masked_step_reads_the_tokens_its_masks_follow_and_fills_them_beside_its_forward(
    tiny_llama, fast_forward
):
    """With async scheduling, a masked step t+1 reads step t's tokens back before its
    forward is queued, and its masks begin to fill right before the forward is queued
    (each from every token before its row); its sampling is queued at the next call,
    right before step t+2's forward. t's events come after t+1's forward, or, where a
    grammar may append the tokens it forces after t's (fast_forward), before t+1 is
    scheduled."""
    llm = make_llm(
        tiny_llama, num_blocks=128, async_scheduling=True, grammar_fast_forward=fast_forward
    )
    engine, runner = llm.engine, llm.engine.runner
    calls: list[str] = []
    for name in ("forward", "sample", "collect"):
        real = getattr(runner, name)

        def logged(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        setattr(runner, name, logged)
    real_append = engine._append_token

    def appended(*args, **kwargs):
        calls.append("event")
        return real_append(*args, **kwargs)

    engine._append_token = appended

    class Logged(History):
        def fill_next(self, bitmask: np.ndarray) -> None:
            calls.append("fill")
            super().fill_next(bitmask)

    mask = Logged([5, 6, 7])
    params = SamplingParams(max_tokens=8, **GREEDY)
    prompt = random_prompts(1, 400, seed=3, lo=6, hi=6)[0]
    engine.add_request("masked", prompt, params, 0, lambda: mask)
    tokens = []
    while engine.has_unfinished_requests:
        tokens += [t for e in engine.step() for t in e.token_ids]
    assert len(tokens) == 8 and set(tokens) <= {5, 6, 7}
    assert mask.seen_at_fill == list(range(8))  # each mask knew every token before it

    def at(name: str, k: int) -> int:  # where step k's call of `name` came
        return [i for i, c in enumerate(calls) if c == name][k]

    for k in range(7):  # 8 steps: each samples one token
        assert at("sample", k) < at("collect", k) < at("fill", k + 1), calls
        assert at("fill", k + 1) + 1 == at("forward", k + 1), calls
        if fast_forward:
            assert at("collect", k) < at("event", k) < at("fill", k + 1), calls
        else:
            assert at("forward", k + 1) < at("event", k) < at("sample", k + 1), calls
    assert_pool_empty(llm)


class Breaks(AllowOnly):
    """A mask whose fill raises from its third on."""

    fills = 0

    def fill_next(self, bitmask: np.ndarray) -> None:
        self.fills += 1
        if self.fills >= 3:
            raise RuntimeError("injected fill fault")
        super().fill_next(bitmask)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_fill_that_fails_ends_its_steps_requests_and_the_engine_goes_on(
    tiny_llama, async_scheduling
):
    """A fault filling a step's masks ends the requests of that step (with the fault
    named), not the engine: the next request runs."""
    llm = make_llm(tiny_llama, num_blocks=128, async_scheduling=async_scheduling)
    engine = llm.engine
    prompt = random_prompts(1, 400, seed=4, lo=6, hi=6)[0]
    engine.add_request(
        "masked", prompt, SamplingParams(max_tokens=8, **GREEDY), 0, lambda: Breaks([9])
    )
    ended = []
    for _ in range(20):
        if not engine.has_unfinished_requests:
            break
        ended += [e for e in engine.step() if e.finish_reason is not None]
    assert not engine.has_unfinished_requests
    assert [(e.request_id, e.finish_reason) for e in ended] == [("masked", FinishReason.ERROR)]
    assert "injected fill fault" in ended[0].error and ended[0].usage.completion_tokens == 2
    assert_pool_empty(llm)
    again = llm.generate([prompt], SamplingParams(max_tokens=4, **GREEDY))[0]
    assert len(again.outputs[0].token_ids) == 4


class GuessingProposer:
    """Proposes 0-3 tokens at random, from a small set so that some are right."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.guessed = 0

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        guesses = [self.rng.randrange(8) for _ in range(self.rng.randint(0, 3))][:max_tokens]
        self.guessed += len(guesses)
        return guesses


@pytest.mark.parametrize("propose", [False, True], ids=["plain", "proposals"])
@pytest.mark.parametrize("seed", range(6))
def test_a_storm_a_step_ahead_ends_every_request_and_keeps_every_mask(tiny_llama, seed, propose):
    """Requests of every sampling option (greedy or sampled, n up to 3, stop strings,
    min_tokens, logprobs, prompt logprobs, penalties, priorities), half of them masked,
    arrive and are cancelled at random while the device runs a step ahead and a small pool
    preempts: every request ends (a candidate 0 may end preempted, by a token in flight,
    and its later candidates still run: seed 3 without proposals ends one so), every
    masked token is one its mask allowed, each mask accepted exactly the tokens its
    candidate answered and was filled each time after every token before it, and no block
    is left held. With proposals (verified, mostly rolled back) too."""
    rng = random.Random(seed)
    caching = seed % 3 != 1
    llm = make_llm(tiny_llama, num_blocks=24, async_scheduling=True, enable_prefix_caching=caching)
    engine = llm.engine
    engine.proposer = GuessingProposer(seed) if propose else None
    masks: dict[tuple[str, int], History] = {}
    tokens: dict[tuple[str, int], list[int]] = {}

    def mask_for(request_id: str, allowed: list[int], n: int):
        count = iter(range(n))

        def make() -> History:
            mask = masks[request_id, next(count)] = History(allowed)
            return mask

        return make

    def step() -> None:
        for event in engine.step():
            tokens.setdefault((event.request_id, event.index), []).extend(event.token_ids)
        check_invariants(engine.block_manager)

    live: list[str] = []
    for t in range(120):
        if t < 60 and rng.random() < 0.4:
            options = {
                "max_tokens": rng.randint(1, 24),
                "n": rng.choice([1, 1, 2, 3]),
                "seed": t,
                "temperature": rng.choice([0.0, 1.0]),
                "stop": ["a", "e"] if rng.random() < 0.2 else [],
                "logprobs": rng.randint(0, 3) if rng.random() < 0.2 else None,
                "prompt_logprobs": rng.randint(0, 2) if rng.random() < 0.15 else None,
                "presence_penalty": 0.3 if rng.random() < 0.2 else 0.0,
            }
            mask = None
            if rng.random() < 0.5:  # (a mask and min_tokens may leave no token: not here)
                mask = mask_for(f"r{t}", rng.sample(range(400), rng.randint(1, 6)), options["n"])
            else:
                options["min_tokens"] = rng.randint(0, options["max_tokens"])
            prompt = [rng.randrange(400) for _ in range(rng.randint(2, 40))]
            params = SamplingParams(**options)
            engine.add_request(f"r{t}", prompt, params, rng.randint(0, 2), token_mask=mask)
            live.append(f"r{t}")
        if live and rng.random() < 0.1:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        step()
    for _ in range(1000):  # bounded: a request that can never run must fail the test
        if not engine.has_unfinished_requests:
            break
        step()
    assert not engine.has_unfinished_requests, "a request was left that never runs"
    assert engine.scheduler.num_preemptions > 0 and masks
    assert not propose or engine.proposer.guessed > 50
    for key, mask in masks.items():
        answered = tokens.get(key, [])
        assert set(answered) <= set(mask.allowed), key
        assert mask.accepted == answered, key
        assert mask.seen_at_fill == list(range(len(mask.seen_at_fill))), key
        assert len(mask.seen_at_fill) >= len(answered), key
    assert_pool_empty(llm)
