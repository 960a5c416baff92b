"""What the driver tells the other ranks each step, over torch.distributed.

The driver (rank 0) schedules and samples; every rank runs the model forward on its shard.
Each step the driver broadcasts the plan's arrays that the forward reads (not its
sampling: workers do not sample) as one header and one byte payload over a gloo group:
the host needs them on every rank (the attention plan, the CUDA graph's batch size). No
Python object is pickled: the arrays travel as raw bytes, in the fixed order of _FIELDS.

The tokens the driver sampled last step travel with the next step, on the device group:
each worker writes them into its token table where its own last forward said they go,
before this step's batch changes (the driver's sampler wrote them before, in stream
order). So a step whose sampling never ran (it failed on the driver) leaves the
collectives in order: its tokens are simply not sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from engine.core.batch import BatchChanges
from engine.core.runner import StepPlan

# The header's first entries; then one length (elements) per field.
_STOP, _STEP = 0, 1
_FIELDS: tuple[tuple[str, type], ...] = (
    ("slots", np.int32),
    ("query_lens", np.int32),
    ("seq_lens", np.int32),
    ("num_samples", np.int32),
    ("num_prompt_tokens", np.int32),
    ("prompt_logprob_seqs", np.int64),  # the plan's prompt_logprobs, keys
    ("prompt_logprob_counts", np.int64),  # and values
    ("token_index", np.int64),  # the plan's BatchChanges, in their order
    ("token_ids", np.int32),
    ("block_index", np.int64),
    ("block_ids", np.int32),
)
_HEADER = 2 + len(_FIELDS)  # command, tokens follow, lengths


@dataclass
class WorkerStep:
    """One step as a worker runs it: the plan without sampling, and whether the driver's
    tokens of the step before follow."""

    plan: StepPlan
    tokens_follow: bool


class StepChannel:
    """The broadcasts of one tensor-parallel group, as the driver sends and workers read
    them. host_group: a gloo group of every rank; tokens travel on the default group."""

    def __init__(self, host_group: dist.ProcessGroup, device: torch.device):
        self.host_group = host_group
        self.device = device

    def close(self) -> None:
        """Let go of the host group, so that destroy_process_group ends it; the channel
        carries nothing after this."""
        del self.host_group

    # ---- the driver ----------------------------------------------------------------

    def send_step(self, plan: StepPlan, tokens: torch.Tensor | None) -> None:
        """The plan to every worker, then the tokens of the step before (int32, on the
        device), when it sampled any."""
        changes = plan.changes
        arrays = [
            plan.slots,
            plan.query_lens,
            plan.seq_lens,
            plan.num_samples,
            plan.num_prompt_tokens,
            np.fromiter(plan.prompt_logprobs.keys(), np.int64, len(plan.prompt_logprobs)),
            np.fromiter(plan.prompt_logprobs.values(), np.int64, len(plan.prompt_logprobs)),
            *changes,
        ]
        header = [_STEP, tokens is not None, *(len(a) for a in arrays)]
        self._broadcast_header(header)
        payload = np.concatenate(
            [
                np.ascontiguousarray(a, dtype=dtype).view(np.uint8)
                for a, (_, dtype) in zip(arrays, _FIELDS, strict=True)
            ]
        )
        dist.broadcast(torch.from_numpy(payload), src=0, group=self.host_group)
        if tokens is not None:
            dist.broadcast(tokens, src=0)

    def send_stop(self) -> None:
        self._broadcast_header([_STOP, 0, *(0 for _ in _FIELDS)])

    def _broadcast_header(self, header: list[int]) -> None:
        dist.broadcast(torch.tensor(header, dtype=torch.int64), src=0, group=self.host_group)

    # ---- a worker ------------------------------------------------------------------

    def receive_step(self) -> WorkerStep | None:
        """The driver's next step; None when it stops the group."""
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.host_group)
        command, tokens_follow, *lengths = header.tolist()
        if command == _STOP:
            return None
        sizes = [
            n * np.dtype(dtype).itemsize for n, (_, dtype) in zip(lengths, _FIELDS, strict=True)
        ]
        payload = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.host_group)
        raw, arrays, offset = payload.numpy(), [], 0
        for size, (_, dtype) in zip(sizes, _FIELDS, strict=True):
            arrays.append(raw[offset : offset + size].view(dtype))
            offset += size
        slots, query_lens, seq_lens, num_samples, num_prompt, seqs, counts, *changes = arrays
        plan = StepPlan(
            slots=slots,
            query_lens=query_lens,
            seq_lens=seq_lens,
            num_samples=num_samples,
            num_prompt_tokens=num_prompt,
            sampling=None,
            prompt_logprobs=dict(zip(seqs.tolist(), counts.tolist(), strict=True)),
            changes=BatchChanges(*changes),
        )
        return WorkerStep(plan, bool(tokens_follow))

    def receive_tokens(self, count: int) -> torch.Tensor:
        """The driver's tokens of the step before: int32 [count] on this rank's device."""
        tokens = torch.empty(count, dtype=torch.int32, device=self.device)
        dist.broadcast(tokens, src=0)
        return tokens
