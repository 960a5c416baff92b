"""A step's inputs read from the persistent batch's tables (engine/core/batch.py).

Per flat row (its slot and position, int64): the input token id and the KV slot its K/V
go to (-1, nowhere, for a padding row). On CUDA one Triton kernel, not a dozen small ops:
at batch 1 each launch is a measurable part of a step, and inside a CUDA graph the kernel
reads the tables the step's changes were just written into.
"""

from __future__ import annotations

import torch

from engine.kernels.dispatch import use_triton


def step_inputs(
    row_slots: torch.Tensor,
    positions: torch.Tensor,
    token_table: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    padding_slot: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, KV slots), int64 [rows] each."""
    tables = (token_table, block_table, block_size, padding_slot)
    if use_triton(row_slots):
        from engine.kernels import triton_kernels

        return triton_kernels.step_inputs(row_slots, positions, *tables)
    return step_inputs_torch(row_slots, positions, *tables)


def step_inputs_torch(
    row_slots: torch.Tensor,
    positions: torch.Tensor,
    token_table: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
    padding_slot: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    token_width, block_width = token_table.shape[1], block_table.shape[1]
    input_ids = token_table.view(-1)[row_slots * token_width + positions].long()
    blocks = block_table.view(-1)[row_slots * block_width + positions // block_size]
    kv_slots = blocks.long() * block_size + positions % block_size
    return input_ids, kv_slots.masked_fill(row_slots == padding_slot, -1)
