"""EngineProcess: the engine loop in a child process of its own (an AsyncEngine core).

Why: the engine's host work per step (scheduling, input building, detokenizing) and the
server's per-message work (one gRPC stream write per token per request) each need most of
a core at GPU speed. On one interpreter they take turns holding its lock, and the step
the GPU waits for gets stretched by the server's writes (benchmarks/RESULTS.md, serving on
the H200). In a child process each has an interpreter of its own.

How: the child is spawned (CUDA cannot be forked) and runs engine.async_engine.run_core,
which builds the LLMEngine, warms it up (so the kernels are built in the process that runs
them), reports ready with its EngineInfo and first stats, then runs the loop over two
multiprocessing queues: requests in (Submit / Cancel / Stop), LoopOutputs out. Both
queues have feeder threads, so a put never blocks either side: the event loop never waits
for the child, and the child never waits for the parent. A reader thread in the parent
takes each LoopOutput and hands it to AsyncEngine.deliver. The child exits when told to,
or by itself when the parent is gone, so it never holds the GPU as an orphan.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable

from engine.async_engine import Cancel, Failed, LoopOutput, Ready, Stop, Submit, drain, run_core
from engine.config import EngineConfig
from engine.errors import ModelLoadError
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# How often a waiting side looks up whether the other one is still alive.
LIVENESS_POLL_SECONDS = 0.5


class EngineProcess:
    def __init__(self, config: EngineConfig, warmup: bool = True):
        """With `warmup`, the child runs engine/warmup.py before it reports ready."""
        self.config = config
        context = mp.get_context("spawn")
        self._requests = context.Queue()
        self._requests.cancel_join_thread()  # at exit, requests the child never read are moot
        self._outputs = context.Queue()
        self._process = context.Process(
            target=_child_main,
            args=(config, self._requests, self._outputs, logging.getLogger().level, warmup),
            name="pagedserve-engine",
            daemon=True,
        )
        self._reader: threading.Thread | None = None
        self._stopping = False

    def start(self, deliver: Callable[[LoopOutput], None], died: Callable[[str], None]) -> None:
        """Spawn the child and wait until its engine is built (model load, CUDA graphs)."""
        self._process.start()
        ready = self._next_output()
        if not isinstance(ready, Ready):
            self._process.join(5)
            why = ready.error if ready else f"it exited with code {self._process.exitcode}"
            raise ModelLoadError(f"the engine process failed to start: {why}")
        self.info = ready.info
        self.tokenizer = Tokenizer.from_path(ready.info.model_path)
        deliver(ready.first)
        self._reader = threading.Thread(
            target=self._read, args=(deliver, died), name="engine-outputs", daemon=True
        )
        self._reader.start()

    def put(self, item: Submit | Cancel) -> None:
        self._requests.put(item)

    def shutdown(self, timeout: float | None) -> None:
        self._stopping = True
        if self._process.is_alive():
            self._requests.put(Stop())
            self._process.join(timeout)
        if self._process.is_alive():
            log.warning("engine process did not stop in %s s; terminating it", timeout)
            self._process.terminate()
            self._process.join(5)
        if self._reader is not None:
            self._reader.join(timeout)

    def is_alive(self) -> bool:
        return self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _read(self, deliver: Callable[[LoopOutput], None], died: Callable[[str], None]) -> None:
        while isinstance(output := self._next_output(), LoopOutput):
            deliver(output)
        if not self._stopping:  # a Failed, or the child exited without one
            error = output.error if output else "it exited"
            log.error("engine process died (exit code %s): %s", self._process.exitcode, error)
            died(f"engine process died: {error}")

    def _next_output(self) -> LoopOutput | Ready | Failed | None:
        """The child's next message; None once it is gone."""
        while True:
            try:
                return self._outputs.get(timeout=LIVENESS_POLL_SECONDS)
            except queue.Empty:
                # Once it is gone, all it sent is in the pipe (its feeder thread flushes
                # before it exits), so an empty pipe means nothing more will come.
                if not self._process.is_alive() and self._outputs.empty():
                    return None
            except Exception as exc:  # an output that cannot be unpickled: a bug, and fatal
                log.exception("unreadable engine output")
                self._process.terminate()
                return Failed(f"unreadable output: {type(exc).__name__}: {exc}")


# ---- in the child ------------------------------------------------------------------------


def _child_main(
    config: EngineConfig, requests: mp.Queue, outputs: mp.Queue, log_level: int, warmup: bool
):
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine] %(message)s"
    )
    from engine.engine import LLMEngine  # here, so the parent never builds one by accident

    parent = mp.parent_process()

    def take(block: bool) -> list[Submit | Cancel | Stop]:
        items = drain(requests, block, timeout=LIVENESS_POLL_SECONDS)
        if not items and block and parent is not None and not parent.is_alive():
            return [Stop()]  # orphaned: free the device
        return items

    # A child exits only once its feeder thread has put every output into the pipe.
    if not run_core(lambda: LLMEngine(config), warmup, take, outputs.put, outputs.put):
        raise SystemExit(1)
