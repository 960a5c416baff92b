"""The tensor-parallel group as the driver holds it: the worker processes it started (one
per rank past 0, each `python -m engine.parallel.worker`), the channel that tells them each
step, and what became of them.

Ranks meet at a TCPStore the driver opens on a free loopback port. The default group runs
the model's collectives (NCCL on CUDA, gloo on the CPU); a gloo group beside it carries
the plans. Every collective gives up after `timeout` seconds, so a rank that hangs fails
the others instead of holding them forever; a rank that exits is seen at once
(lost_rank), by the engine loop even when idle.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import signal
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.errors import EngineError, ValidationError
from engine.parallel.channel import StepChannel
from engine.parallel.group import TensorParallel

log = logging.getLogger(__name__)

# How long a stopped worker may take to leave before it is killed.
_STOP_SECONDS = 10.0


class WorkerLost(EngineError):
    """A tensor-parallel rank exited, hung or failed: the ranks no longer agree, so the
    engine cannot go on."""


@dataclass(frozen=True)
class WorkerStart:
    """What a worker process reads from its stdin at start: all it needs to build its rank."""

    config: EngineConfig
    model_path: Path
    rank: int
    store_port: int
    num_threads: int  # torch's intra-op threads (the CPU), as the driver runs
    log_level: int  # the driver's


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The device rank `rank` runs on: the configured one at size 1, else on CUDA one GPU a
    rank from the configured index."""
    device = config.torch_device
    if device.type != "cuda" or config.tensor_parallel_size == 1:
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def join_group(
    config: EngineConfig, rank: int, store: dist.Store, device: torch.device
) -> tuple[TensorParallel, StepChannel]:
    """This process as rank `rank` of the group (every rank calls this, each its own)."""
    timeout = timedelta(seconds=config.tensor_parallel_timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    size = config.tensor_parallel_size
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    host_group = dist.new_group(backend="gloo", timeout=timeout)
    return TensorParallel(rank, size), StepChannel(host_group, device)


def leave_group(channel: StepChannel) -> None:
    """This rank out of the group for good (every rank calls this, each its own), the
    groups' threads ended now, while the interpreter is whole: left to its exit, a gloo
    thread still dropping a finished collective's tensor needs the GIL, cannot have it
    there, and aborts the process."""
    channel.close()  # the host group's last reference but torch.distributed's own
    dist.destroy_process_group()


class Workers:
    """Ranks 1 .. size - 1, started as processes, and the channel to them."""

    def __init__(self, processes: list[subprocess.Popen], channel: StepChannel):
        self.processes = processes  # rank r at r - 1
        self.channel = channel
        self._stopped = False
        self._failed = False  # a collective failed: the group cannot hear a stop
        atexit.register(self.stop)

    @classmethod
    def start(
        cls, config: EngineConfig, model_path: Path, device: torch.device
    ) -> tuple[Workers, TensorParallel]:
        """Start the workers, and join the group as rank 0 (this process)."""
        size = config.tensor_parallel_size
        if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
            raise ValidationError(
                "tensor_parallel_size",
                f"{size} ranks need GPUs cuda:{device.index or 0} to "
                f"cuda:{(device.index or 0) + size - 1}; this host has "
                f"{torch.cuda.device_count()}",
            )
        timeout = timedelta(seconds=config.tensor_parallel_timeout)
        store = dist.TCPStore(
            "127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        processes = []
        for rank in range(1, size):
            start = WorkerStart(
                config,
                model_path,
                rank,
                store.port,
                torch.get_num_threads(),
                logging.getLogger().getEffectiveLevel(),
            )
            process = subprocess.Popen(
                [sys.executable, "-m", "engine.parallel.worker"], stdin=subprocess.PIPE, env=env
            )
            process.stdin.write(pickle.dumps(start))
            process.stdin.close()
            processes.append(process)
        log.info(
            "tensor parallelism: %d ranks, workers %s",
            size,
            ", ".join(f"rank {r} pid {p.pid}" for r, p in enumerate(processes, 1)),
        )
        try:
            tp, channel = join_group(config, 0, store, device)
        except BaseException:
            _end(processes, grace=0)
            raise
        return cls(processes, channel), tp

    def lost_rank(self) -> str | None:
        """Which worker has exited, and how; None while every one runs."""
        for rank, process in enumerate(self.processes, 1):
            if (code := process.poll()) is not None:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                return f"tensor-parallel rank {rank} (pid {process.pid}) exited ({how})"
        return None

    def check(self) -> None:
        """Raise WorkerLost if a worker has exited."""
        if not self._stopped and (lost := self.lost_rank()) is not None:
            raise WorkerLost(lost)

    def failure(self, exc: BaseException) -> WorkerLost:
        """exc, raised by a step under tensor parallelism, as the engine's end: naming the
        rank that exited, where one did (a collective with it fails at once)."""
        self._failed = True
        lost = self.lost_rank() or "a tensor-parallel step failed (no rank exited: one may hang)"
        return WorkerLost(f"{lost}: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        """Tell the workers to leave, wait for them (kill those that do not), and leave the
        group. Safe to call twice, and after a worker is gone."""
        if self._stopped:
            return
        self._stopped = True
        grace = 0.0  # a group that lost a rank cannot hear a stop: its others are killed
        if not self._failed and self.lost_rank() is None:
            try:
                self.channel.send_stop()
                grace = _STOP_SECONDS
            except RuntimeError:  # a rank went away meanwhile
                pass
        _end(self.processes, grace)
        leave_group(self.channel)


def _end(processes: list[subprocess.Popen], grace: float) -> None:
    """Wait up to `grace` seconds for each process to exit, then kill it."""
    for process in processes:
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
