"""This process's place in a tensor-parallel group, and the collectives its layers run.

The group is torch.distributed's default one (NCCL on CUDA, gloo on the CPU), set up by
whoever starts the ranks. At size 1 every collective returns its input as it is: the
single-process model runs no extra op and needs no process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# Bound now, before any group exists: torch.distributed.nn's functions take group.WORLD as
# a default argument, and the module is first imported lazily (by torch._dynamo, while a
# model is built). Imported after init_process_group, they would hold the default group
# past destroy_process_group, its gloo threads alive into the interpreter's exit, where
# one still dropping a finished collective's tensor needs the GIL and aborts the process.
import torch.distributed.nn.functional  # noqa: F401


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")

    @classmethod
    def of_default_group(cls) -> TensorParallel:
        """This process's place in torch.distributed's initialised default group."""
        return cls(dist.get_rank(), dist.get_world_size())

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in place."""
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (all of one shape) side by side along the last dim, rank 0 first."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim=-1)

    def smallest(self, value: int, device: torch.device) -> int:
        """The least of every rank's value (a collective on `device`'s backend)."""
        if self.size == 1:
            return value
        x = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return int(x.item())


SINGLE_PROCESS = TensorParallel()
