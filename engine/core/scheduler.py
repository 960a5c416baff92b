"""Iteration-level continuous batching under a token budget.

Each step takes, in this order, until the token budget (engine/core/step_budget.py:
max_num_batched_tokens, on the CPU no more than a step of target_step_seconds holds) or
the sequence cap (max_num_seqs) runs out: running decodes (one token, or one and its proposed
tokens), then running prefills chunked in an earlier step, both by priority; then waiting
sequences (new or preempted) by priority, FCFS among equals, from their longest cached
prefix, a request's later candidates once its first has the prompt computed or ended
(Sequence.waits_for_prompt). An admitted sequence holds a slot of the persistent batch
(engine/core/batch.py) until it is preempted or removed.

A chunk that needs KV blocks the pool does not have preempts the lowest-priority,
latest-arrived running sequence not scheduled this step (by recompute: its blocks are freed
and it waits to be prefilled again). Every sequence fits the pool on its own (checked at
admission), so the highest-priority one always progresses: no deadlock, no OOM.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.core.batch import SlotBook
from engine.core.request import Sequence, SequenceStatus
from engine.core.step_budget import StepBudget
from engine.kv.block_manager import BlockManager


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first token position computed in this step (== seq.num_computed_tokens)
    end: int  # one past the last position computed

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token gets sampled."""
        return self.end >= self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    budget: int = 0  # the tokens this step could take
    num_tokens: int = 0  # the tokens it takes (an unchunked prompt may take more)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        slots: SlotBook,
        target_step_seconds: float | None = None,
    ):
        self.config = config
        # The engine records each step's time in it (StepBudget.record).
        self.budget = StepBudget(config.max_num_batched_tokens, target_step_seconds)
        self.block_manager = block_manager
        self.slots = slots
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # sorted by Sequence.sort_key
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out (finished, cancelled, failed, or preempted); return its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.slots.release(seq.slot)
            seq.slot = None
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        # A sequence whose last token is still in flight may already have all it will get.
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for seq in self.running:  # one pass, in priority order: this runs every step
            uncomputed = seq.num_uncomputed_tokens
            if uncomputed > 0 and not seq.has_all_tokens:
                (decodes if uncomputed == 1 else prefills).append(seq)
        budget = self.budget.tokens(1 + len(seq.proposed) for seq in decodes)
        out = SchedulerOutput(budget=budget)
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = seq.num_uncomputed_tokens
            n = min(n + len(seq.proposed) if n == 1 else n, budget)
            if self._allocate_or_preempt(seq, n, out):
                self.slots.sync_blocks(seq.slot, seq.block_table.block_ids)
                start = seq.num_computed_tokens
                out.chunks.append(ScheduledChunk(seq, start, start + n))
                out.num_tokens += n
                budget -= n

        # Admitting while preempting would only thrash: wait for blocks to come back.
        for seq in list(self.waiting):
            if budget == 0 or out.preempted or len(self.running) >= self.config.max_num_seqs:
                break
            if seq.waits_for_prompt:
                continue
            if not seq.block_table.block_ids:
                self._match_prefix(seq)
            start, n = seq.num_computed_tokens, seq.num_uncomputed_tokens
            if n > budget and self.config.enable_chunked_prefill:
                n = budget
            needs_empty_step = n > budget and not out.is_empty  # an unchunked prompt runs whole
            if needs_empty_step or not self.block_manager.allocate(seq.block_table, start + n):
                # It waits holding no cached blocks: the running may need them.
                self.block_manager.free(seq.block_table)
                seq.num_computed_tokens = 0
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            timing = seq.request.timing  # its queue time ends here
            timing.first_scheduled = timing.first_scheduled or time.monotonic()
            assert len(seq.token_ids) == seq.num_tokens, "placed with tokens still in flight"
            seq.slot = self.slots.place(seq.token_ids, seq.block_table.block_ids)
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            out.chunks.append(ScheduledChunk(seq, start, start + n))
            out.num_tokens += n
            budget -= min(n, budget)  # an unchunked prompt may take more than is left
        return out

    def _allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Find blocks for seq's next n tokens, preempting others if needed. False if seq itself
        had to be preempted (nothing else could give way)."""
        while not self.block_manager.allocate(seq.block_table, seq.num_computed_tokens + n):
            spared = {chunk.seq for chunk in out.chunks} | {seq}
            victim = next((s for s in reversed(self.running) if s not in spared), seq)
            self.remove(victim)  # by recompute: it waits again, to start from its first token
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            self.num_preemptions += 1
            out.preempted.append(victim)
            self.add(victim)
            if victim is seq:
                return False
        return True

    def _match_prefix(self, seq: Sequence) -> None:
        if seq.index == 0 and seq.request.prompt_logprobs_pending:
            return  # every prompt position's logits are needed: compute them all
        seq.block_table, seq.num_computed_tokens = self.block_manager.match_prefix(seq.token_ids)
        if seq.num_preemptions == 0 and seq.index == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
