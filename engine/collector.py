"""When Python's garbage collector runs in an engine's process: between steps, not inside.

Left to itself the collector makes a full pass whenever enough objects have outlived a
young collection since the last one, and a running request's state does (its sequences,
token lists, detokenizer). A full pass walks every such object; with 256 requests running
on the GPU host that is tens of milliseconds, during which the engine queues no step and
the GPU runs dry (RESULTS.md: the offline run's slow stretches were the ones with the
collector's pauses). So, once an engine exists:

- what start-up built is frozen out of every pass (gc.freeze(): the model, the
  tokenizer, the block manager's blocks live as long as the process);
- the collector's automatic passes are young ones only, and rarer (YOUNG_THRESHOLD
  allocations instead of 700): objects that die within a step never get scanned;
- full passes are the engine's to make (FullPasses.after_step): when it falls idle, and
  under continuous load at most every FULL_PASS_INTERVAL_S, so cyclic garbage is still
  reclaimed in a server that is never idle.

These settings are process-wide, as the collector is; an engine process (or a server
whose engine thread shares the process) is the engine's.
"""

from __future__ import annotations

import atexit
import gc
import time

YOUNG_THRESHOLD = 20_000  # container allocations between automatic young passes (default 700)
FULL_PASS_INTERVAL_S = 60.0
# Automatic full passes happen after this many middle-generation passes: never, in effect.
_NO_AUTOMATIC_FULL_PASS = 1_000_000_000

# The interpreter's last collection at exit must see the frozen objects again (triton's
# bindings report what they find uncollected as leaks).
atexit.register(gc.unfreeze)


class FullPasses:
    """Schedules the collector's full passes for an engine (see the module docstring)."""

    def __init__(self) -> None:
        gc.collect()
        gc.freeze()
        _, middle, _ = gc.get_threshold()
        gc.set_threshold(YOUNG_THRESHOLD, middle, _NO_AUTOMATIC_FULL_PASS)
        self.last_pass = time.monotonic()
        self.worked = False  # steps ran since the last full pass
        self.passes = 0

    def after_step(self, idle: bool) -> None:
        """Call after each step, with whether the engine has nothing left to run: a full
        pass once it falls idle after work, or once the last is FULL_PASS_INTERVAL_S old."""
        self.worked |= not idle
        now = time.monotonic()
        if (idle and self.worked) or now - self.last_pass >= FULL_PASS_INTERVAL_S:
            gc.collect()
            self.last_pass, self.worked = now, False
            self.passes += 1
