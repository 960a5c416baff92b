"""Runs one scheduled step on the model: flat varlen inputs -> forward -> logits -> samples.

The runner owns the KV pool (one tensor per layer, layout in engine/attention/base.py)
and knows nothing of requests beyond what a step hands it: chunks of token ids with
their block tables, and the rows to sample.

A step builds its inputs as host arrays, moves them to the device in one asynchronous
copy, then either replays a CUDA graph (a pure-decode step on CUDA, engine/cuda_graphs.py)
or plans attention once and runs the model eagerly. execute() only queues that work and
returns a LaunchedStep; collect() waits for it and reads the samples back: on CUDA the one
host sync of a step, which the engine can put after queueing the next step.

A step may compute a token the host has not read back yet (the last token of a sequence,
sampled by the step before, still in flight): its id is copied on the device from that
step's samples (PendingTokens) after the upload.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.flashinfer_backend import FlashInferAttention
from engine.cuda_graphs import CudaGraphRunner, DecodeInputs, graph_batch_sizes
from engine.errors import ValidationError
from engine.model.config import ModelConfig
from engine.outputs import TokenLogprob
from engine.sampler import Sampler, SamplingTensors, prompt_logprobs
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.scheduler import ScheduledChunk


@dataclass
class SampleRow:
    """One token to draw from the logits of a chunk's last position."""

    chunk_index: int
    params: SamplingParams
    seed: int
    num_sampled: int  # output tokens sampled before this one: the row's random counter
    # The token history, which only penalties read: empty for rows without one.
    prompt_ids: tuple[int, ...]  # the request's prompt_token_ids
    output_ids: list[int]  # complete whenever the row uses a penalty
    banned_ids: list[int]  # e.g. EOS and stop token ids while below min_tokens


@dataclass
class SampledToken:
    token_id: int
    logprob: TokenLogprob | None  # set when the row's params ask for logprobs


@dataclass
class StepResult:
    sampled: list[SampledToken]  # one per SampleRow, same order
    # chunk index -> logprobs of the prompt tokens that chunk predicts (positions start+1 .. )
    prompt_logprobs: dict[int, list[TokenLogprob]]


@dataclass
class PendingTokens:
    """Input tokens only the device has yet: sampled by the step still in flight."""

    token_ids: torch.Tensor  # int64 [R]: that step's samples, on the device
    rows: dict[int, int]  # chunk index -> row of token_ids that is the chunk's last token


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device; ModelRunner.collect() reads it back."""

    rows: list[SampleRow]
    token_ids: torch.Tensor  # int64 [R] on the device: the next step's PendingTokens
    # Host copies of the samples (pinned; being filled asynchronously on CUDA): token ids,
    # then, when a row asked for logprobs, the chosen logprobs, top ids and top logprobs.
    host_outputs: list[torch.Tensor]
    copied: torch.cuda.Event | None  # recorded after the copies; None on the CPU
    prompt_logprobs: dict[int, list[TokenLogprob]]  # already on the host (rarely asked for)


@dataclass
class StepInputs:
    """A step's flat varlen batch on the host (layout in engine/attention/base.py)."""

    input_ids: list[int]  # [T]; 0 where the token is pending (filled on the device)
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    query_lens: list[int]  # [B]
    seq_lens: list[int]  # [B]
    block_tables: list[list[int]]  # [B], each the blocks holding that sequence's seq_len tokens
    pending_at: list[int]  # flat rows whose token is pending ...
    pending_from: list[int]  # ... and the rows of PendingTokens.token_ids holding them

    @property
    def query_starts(self) -> list[int]:  # [B + 1]
        return list(itertools.accumulate(self.query_lens, initial=0))

    def as_decode(self) -> DecodeInputs:
        assert len(self.input_ids) == len(self.query_lens), "one new token per sequence"
        return DecodeInputs(
            self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables
        )


_TORCH_DTYPES = {
    np.dtype(np.int32): torch.int32,
    np.dtype(np.int64): torch.int64,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host arrays as tensors on `device`. On CUDA all of them travel in one asynchronous
    copy from one pinned buffer: each separate copy would cost a launch, and a copy from
    unpinned memory waits for every kernel queued before it."""
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        # Every part starts 16-byte aligned: Triton specializes a kernel on whether each
        # pointer is, so parts that shifted with the batch size would recompile kernels.
        total += -(-a.nbytes // 16) * 16
    staging = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    staging_bytes = staging.numpy()
    for a, offset in zip(arrays, offsets, strict=True):
        staging_bytes[offset : offset + a.nbytes] = (
            np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        )
    on_device = staging.to(device, non_blocking=True)
    return [
        on_device[offset : offset + a.nbytes].view(_TORCH_DTYPES[a.dtype]).view(a.shape)
        for a, offset in zip(arrays, offsets, strict=True)
    ]


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * config.num_kv_heads * config.head_dim * element_size
    return config.num_layers * per_layer


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        attn: AttentionBackend,
    ):
        """Call allocate_kv_cache() before the first step (on CUDA after fit_kv_blocks())."""
        self.model = model
        self.config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.attn = attn
        self.num_blocks = 0
        self.kv_caches: list[torch.Tensor] = []
        self.graphs: CudaGraphRunner | None = None  # set by capture_cuda_graphs()
        self.sampler = Sampler()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        cfg = self.config
        shape = (num_blocks, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)
        ]

    def fit_kv_blocks(
        self,
        gpu_memory_utilization: float,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        graph_reserve: int,
    ) -> int:
        """How many KV blocks fit in gpu_memory_utilization of the GPU's memory, beside what
        the weights, the peak of the largest step (run here once), other users of the GPU
        (CUDA context, other processes) and the CUDA graphs (graph_reserve bytes) take."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_largest_step(max_num_batched_tokens, max_num_seqs)
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = total - free - torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        budget = total * gpu_memory_utilization - outside_torch - peak - graph_reserve
        num_blocks = int(budget // kv_bytes_per_block(self.config, self.block_size, self.dtype))
        if num_blocks < 1:
            gib = 2**30
            raise ValidationError(
                "gpu_memory_utilization",
                f"{gpu_memory_utilization} of {total / gib:.1f} GiB leaves no room for the KV "
                f"cache: the weights and a {max_num_batched_tokens}-token step peak at "
                f"{peak / gib:.2f} GiB, {outside_torch / gib:.2f} GiB is in use outside torch "
                f"and {graph_reserve / gib:.2f} GiB is kept for CUDA graphs",
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_largest_step(self, num_tokens: int, num_seqs: int) -> None:
        """The memory peak of the largest step the scheduler can make: num_tokens of prompt
        with logits for every row (prompt logprobs), then a sample of num_seqs rows using
        every sampling feature. It writes no KV (slot -1) and every sequence reads block 0
        of a one-block pool over and over: only the memory use is of interest."""
        cfg, bs = self.config, self.block_size
        limit = cfg.max_position_embeddings  # positions index the rope cache
        lens = [min(limit, num_tokens - start) for start in range(0, num_tokens, limit)]
        shape = (1, 2, bs, cfg.num_kv_heads, cfg.head_dim)
        kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)
        ]
        step = StepInputs(
            input_ids=[0] * num_tokens,
            positions=[p for n in lens for p in range(n)],
            slot_mapping=[-1] * num_tokens,
            query_lens=lens,
            seq_lens=lens,
            block_tables=[[0] * -(-n // bs) for n in lens],
            pending_at=[],
            pending_from=[],
        )
        token_inputs, query_starts, seq_lens = upload(self._step_arrays(step, None), self.device)
        meta = self._eager_metadata(step, token_inputs[2], query_starts, seq_lens)
        self.attn.plan(meta)
        hidden = self.model(token_inputs[0], token_inputs[1], kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        prompt_logprobs(logits, token_inputs[0], MAX_LOGPROBS)
        del logits
        params = SamplingParams(
            temperature=1.0,
            top_k=50,
            top_p=0.9,
            min_p=0.05,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logprobs=MAX_LOGPROBS,
        )
        # Short token histories: their [rows, history] tensors are small beside the
        # [rows, vocab] ones.
        rows = [SampleRow(0, params, 0, 16, (1,) * 16, [2] * 16, [3]) for _ in range(num_seqs)]
        tensors = self._sampling_tensors(rows)
        picked, *sampling = upload(
            [np.arange(num_seqs, dtype=np.int64) % num_tokens, *_tensor_arrays(tensors)],
            self.device,
        )
        logits = self.model.compute_logits(hidden[picked])
        self.sampler(logits, _with_tensors(tensors, sampling))

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode graphs (CUDA, flashinfer); call after allocate_kv_cache()."""
        assert isinstance(self.attn, FlashInferAttention), "CUDA graphs need flashinfer"
        self.graphs = CudaGraphRunner(
            self.model,
            self.attn,
            self.kv_caches,
            self.block_size,
            graph_batch_sizes(max_num_seqs),
            max_blocks_per_seq=-(-max_model_len // self.block_size),
            hidden_size=self.config.hidden_size,
            dtype=self.dtype,
        )

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (src -> dst) in every layer: copy-on-write for forked candidates."""
        if not pairs:
            return
        src, dst = upload(
            [np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])], self.device
        )
        for cache in self.kv_caches:
            cache[dst] = cache[src]

    @torch.inference_mode()
    def execute(
        self,
        chunks: list[ScheduledChunk],
        sample_rows: list[SampleRow],
        prompt_logprob_chunks: dict[int, int],  # chunk index -> number of top alternatives
        pending: PendingTokens | None = None,
    ) -> LaunchedStep:
        """Queue a step's work on the device; collect() waits for it and reads it back."""
        step = self._flatten(chunks, pending.rows if pending is not None else {})
        # Only rows whose logits are used go through the LM head.
        row_starts = step.query_starts
        logit_rows = [row_starts[r.chunk_index + 1] - 1 for r in sample_rows]
        prompt_spans = {
            i: self._prompt_prediction_span(chunks[i], row_starts[i]) for i in prompt_logprob_chunks
        }
        for first, count in prompt_spans.values():
            logit_rows.extend(range(first, first + count))
        decode = None
        if self._replayable(step):
            decode = step.as_decode().padded(self.graphs.batch_size_for(len(step.query_lens)))
        tensors = self._sampling_tensors(sample_rows)

        # Everything the step reads from the host, in one copy.
        token_inputs, query_starts, seq_lens, pending_at, pending_from, rows, *sampling = upload(
            [
                *self._step_arrays(step, decode),
                np.array(step.pending_at, dtype=np.int64),
                np.array(step.pending_from, dtype=np.int64),
                np.array(logit_rows, dtype=np.int64),
                *_tensor_arrays(tensors),
            ],
            self.device,
        )
        if step.pending_at:
            token_inputs[0].index_copy_(0, pending_at, pending.token_ids[pending_from])
        if decode is not None:
            hidden = self.graphs.run(token_inputs, decode.seq_lens, decode.block_tables)
        else:
            meta = self._eager_metadata(step, token_inputs[2], query_starts, seq_lens)
            self.attn.plan(meta)
            hidden = self.model(token_inputs[0], token_inputs[1], self.kv_caches, meta)

        if not logit_rows:  # every chunk is a middle piece of a prefill: nothing to read out
            return self._nothing_sampled()
        logits = self.model.compute_logits(hidden[rows])
        num_samples = len(sample_rows)
        launched = self._sample(logits[:num_samples], sample_rows, _with_tensors(tensors, sampling))
        offset = num_samples
        for i, k in prompt_logprob_chunks.items():
            first, count = prompt_spans[i]
            chunk = chunks[i]
            targets = chunk.seq.token_ids[chunk.start + 1 : chunk.start + 1 + count]
            (targets_on_device,) = upload([np.array(targets, dtype=np.int64)], self.device)
            launched.prompt_logprobs[i] = _to_token_logprobs(
                *prompt_logprobs(logits[offset : offset + count], targets_on_device, k), targets
            )
            offset += count
        return launched

    def collect(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step and read its results back."""
        if launched.copied is not None:
            launched.copied.synchronize()  # the one host sync of a step
        token_ids, *logprob_outputs = (t.tolist() for t in launched.host_outputs)
        chosen, top_ids, top_lps = logprob_outputs or (None, None, None)
        sampled = []
        for i, row in enumerate(launched.rows):
            k = row.params.logprobs
            logprob = None
            if k is not None:
                top = list(zip(top_ids[i][:k], top_lps[i][:k]))
                logprob = TokenLogprob(token_ids[i], chosen[i], top)
            sampled.append(SampledToken(token_ids[i], logprob))
        return StepResult(sampled, launched.prompt_logprobs)

    def _prompt_prediction_span(self, chunk: ScheduledChunk, row_start: int) -> tuple[int, int]:
        """Rows of a chunk whose logits predict the next *prompt* token (not the first output)."""
        last_predicting = min(chunk.end, chunk.seq.num_prompt_tokens - 1)
        return row_start, max(0, last_predicting - chunk.start)

    def _flatten(self, chunks: list[ScheduledChunk], pending_rows: dict[int, int]) -> StepInputs:
        # Runs for every sequence of every step: plain loops, a short path for decodes.
        bs = self.block_size
        step = StepInputs([], [], [], [], [], [], [], [])
        for i, c in enumerate(chunks):
            seq, start, end = c.seq, c.start, c.end
            blocks = seq.block_table.block_ids
            known = seq.token_ids[start:end]
            if len(known) < end - start:  # the last one is still in flight
                assert len(known) == end - start - 1, "only a sequence's last token is pending"
                step.pending_at.append(len(step.input_ids) + len(known))
                step.pending_from.append(pending_rows[i])
                known.append(0)
            step.input_ids += known
            if end - start == 1:
                step.positions.append(start)
                step.slot_mapping.append(blocks[start // bs] * bs + start % bs)
            else:
                step.positions += range(start, end)
                step.slot_mapping += [blocks[p // bs] * bs + p % bs for p in range(start, end)]
            step.query_lens.append(end - start)
            step.seq_lens.append(end)
            num_pages = (end + bs - 1) // bs
            step.block_tables.append(blocks if len(blocks) == num_pages else blocks[:num_pages])
        return step

    def _replayable(self, step: StepInputs) -> bool:
        """A CUDA graph can run the step: pure decode, and no more rows than the largest."""
        return (
            self.graphs is not None
            and len(step.query_lens) <= self.graphs.max_batch_size
            and len(step.input_ids) == len(step.query_lens)  # every sequence adds one token
        )

    @staticmethod
    def _step_arrays(step: StepInputs, decode: DecodeInputs | None) -> list[np.ndarray]:
        """[3, T] token ids, positions and slots (a CUDA graph's padded batch when decode is
        given), query start offsets and sequence lengths, as host arrays."""
        tokens = decode if decode is not None else step
        return [
            np.array([tokens.input_ids, tokens.positions, tokens.slot_mapping], dtype=np.int64),
            np.array(step.query_starts, dtype=np.int32),
            np.array(step.seq_lens, dtype=np.int32),
        ]

    def _eager_metadata(
        self,
        step: StepInputs,
        slot_mapping: torch.Tensor,
        query_starts: torch.Tensor,
        seq_lens: torch.Tensor,
    ) -> AttentionMetadata:
        # The padded [B, max_blocks] table only the torch backend reads (the CPU path).
        block_tables = None
        if self.device.type == "cpu":
            width = max(len(t) for t in step.block_tables)
            padded = [t + [0] * (width - len(t)) for t in step.block_tables]
            block_tables = torch.tensor(padded, dtype=torch.int32)
        return AttentionMetadata(
            query_start_loc=query_starts,
            seq_lens=seq_lens,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            query_lens_cpu=step.query_lens,
            seq_lens_cpu=step.seq_lens,
            block_size=self.block_size,
            block_tables_cpu=step.block_tables,
        )

    def _sampling_tensors(self, rows: list[SampleRow]) -> SamplingTensors:
        """The rows' sampling parameters as host tensors."""
        return SamplingTensors.from_rows(
            params=[r.params for r in rows],
            seeds=[r.seed for r in rows],
            counters=[r.num_sampled for r in rows],
            prompt_ids=[r.prompt_ids for r in rows],
            output_ids=[r.output_ids for r in rows],
            banned_ids=[r.banned_ids for r in rows],
            vocab_size=self.config.vocab_size,
            device="cpu",
        )

    def _sample(
        self, logits: torch.Tensor, rows: list[SampleRow], tensors: SamplingTensors
    ) -> LaunchedStep:
        """Queue the sampling and the copies of its results to the host."""
        if not rows:
            return self._nothing_sampled()
        out = self.sampler(logits, tensors)
        outputs = [out.token_ids]
        if tensors.needs_logprobs:
            top_ids, top_lps = out.top_token_ids, out.top_logprobs
            if top_ids is None:  # no row asked for alternatives: empty [R, 0] tables
                top_ids = out.token_ids.new_empty((len(rows), 0))
                top_lps = out.logprobs.new_empty((len(rows), 0))
            outputs += [out.logprobs, top_ids, top_lps]
        if self.device.type == "cpu":
            return LaunchedStep(rows, out.token_ids, outputs, None, {})
        host_outputs = [t.to("cpu", non_blocking=True) for t in outputs]  # lands in pinned memory
        copied = torch.cuda.Event()
        copied.record()
        return LaunchedStep(rows, out.token_ids, host_outputs, copied, {})

    def _nothing_sampled(self) -> LaunchedStep:
        no_ids = torch.empty(0, dtype=torch.int64, device=self.device)
        return LaunchedStep([], no_ids, [torch.empty(0, dtype=torch.int64)], None, {})


# SamplingTensors' fields that hold tensors (or None when unused), in field order.
_SAMPLING_TENSOR_FIELDS = tuple(
    f.name for f in dataclasses.fields(SamplingTensors) if "Tensor" in str(f.type)
)


def _tensor_arrays(tensors: SamplingTensors) -> list[np.ndarray]:
    """The tensors of host SamplingTensors as arrays, in field order (for upload())."""
    values = (getattr(tensors, name) for name in _SAMPLING_TENSOR_FIELDS)
    return [value.numpy() for value in values if value is not None]


def _with_tensors(tensors: SamplingTensors, moved: list[torch.Tensor]) -> SamplingTensors:
    """`tensors` with its tensors replaced by `moved`, in _tensor_arrays order."""
    present = [n for n in _SAMPLING_TENSOR_FIELDS if getattr(tensors, n) is not None]
    return dataclasses.replace(tensors, **dict(zip(present, moved, strict=True)))


def _to_token_logprobs(
    chosen: torch.Tensor, top_ids: torch.Tensor, top_lps: torch.Tensor, targets: Sequence[int]
) -> list[TokenLogprob]:
    chosen_l, ids_l, lps_l = chosen.tolist(), top_ids.tolist(), top_lps.tolist()
    return [
        TokenLogprob(t, chosen_l[j], list(zip(ids_l[j], lps_l[j]))) for j, t in enumerate(targets)
    ]
