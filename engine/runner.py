"""Runs one scheduled step on the model: flat varlen inputs -> forward -> logits -> samples.

The runner owns the KV pool (one tensor per layer, layout in engine/attention/base.py)
and knows nothing of requests beyond what a step hands it: chunks of token ids with
their block tables, and the rows to sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata
from engine.model.config import ModelConfig
from engine.outputs import TokenLogprob
from engine.sampler import Sampler, SamplingTensors, prompt_logprobs
from engine.sampling_params import SamplingParams
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


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element_size = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * config.num_kv_heads * config.head_dim * element_size
    return config.num_layers * per_layer


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        self.model = model
        self.config = model_config
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, 2, block_size, model_config.num_kv_heads, model_config.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(model_config.num_layers)
        ]
        self.sampler = Sampler()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (src -> dst) in every layer: copy-on-write for forked candidates."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for cache in self.kv_caches:
            cache[dst] = cache[src]

    @torch.inference_mode()
    def execute(
        self,
        chunks: list[ScheduledChunk],
        sample_rows: list[SampleRow],
        prompt_logprob_chunks: dict[int, int],  # chunk index -> number of top alternatives
    ) -> StepResult:
        input_ids, positions, meta = self._prepare_inputs(chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)

        # Only rows whose logits are used go through the LM head.
        row_starts = meta.query_start_loc.tolist()
        sample_positions = [row_starts[r.chunk_index + 1] - 1 for r in sample_rows]
        prompt_spans = {
            i: self._prompt_prediction_span(chunks[i], row_starts[i]) for i in prompt_logprob_chunks
        }
        rows = list(sample_positions)
        for first, count in prompt_spans.values():
            rows.extend(range(first, first + count))
        if not rows:  # every chunk is a middle piece of a prefill: nothing to read out
            return StepResult([], {})
        logits = self.model.compute_logits(
            hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
        )

        sampled = self._sample(logits[: len(sample_rows)], sample_rows)
        result_prompt: dict[int, list[TokenLogprob]] = {}
        offset = len(sample_rows)
        for i, k in prompt_logprob_chunks.items():
            first, count = prompt_spans[i]
            chunk = chunks[i]
            targets = chunk.seq.token_ids[chunk.start + 1 : chunk.start + 1 + count]
            result_prompt[i] = _to_token_logprobs(
                *prompt_logprobs(
                    logits[offset : offset + count],
                    torch.tensor(targets, device=self.device),
                    k,
                ),
                targets,
            )
            offset += count
        return StepResult(sampled, result_prompt)

    def _prompt_prediction_span(self, chunk: ScheduledChunk, row_start: int) -> tuple[int, int]:
        """Rows of a chunk whose logits predict the next *prompt* token (not the first output)."""
        last_predicting = min(chunk.end, chunk.seq.num_prompt_tokens - 1)
        return row_start, max(0, last_predicting - chunk.start)

    def _prepare_inputs(
        self, chunks: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for c in chunks:
            blocks = c.seq.block_table.block_ids
            input_ids.extend(c.seq.token_ids[c.start : c.end])
            positions.extend(range(c.start, c.end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(c.start, c.end))
            query_lens.append(c.num_tokens)
            seq_lens.append(c.end)
            tables.append(blocks[: (c.end + bs - 1) // bs])
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        return (
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            meta,
        )

    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[SampledToken]:
        if not rows:
            return []
        tensors = SamplingTensors.from_rows(
            params=[r.params for r in rows],
            seeds=[r.seed for r in rows],
            prompt_ids=[r.prompt_ids for r in rows],
            output_ids=[r.output_ids for r in rows],
            banned_ids=[r.banned_ids for r in rows],
            vocab_size=logits.shape[-1],
            device=self.device,
        )
        out = self.sampler(logits, tensors)
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
