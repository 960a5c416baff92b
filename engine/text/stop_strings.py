"""Stop strings, matched on generated text as it streams in.

A stop can straddle deltas ("<|e" + "nd|>"), so the tail of the text that could still be the
start of a stop is held back until the next delta settles it. When several stops match, the one
that completes first in the stream wins (ties: the one that starts first), so the result never
depends on how the text was cut into deltas.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.errors import ValidationError


class StopStringMatcher:
    def __init__(self, stops: Sequence[str], include_stop_str: bool):
        if any(stop == "" for stop in stops):
            raise ValidationError("stop", "stop strings must not be empty")
        self.stops = tuple(dict.fromkeys(stops))
        self.include_stop_str = include_stop_str
        self.matched: str | None = None
        self._held = ""  # seen, not yet emitted: could be the start of a stop

    def feed(self, delta: str) -> tuple[str, str | None]:
        """(text safe to emit now, the stop string matched by this delta or None).

        After a match, the sequence is over: later deltas emit nothing."""
        if self.matched is not None:
            return "", None
        if not self.stops:  # most requests: nothing to match, nothing to hold back
            return delta, None
        text = self._held + delta
        match = self._first_match(text, search_from=len(self._held))
        if match is not None:
            start, stop = match
            self.matched = stop
            self._held = ""
            end = start + len(stop) if self.include_stop_str else start
            return text[:end], stop
        hold = self._longest_stop_prefix_suffix(text)
        self._held = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold], None

    def flush(self) -> str:
        """The held-back text, when the sequence ends for another reason than a stop."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str, search_from: int) -> tuple[int, str] | None:
        """(start, stop) of the stop that ends earliest in `text`. Held text holds no whole stop,
        so a match must end after `search_from`."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            start = text.find(stop, max(0, search_from - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return (best[1], best[2]) if best is not None else None

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop."""
        longest = 0
        for stop in self.stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
