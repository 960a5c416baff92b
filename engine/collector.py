"""When Python's garbage collector makes full passes in an engine's process: between steps.

Left to itself the collector makes a full pass whenever enough objects have outlived the
young passes since the last one, and a running request's state does (its sequences, token
lists, detokenizer). A full pass walks every such object; with 256 requests running on
the GPU host that is tens of milliseconds in which the engine queues no step and the GPU
runs dry (benchmarks/RESULTS.md: the offline run's slow stretches were the ones with the
collector's pauses). So, once an engine exists:

- what start-up built is frozen out of every pass (gc.freeze(): the model, the
  tokenizer, the block manager's blocks live as long as the process);
- the collector's automatic passes are young ones only (the default thresholds for
  those: short passes over recent objects);
- full passes are the engine's to make: when its loop falls idle (collect_if_worked(),
  after the last events are delivered), and under continuous load at most every
  FULL_PASS_INTERVAL_S between two steps (after_step()), so cyclic garbage is still
  reclaimed in a server that is never idle.

These settings are process-wide, as the collector is; an engine process (or a server
whose engine thread shares the process) is the engine's.
"""

from __future__ import annotations

import atexit
import gc
import time

FULL_PASS_INTERVAL_S = 60.0
# Automatic full passes come after this many middle-generation passes: never, in effect.
_NO_AUTOMATIC_FULL_PASS = 1_000_000_000

# The interpreter's last collection at exit must see the frozen objects again (triton's
# bindings report what they find uncollected as leaks).
atexit.register(gc.unfreeze)


class FullPasses:
    """Schedules the collector's full passes for an engine (see the module docstring)."""

    def __init__(self) -> None:
        gc.collect()  # start-up's garbage is not worth freezing
        gc.freeze()
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, _NO_AUTOMATIC_FULL_PASS)
        self.last_pass = time.monotonic()
        self.worked = False  # steps ran since the last full pass
        self.passes = 0

    def after_step(self) -> None:
        """Call after each step: a full pass if the last is FULL_PASS_INTERVAL_S old."""
        self.worked = True
        if time.monotonic() - self.last_pass >= FULL_PASS_INTERVAL_S:
            self._full_pass()

    def collect_if_worked(self) -> None:
        """Call when the engine has nothing left to run: a full pass if steps ran since
        the last one."""
        if self.worked:
            self._full_pass()

    def _full_pass(self) -> None:
        gc.collect()
        self.last_pass, self.worked = time.monotonic(), False
        self.passes += 1
