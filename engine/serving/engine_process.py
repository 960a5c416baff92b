"""EngineProcess: the engine loop in a child process of its own (an AsyncEngine core).

At GPU speed the engine's host work per step and the server's per-token gRPC writes each
need most of a core; on one interpreter they take turns holding its lock, and the writes
stretch the step the GPU waits for (benchmarks/RESULTS.md's git history). The child is
spawned (CUDA cannot be forked) and runs run_core over two multiprocessing queues, whose
feeder threads keep a put from ever blocking either side; a reader thread in the parent
hands what comes out to EngineCore.receive. The child exits when told to, or when its
parent is gone.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable

from engine.config import EngineConfig
from engine.serving.async_engine import EngineCore, Failed, LoopOutput, Stop, run_core, take_inbox
from engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# How often a waiting side looks up whether the other one is still alive.
LIVENESS_POLL_SECONDS = 0.5


class EngineProcess(EngineCore):
    name = "engine process"

    def __init__(self, config: EngineConfig, warmup: bool = True):
        """With `warmup`, the child runs engine/core/warmup.py before it reports ready."""
        context = mp.get_context("spawn")
        self._inbox = context.Queue()
        self._inbox.cancel_join_thread()  # at exit, requests the child never read are moot
        self._outputs = context.Queue()
        self._worker = context.Process(
            target=_child_main,
            args=(config, self._inbox, self._outputs, logging.getLogger().level, warmup),
            name="pagedserve-engine",
            daemon=True,
        )
        self._reader = threading.Thread(target=self._read, name="engine-outputs", daemon=True)

    def start(self, deliver: Callable[[LoopOutput], None], died: Callable[[str], None]) -> None:
        """Spawn the child and wait until its engine is built (model load, CUDA graphs)."""
        super().start(deliver, died)
        self.tokenizer = Tokenizer.from_path(self.info.model_path)

    def _launch(self) -> None:
        self._worker.start()
        self._reader.start()  # after: the reader takes a child not alive for one that is gone

    def shutdown(self, timeout: float | None) -> None:
        super().shutdown(timeout)
        if self._worker.is_alive():
            log.warning("engine process did not stop in %s s; terminating it", timeout)
            self._worker.terminate()
            self._worker.join(5)
        if self._reader.is_alive():
            self._reader.join(timeout)

    def is_alive(self) -> bool:
        """Until the reader has handed on the child's last output: a child that is gone is
        dead to callers only once its death (why, and the requests it failed) is told."""
        return self._reader.is_alive()

    @property
    def pid(self) -> int | None:
        return self._worker.pid

    def _read(self) -> None:
        """Hands the child's messages to receive() until a Failed, or until it is gone."""
        while True:
            try:
                message = self._outputs.get(timeout=LIVENESS_POLL_SECONDS)
            except queue.Empty:
                # Once it is gone, all it sent is in the pipe (its feeder thread flushes
                # before it exits), so an empty pipe means nothing more will come.
                if self._worker.is_alive() or not self._outputs.empty():
                    continue
                message = Failed(f"it exited with code {self._worker.exitcode}")
            except Exception as exc:  # an output that cannot be unpickled: a bug, and fatal
                log.exception("unreadable engine output")
                self._worker.terminate()
                message = Failed(f"unreadable output: {type(exc).__name__}: {exc}")
            self.receive(message)
            if isinstance(message, Failed):
                return


# ---- in the child ------------------------------------------------------------------------


def _child_main(
    config: EngineConfig, requests: mp.Queue, outputs: mp.Queue, log_level: int, warmup: bool
):
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine] %(message)s"
    )
    from engine.core.engine import LLMEngine  # here, so the parent never builds one by accident

    parent = mp.parent_process()

    def take(block: bool) -> list:
        items = take_inbox(requests, block, timeout=LIVENESS_POLL_SECONDS)
        if not items and block and parent is not None and not parent.is_alive():
            return [Stop()]  # orphaned: free the device
        return items

    # A child exits only once its feeder thread has put every output into the pipe.
    if not run_core(lambda: LLMEngine(config), warmup, take, outputs.put):
        raise SystemExit(1)
