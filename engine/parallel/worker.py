"""A tensor-parallel worker: one rank past 0, in a process of its own.

`python -m engine.parallel.worker`, started by the driver (engine/parallel/workers.py),
which writes a pickled WorkerStart to its stdin. The worker joins the group, builds its
rank as the driver builds its own (engine/core/startup.py: the same phases, in the same
order), then runs each step the driver sends: the tokens the driver sampled last step
into its token table, then the forward of its shard. It never samples and never reads
anything back to the host. It exits when the driver stops it (0) or when a collective
fails (1: the driver has gone, or another rank has).
"""

from __future__ import annotations

import logging
import pickle
import sys
import time

import torch
import torch.distributed as dist

from engine.core.kernel_cache import apply_kernel_cache_dir
from engine.core.runner import ModelRunner
from engine.core.startup import build_rank
from engine.errors import EngineError
from engine.parallel.channel import StepChannel
from engine.parallel.workers import WorkerStart, join_group, leave_group, rank_device

log = logging.getLogger(__name__)


def serve_steps(runner: ModelRunner, channel: StepChannel) -> None:
    """Run the driver's steps until it stops the group."""
    targets = None  # where the tokens of the last forward's samples go
    while (step := channel.receive_step()) is not None:
        if step.tokens_follow:
            runner.batch.write_tokens(targets, channel.receive_tokens(len(targets)))
        targets = runner.forward(step.plan).targets


def main() -> int:
    start: WorkerStart = pickle.load(sys.stdin.buffer)
    config, rank = start.config, start.rank
    logging.basicConfig(
        level=start.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s [rank {rank}] %(message)s",
    )
    apply_kernel_cache_dir(config.kernel_cache_dir)
    torch.set_num_threads(start.num_threads)
    started = time.monotonic()
    device = rank_device(config, rank)
    store = dist.TCPStore(
        "127.0.0.1", start.store_port, config.tensor_parallel_size, is_master=False
    )
    tp, channel = join_group(config, rank, store, device)
    try:
        runner = build_rank(config, start.model_path, tp, device, started).runner
        with torch.inference_mode():
            serve_steps(runner, channel)
    except EngineError as exc:  # the driver says the same, in one line
        log.error("tensor-parallel rank %d: %s", rank, exc)
        return 1
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        return 1
    leave_group(channel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
