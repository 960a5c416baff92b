"""Runs one step on the model: a StepPlan of arrays -> forward -> logits -> samples.

The runner owns what lives on the device, the KV pool (layout: engine/attention/base.py)
and the persistent batch's tables (engine/core/batch.py), and knows nothing of requests.
forward() uploads a StepPlan's arrays in one asynchronous copy, applies its changes to the
tables, and replays a CUDA graph (a decode step) or runs the model eagerly; sample()
queues the sampler (under token masks, when given, filled meanwhile), which writes its
tokens into the token table: the next step can be queued before they reach the host.
collect() reads them back, a step's one host sync.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.core.batch import BatchChanges, DeviceBatch
from engine.core.cuda_graphs import CudaGraphRunner
from engine.core.sampler import Sampler, SamplingRows, prompt_logprobs
from engine.core.transfer import upload
from engine.model.config import ModelConfig
from engine.outputs import TokenLogprob

# A sequence computing a few tokens in one step (those a grammar forced, a proposer's
# guesses, a short prompt) runs in a CUDA graph as that many decode rows, each attending to
# its own prefix. Each row reads the sequence's KV again, where an eager step's prefill
# kernel reads it once: so at most this many rows, reading at most this many KV tokens.
MAX_GRAPH_ROWS_PER_SEQ = 16
MAX_GRAPH_ROWS_KV_READS = 65536


def _rows_fit_a_graph(rows: int | np.ndarray, seq_lens: int | np.ndarray) -> bool | np.ndarray:
    """Whether a sequence computing `rows` positions up to length seq_lens may replay a
    CUDA graph, by the limits above (one row always may); ints, or arrays elementwise."""
    return (rows <= MAX_GRAPH_ROWS_PER_SEQ) & (
        (rows == 1) | (rows * seq_lens <= MAX_GRAPH_ROWS_KV_READS)
    )


@dataclass
class StepPlan:
    """One step as plain arrays. Entry i of each [B] array is scheduled sequence i: it
    computes positions seq_lens[i] - query_lens[i] .. seq_lens[i] - 1 of slot slots[i]."""

    slots: np.ndarray  # int32 [B]
    query_lens: np.ndarray  # int32 [B]
    seq_lens: np.ndarray  # int32 [B]
    # How many of its last positions are sampled (position p's sample is token p + 1):
    # 0 in a middle chunk of a prefill, 1, or more to verify tokens a proposer wrote.
    num_samples: np.ndarray  # int32 [B]
    num_prompt_tokens: np.ndarray  # int32 [B]: where its output starts, for penalties
    # One row per sample, sequence after sequence; None on a tensor-parallel worker, which
    # runs the forward and leaves sampling to the driver.
    sampling: SamplingRows[np.ndarray] | None
    prompt_logprobs: dict[int, int]  # sequence -> alternatives, where its chunk's are wanted
    changes: BatchChanges  # written into the tables first


@dataclass
class StepOutput:
    token_ids: list[int]  # one per sampled row, in plan order
    logprobs: list[TokenLogprob | None]  # set where the row's params ask for logprobs
    # sequence -> logprobs of the prompt tokens its chunk predicts (from its first position + 1)
    prompt_logprobs: dict[int, list[TokenLogprob]]


@dataclass
class ForwardStep:
    """A step whose model forward is queued: its logits stay on the device for sample()."""

    logits: torch.Tensor | None  # the rows to read: sampled first, then prompt-predicting
    num_samples: int
    sampling: SamplingRows[torch.Tensor] | None  # the plan's, on the device
    targets: torch.Tensor  # where each sampled token goes in the token table
    spans: dict[int, tuple[int, int]]  # see _StepRows
    prompt_logprobs: dict[int, int]  # the plan's


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; ModelRunner.collect() reads it back."""

    logprob_counts: list[int | None]  # per sampled row, its params' logprobs
    # Host copies (pinned; filled asynchronously on CUDA) of the samples: token ids, then,
    # when a row asked for logprobs, the chosen logprobs, top ids and top logprobs; and per
    # sequence wanting prompt logprobs, the prompt ids its chunk predicts and prompt_logprobs'.
    host_outputs: list[torch.Tensor]
    prompt_outputs: dict[int, list[torch.Tensor]]
    copied: torch.cuda.Event | None  # recorded after the copies; None on the CPU


@dataclass
class _StepRows:
    """A step's rows as the model runs them."""

    uploads: list[np.ndarray]  # each row's slot and position [2, rows], then eager's metadata
    slots: np.ndarray  # int32, per sequence (a graph's: padded), for the attention plan
    seq_lens: np.ndarray  # int32, the same
    sample_slots: np.ndarray  # int64, per sampled row
    sample_ends: np.ndarray  # the position each sampled token goes to
    # sequence -> where in the token table the prompt tokens its chunk's rows predict start,
    # and how many (their logits follow the sampled rows', in this order)
    spans: dict[int, tuple[int, int]]


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """int64: starts[0] .. starts[0] + counts[0] - 1, then the same for every entry."""
    total = int(counts.sum())
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.repeat(starts.astype(np.int64), counts) + np.arange(total) - offsets


class PlanChannel(Protocol):
    """Where a tensor-parallel driver sends each step to the other ranks
    (engine/parallel/channel.py)."""

    def send_step(self, plan: StepPlan, tokens: torch.Tensor | None) -> None: ...


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        attn: AttentionBackend,
        num_slots: int,
        max_model_len: int,
        kv_dtype: torch.dtype | None = None,  # the KV pool's; None: dtype
    ):
        """Give it kv_caches (engine/kv/pool.py) before the first step."""
        self.model = model
        self.config = model_config
        self.device = device
        self.dtype = dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        self.block_size = block_size
        self.attn = attn
        # Positions 0 .. max_model_len: a sequence at the limit still writes its last token.
        self.token_width = max_model_len + 1
        self.block_width = -(-self.token_width // block_size)
        self.batch = DeviceBatch(num_slots, self.token_width, self.block_width, device)
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: CudaGraphRunner | None = None  # set by start-up, where graphs are used
        self.num_graph_steps = 0  # forwards that replayed a graph
        self.sampler = Sampler()
        # Under tensor parallelism, on the driver: how the other ranks hear each step's plan
        # (set by start-up once every rank is built).
        self.channel: PlanChannel | None = None
        self._unshared_targets: torch.Tensor | None = None  # the last sampled tokens' places

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> ForwardStep:
        """Queue a step's model forward on the device; sample() queues the rest."""
        if self.channel is not None:  # every rank runs the forward: the plan goes out first
            self.channel.send_step(plan, self._take_sampled_tokens())
        graph = self._replayable(plan)
        rows = self._graph_rows(plan) if graph else self._eager_rows(plan)
        self.num_graph_steps += graph
        history = self._penalty_history(plan, rows)
        targets = rows.sample_slots * self.token_width + rows.sample_ends
        sampling_arrays = plan.sampling.arrays() if plan.sampling is not None else []
        host = [*plan.changes, targets, *rows.uploads, *history, *sampling_arrays]
        uploaded = upload(host, self.device)
        self.batch.apply(uploaded[:4])
        targets_d, token_inputs = uploaded[4:6]
        rest = uploaded[5 + len(rows.uploads) :]
        num_samples = len(targets)
        if graph:  # the graph reads its inputs from the tables itself
            hidden = self.graphs.run(token_inputs, rows.slots, rows.seq_lens)
            if len(rows.uploads) > 1:  # a sequence ran as several rows: those sampled
                hidden = hidden[uploaded[6]]
            else:  # one row per sequence, each sampled, in order: no gather
                hidden = hidden[:num_samples]
        else:
            query_starts_d, seq_lens_d, logit_rows_d = uploaded[6:9]
            row_slots_d, positions_d = token_inputs
            input_ids, kv_slots = self.batch.inputs(row_slots_d, positions_d, self.block_size)
            meta = AttentionMetadata(
                slots=rows.slots,
                query_lens=plan.query_lens,
                seq_lens=rows.seq_lens,
                query_start_loc=query_starts_d,
                seq_lens_device=seq_lens_d,
                block_table=self.batch.block_table,
                slot_mapping=kv_slots,
                block_size=self.block_size,
            )
            self.attn.plan(meta)
            hidden = self.model(input_ids, positions_d, self.kv_caches, meta)[logit_rows_d]

        seen_ids = output_ids = None
        if history:  # the penalty rows' whole histories, and their outputs alone
            width, pad = int(history[2].max()), self.config.vocab_size
            seen_ids, output_ids = self.batch.history(*rest[:3], width, pad)
            rest = rest[3:]
        sampling = None
        if plan.sampling is not None:
            sampling = plan.sampling.on_device(rest, seen_ids, output_ids)
        # Every chunk a middle piece of a prefill: no row to read.
        logits = self.model.compute_logits(hidden) if len(hidden) else None
        return ForwardStep(
            logits, num_samples, sampling, targets_d, rows.spans, plan.prompt_logprobs
        )

    @torch.inference_mode()
    def sample(self, step: ForwardStep, allowed: np.ndarray | None = None) -> LaunchedStep:
        """Queue a forward step's sampling (under `allowed`, the rows' token masks, when
        given: sampling.allowed's layout), the tokens' writes, the prompt logprobs its
        chunks want, and the host copies of them all."""
        if step.logits is None:
            return LaunchedStep([], [torch.empty(0, dtype=torch.int64)], {}, None)
        sampling = step.sampling
        if allowed is not None:
            sampling = replace(sampling, allowed=upload([allowed], self.device)[0])
        counts, logits = sampling.logprob_counts, step.logits
        out = self.sampler(logits[: step.num_samples], sampling)
        self.batch.write_tokens(step.targets, out.token_ids)
        if self.channel is not None:  # the other ranks get them with the next step
            self._unshared_targets = step.targets
        outputs = [out.token_ids]
        if sampling.needs_logprobs:
            top_ids, top_lps = out.top_token_ids, out.top_logprobs
            if top_ids is None:  # no row asked for alternatives: empty [R, 0] tables
                top_ids = out.token_ids.new_empty((len(counts), 0))
                top_lps = out.logprobs.new_empty((len(counts), 0))
            outputs += [out.logprobs, top_ids, top_lps]
        prompt_outputs, offset = {}, step.num_samples
        for i, (first, count) in step.spans.items():
            # The prompt tokens they predict, from the token table (the host wrote them).
            ids = self.batch.token_ids.view(-1)[first : first + count].long()
            found = prompt_logprobs(logits[offset : offset + count], ids, step.prompt_logprobs[i])
            prompt_outputs[i] = [ids, *found]
            offset += count
        copied = None
        if self.device.type != "cpu":  # the copies land in pinned memory
            outputs = [t.to("cpu", non_blocking=True) for t in outputs]
            for i, found in prompt_outputs.items():
                prompt_outputs[i] = [t.to("cpu", non_blocking=True) for t in found]
            copied = torch.cuda.Event()
            copied.record()
        return LaunchedStep(counts, outputs, prompt_outputs, copied)

    def _eager_rows(self, plan: StepPlan) -> _StepRows:
        """Every position the step computes, as a flat row; the rows whose logits are read:
        each sequence's last num_samples, then the prompt-predicting rows of the chunks
        that want prompt logprobs."""
        query_starts = np.zeros(len(plan.slots) + 1, dtype=np.int32)
        np.cumsum(plan.query_lens, out=query_starts[1:])
        row_slots = np.repeat(plan.slots.astype(np.int64), plan.query_lens)
        positions = _ranges(plan.seq_lens - plan.query_lens, plan.query_lens)
        sampled = _ranges(query_starts[1:] - plan.num_samples, plan.num_samples)
        spans, prompt_rows = {}, [sampled]
        for i in plan.prompt_logprobs:  # the rows whose logits predict a *prompt* token
            start = int(plan.seq_lens[i] - plan.query_lens[i])
            count = max(0, min(int(plan.seq_lens[i]), int(plan.num_prompt_tokens[i]) - 1) - start)
            spans[i] = (int(plan.slots[i]) * self.token_width + start + 1, count)
            prompt_rows.append(np.arange(query_starts[i], query_starts[i] + count))
        logit_rows = np.concatenate(prompt_rows)
        uploads = [np.stack([row_slots, positions]), query_starts, plan.seq_lens, logit_rows]
        sample_slots, sample_ends = row_slots[sampled], positions[sampled] + 1
        return _StepRows(uploads, plan.slots, plan.seq_lens, sample_slots, sample_ends, spans)

    def _graph_rows(self, plan: StepPlan) -> _StepRows:
        """A decode step's rows, one per position it computes, padded to its graph's batch
        size with rows of the padding slot (position 0, length 1). A row's length ends at
        its position: the rows of one sequence attend as a causal chunk does. Built
        directly: this runs for every decode step, and at batch 1 its host time is the
        step's."""
        batch, num_rows = len(plan.slots), int(plan.query_lens.sum())
        size = self.graphs.batch_size_for(num_rows)
        token_inputs = np.zeros((2, size), dtype=np.int64)  # each row's slot and position
        token_inputs[0] = self.batch.padding_slot
        seq_lens = np.ones(size, dtype=np.int32)
        uploads = [token_inputs]
        if num_rows == batch:  # one row per sequence, the one it samples
            token_inputs[0, :batch] = plan.slots
            token_inputs[1, :batch] = plan.seq_lens - 1
            seq_lens[:batch] = plan.seq_lens
            sample_slots, sample_ends = token_inputs[0, :batch], plan.seq_lens
        else:
            token_inputs[0, :num_rows] = np.repeat(plan.slots, plan.query_lens)
            token_inputs[1, :num_rows] = _ranges(plan.seq_lens - plan.query_lens, plan.query_lens)
            seq_lens[:num_rows] = token_inputs[1, :num_rows] + 1
            sampled = _ranges(np.cumsum(plan.query_lens) - plan.num_samples, plan.num_samples)
            uploads.append(sampled)
            sample_slots, sample_ends = token_inputs[0, sampled], seq_lens[sampled]
        slots = token_inputs[0].astype(np.int32)
        return _StepRows(uploads, slots, seq_lens, sample_slots, sample_ends, {})

    def collect(self, launched: LaunchedStep) -> StepOutput:
        """Wait for a launched step and read its results back."""
        if launched.copied is not None:
            launched.copied.synchronize()  # the one host sync of a step
        token_ids, *logprob_outputs = (t.tolist() for t in launched.host_outputs)
        chosen, top_ids, top_lps = logprob_outputs or (None, None, None)
        logprobs = []
        for i, k in enumerate(launched.logprob_counts):
            top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k is not None else None
            logprobs.append(TokenLogprob(token_ids[i], chosen[i], top) if k is not None else None)
        prompt = {}  # the same, per sequence wanting prompt logprobs, for its prompt tokens
        for i, found in launched.prompt_outputs.items():
            ids, chosen, top_ids, top_lps = (t.tolist() for t in found)
            prompt[i] = [
                TokenLogprob(token, logprob, list(zip(top, top_values)))
                for token, logprob, top, top_values in zip(ids, chosen, top_ids, top_lps)
            ]
        return StepOutput(token_ids, logprobs, prompt)

    def _penalty_history(self, plan: StepPlan, rows: _StepRows) -> list[np.ndarray]:
        """Where the penalty rows' token histories are: their slots, the start of their
        output and the position they predict (their history ends before it)."""
        penalised = plan.sampling.penalty_rows if plan.sampling is not None else None
        if penalised is None:
            return []
        owners = np.repeat(np.arange(len(plan.slots)), plan.num_samples)[penalised]
        starts = plan.num_prompt_tokens[owners].astype(np.int64)
        return [rows.sample_slots[penalised], starts, rows.sample_ends[penalised]]

    def _take_sampled_tokens(self) -> torch.Tensor | None:
        """The tokens sample() wrote since the last forward (int32, from the token table,
        read after the sampler in stream order); None when it wrote none."""
        targets, self._unshared_targets = self._unshared_targets, None
        return None if targets is None else self.batch.token_ids.view(-1)[targets]

    @property
    def max_graph_rows(self) -> int | None:
        """The rows of the largest CUDA graph; None where every step runs eagerly."""
        return None if self.graphs is None else self.graphs.max_batch_size

    def graph_room(self, num_tokens: int) -> int:
        """How many tokens may be appended to a sequence of num_tokens tokens (its last one
        not yet computed) with its next step still fit for a CUDA graph, by the limits on
        one sequence's rows (MAX_GRAPH_ROWS_PER_SEQ, MAX_GRAPH_ROWS_KV_READS)."""
        room = MAX_GRAPH_ROWS_PER_SEQ - 1
        while not _rows_fit_a_graph(room + 1, num_tokens + room):
            room -= 1
        return room

    def _replayable(self, plan: StepPlan) -> bool:
        """A CUDA graph can run the step: every sequence sampling, at the end of a few
        positions (MAX_GRAPH_ROWS_PER_SEQ, MAX_GRAPH_ROWS_KV_READS; no middle piece of a
        prefill, no prompt logprobs), and no more rows in all than the largest graph."""
        if self.graphs is None or plan.prompt_logprobs or not (plan.num_samples >= 1).all():
            return False
        return int(plan.query_lens.sum()) <= self.graphs.max_batch_size and bool(
            _rows_fit_a_graph(plan.query_lens, plan.seq_lens).all()
        )
