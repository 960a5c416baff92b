"""The persistent batch: every running sequence's token ids and KV blocks, on the device.

A running sequence owns a slot: its row of the token table (token ids by position) and of
the block table (KV blocks in order). A step reads its input ids, KV slots and pages from
them, and the sampler writes each new token into its row: a step can be queued before the
host has the previous step's tokens, and a penalty reads a history where it already is.

The host (SlotBook) keeps the free slots and sends only what changed (BatchChanges): rows
of sequences placed in a slot, blocks appended, tokens a proposer wrote. A freed slot's rows
stay as they are: nothing reads a row past its sequence's length. Row num_slots is padding,
all block 0 (the page a CUDA graph's padding rows attend to) and token 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from engine.kernels.step_inputs import step_inputs


class BatchChanges(NamedTuple):
    """Writes into the tables before a step, as flat indices into each table; uploaded in
    this order, which DeviceBatch.apply takes."""

    token_index: np.ndarray  # int64: slot * token_width + position
    token_ids: np.ndarray  # int32
    block_index: np.ndarray  # int64: slot * block_width + the block's number in the row
    block_ids: np.ndarray  # int32


class SlotBook:
    """The host's record of the persistent batch, and the changes not yet sent."""

    def __init__(self, num_slots: int, token_width: int, block_width: int):
        self.num_slots = num_slots
        self.token_width = token_width
        self.block_width = block_width
        self._free = list(range(num_slots - 1, -1, -1))  # pop() takes the lowest
        self._blocks_on_device = [0] * num_slots
        self._token_writes: list[tuple[int, Sequence[int]]] = []  # (flat start, ids)
        self._block_writes: list[tuple[int, Sequence[int]]] = []

    def place(self, token_ids: Sequence[int], block_ids: list[int]) -> int:
        """A slot for a sequence that starts running: its rows get all it has."""
        slot = self._free.pop()
        self.write_tokens(slot, 0, token_ids)
        self._blocks_on_device[slot] = 0
        self.sync_blocks(slot, block_ids)
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def write_tokens(self, slot: int, start: int, token_ids: Sequence[int]) -> None:
        assert start + len(token_ids) <= self.token_width, "past the token row"
        self._token_writes.append((slot * self.token_width + start, token_ids))

    def sync_blocks(self, slot: int, block_ids: list[int]) -> None:
        """The block row follows block_ids: appended blocks are sent; a shorter table
        (blocks given back after a rollback) only forgets the rest."""
        have = self._blocks_on_device[slot]
        if len(block_ids) > have:
            self._block_writes.append((slot * self.block_width + have, block_ids[have:]))
        self._blocks_on_device[slot] = len(block_ids)

    def take_changes(self) -> BatchChanges:
        changes = BatchChanges(*_flat(self._token_writes), *_flat(self._block_writes))
        self._token_writes, self._block_writes = [], []
        return changes


def _flat(writes: list[tuple[int, Sequence[int]]]) -> tuple[np.ndarray, np.ndarray]:
    if not writes:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
    index = np.concatenate([np.arange(start, start + len(ids)) for start, ids in writes])
    values = np.concatenate([np.asarray(ids, dtype=np.int32) for _, ids in writes])
    return index.astype(np.int64), values


class DeviceBatch:
    """The tables themselves, one row per slot plus the padding row."""

    def __init__(self, num_slots: int, token_width: int, block_width: int, device: torch.device):
        self.padding_slot = num_slots
        self.token_ids = torch.zeros(num_slots + 1, token_width, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(num_slots + 1, block_width, dtype=torch.int32, device=device)

    def apply(self, changes: list[torch.Tensor]) -> None:
        """Write a step's BatchChanges (uploaded, in their order)."""
        token_index, token_ids, block_index, block_ids = changes
        if token_index.numel():  # most steps change nothing: no launch then
            self.token_ids.view(-1).index_copy_(0, token_index, token_ids)
        if block_index.numel():
            self.block_table.view(-1).index_copy_(0, block_index, block_ids)

    def inputs(
        self, row_slots: torch.Tensor, positions: torch.Tensor, block_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per flat row (its slot and position): its input token id and its KV slot."""
        tables = (self.token_ids, self.block_table, block_size, self.padding_slot)
        return step_inputs(row_slots, positions, *tables)

    def write_tokens(self, token_index: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Sampled tokens into their rows (token_index: slot * token_width + position)."""
        # torch, not a Triton kernel: this runs eagerly every step, and Triton's launch
        # from Python costs the host more than the cast and the copy do.
        self.token_ids.view(-1).index_copy_(0, token_index, token_ids.to(torch.int32))

    def history(
        self, slots: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, width: int, pad: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 [R, width] twice, padded with the pad id: row r holds slot r's tokens at
        positions [0, ends[r]), then only those at [starts[r], ends[r])."""
        ids = self.token_ids[slots, :width].long()
        positions = torch.arange(width, device=ids.device)
        whole = ids.masked_fill(positions >= ends[:, None], pad)
        return whole, whole.masked_fill(positions < starts[:, None], pad)
