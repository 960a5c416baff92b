"""Runs one scheduled step on the model: flat varlen inputs -> forward -> logits -> samples.

The runner owns the KV pool (one tensor per layer, layout in engine/attention/base.py)
and knows nothing of requests beyond what a step hands it: chunks of token ids with
their block tables, and the rows to sample.

A step builds its inputs as host lists, then either replays a CUDA graph (a pure-decode
step on CUDA, engine/cuda_graphs.py) or moves them to the device, plans attention once
and runs the model eagerly. On CUDA the host tensors are pinned and every copy to the
device is asynchronous: the only host sync of a step is reading the sampled token ids.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

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
    prompt_ids: list[int]
    output_ids: list[int]
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
class StepInputs:
    """A step's flat varlen batch on the host (layout in engine/attention/base.py)."""

    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    query_lens: list[int]  # [B]
    seq_lens: list[int]  # [B]
    block_tables: list[list[int]]  # [B], each the blocks holding that sequence's seq_len tokens

    @property
    def query_starts(self) -> list[int]:  # [B + 1]
        return list(itertools.accumulate(self.query_lens, initial=0))

    def as_decode(self) -> DecodeInputs:
        assert len(self.input_ids) == len(self.query_lens), "one new token per sequence"
        return DecodeInputs(
            self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables
        )


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
        )
        input_ids, positions, meta = self._to_device(step)
        self.attn.plan(meta)
        hidden = self.model(input_ids, positions, kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        prompt_logprobs(logits, input_ids, MAX_LOGPROBS)
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
        rows = [SampleRow(0, params, 0, [1] * 16, [2] * 16, [3]) for _ in range(num_seqs)]
        picked = self._upload([i % num_tokens for i in range(num_seqs)], torch.long)
        self._sample(self.model.compute_logits(hidden[picked]), rows)

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
        src = self._upload([p[0] for p in pairs], torch.long)
        dst = self._upload([p[1] for p in pairs], torch.long)
        for cache in self.kv_caches:
            cache[dst] = cache[src]

    @torch.inference_mode()
    def execute(
        self,
        chunks: list[ScheduledChunk],
        sample_rows: list[SampleRow],
        prompt_logprob_chunks: dict[int, int],  # chunk index -> number of top alternatives
    ) -> StepResult:
        step = self._flatten(chunks)
        if self._replayable(step):
            hidden = self.graphs.run(step.as_decode())
        else:
            input_ids, positions, meta = self._to_device(step)
            self.attn.plan(meta)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)

        # Only rows whose logits are used go through the LM head.
        row_starts = step.query_starts
        sample_positions = [row_starts[r.chunk_index + 1] - 1 for r in sample_rows]
        prompt_spans = {
            i: self._prompt_prediction_span(chunks[i], row_starts[i]) for i in prompt_logprob_chunks
        }
        rows = list(sample_positions)
        for first, count in prompt_spans.values():
            rows.extend(range(first, first + count))
        if not rows:  # every chunk is a middle piece of a prefill: nothing to read out
            return StepResult([], {})
        logits = self.model.compute_logits(hidden[self._upload(rows, torch.long)])

        sampled = self._sample(logits[: len(sample_rows)], sample_rows)
        result_prompt: dict[int, list[TokenLogprob]] = {}
        offset = len(sample_rows)
        for i, k in prompt_logprob_chunks.items():
            first, count = prompt_spans[i]
            chunk = chunks[i]
            targets = chunk.seq.token_ids[chunk.start + 1 : chunk.start + 1 + count]
            result_prompt[i] = _to_token_logprobs(
                *prompt_logprobs(
                    logits[offset : offset + count], self._upload(targets, torch.long), k
                ),
                targets,
            )
            offset += count
        return StepResult(sampled, result_prompt)

    def _prompt_prediction_span(self, chunk: ScheduledChunk, row_start: int) -> tuple[int, int]:
        """Rows of a chunk whose logits predict the next *prompt* token (not the first output)."""
        last_predicting = min(chunk.end, chunk.seq.num_prompt_tokens - 1)
        return row_start, max(0, last_predicting - chunk.start)

    def _flatten(self, chunks: list[ScheduledChunk]) -> StepInputs:
        bs = self.block_size
        step = StepInputs([], [], [], [], [], [])
        for c in chunks:
            blocks = c.seq.block_table.block_ids
            step.input_ids.extend(c.seq.token_ids[c.start : c.end])
            step.positions.extend(range(c.start, c.end))
            step.slot_mapping.extend(blocks[p // bs] * bs + p % bs for p in range(c.start, c.end))
            step.query_lens.append(c.num_tokens)
            step.seq_lens.append(c.end)
            step.block_tables.append(blocks[: (c.end + bs - 1) // bs])
        return step

    def _replayable(self, step: StepInputs) -> bool:
        """A CUDA graph can run the step: pure decode, and no more rows than the largest."""
        return (
            self.graphs is not None
            and len(step.query_lens) <= self.graphs.max_batch_size
            and len(step.input_ids) == len(step.query_lens)  # every sequence adds one token
        )

    def _to_device(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        # The padded [B, max_blocks] table only the torch backend reads (the CPU path).
        block_tables = None
        if self.device.type == "cpu":
            width = max(len(t) for t in step.block_tables)
            padded = [t + [0] * (width - len(t)) for t in step.block_tables]
            block_tables = torch.tensor(padded, dtype=torch.int32)
        meta = AttentionMetadata(
            query_start_loc=self._upload(step.query_starts, torch.int32),
            seq_lens=self._upload(step.seq_lens, torch.int32),
            block_tables=block_tables,
            slot_mapping=self._upload(step.slot_mapping, torch.int64),
            query_lens_cpu=step.query_lens,
            seq_lens_cpu=step.seq_lens,
            block_size=self.block_size,
            block_tables_cpu=step.block_tables,
        )
        return (
            self._upload(step.input_ids, torch.int64),
            self._upload(step.positions, torch.int64),
            meta,
        )

    def _upload(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        """A host list as a device tensor, without a host sync: on CUDA it is staged in
        pinned memory and copied asynchronously (a plain torch.tensor(..., device="cuda")
        waits for every kernel queued before it)."""
        if self.device.type == "cpu":
            return torch.tensor(values, dtype=dtype)
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
        return host.to(self.device, non_blocking=True)

    def _upload_sampling(self, tensors: SamplingTensors) -> SamplingTensors:
        """SamplingTensors built on the host, moved to the device as _upload does."""
        moved = {}
        for f in dataclasses.fields(tensors):
            value = getattr(tensors, f.name)
            if isinstance(value, torch.Tensor):
                moved[f.name] = value.pin_memory().to(self.device, non_blocking=True)
        return dataclasses.replace(tensors, **moved)

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
        if not rows:
            return []
        on_cpu = self.device.type == "cpu"
        tensors = SamplingTensors.from_rows(
            params=[r.params for r in rows],
            seeds=[r.seed for r in rows],
            prompt_ids=[r.prompt_ids for r in rows],
            output_ids=[r.output_ids for r in rows],
            banned_ids=[r.banned_ids for r in rows],
            vocab_size=logits.shape[-1],
            device=self.device if on_cpu else "cpu",
        )
        out = self.sampler(logits, tensors if on_cpu else self._upload_sampling(tensors))
        token_ids = out.token_ids.tolist()  # the one host sync of a step
        chosen = out.logprobs.tolist()
        top_ids = out.top_token_ids.tolist() if out.top_token_ids is not None else None
        top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        sampled = []
        for i, row in enumerate(rows):
            k = row.params.logprobs
            logprob = None
            if k is not None:
                top = list(zip(top_ids[i][:k], top_lps[i][:k])) if top_ids is not None else []
                logprob = TokenLogprob(token_ids[i], chosen[i], top)
            sampled.append(SampledToken(token_ids[i], logprob))
        return sampled


def _to_token_logprobs(
    chosen: torch.Tensor, top_ids: torch.Tensor, top_lps: torch.Tensor, targets: list[int]
) -> list[TokenLogprob]:
    chosen_l, ids_l, lps_l = chosen.tolist(), top_ids.tolist(), top_lps.tolist()
    return [
        TokenLogprob(t, chosen_l[j], list(zip(ids_l[j], lps_l[j]))) for j, t in enumerate(targets)
    ]
