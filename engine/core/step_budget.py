"""How many tokens the next step may carry: max_num_batched_tokens, and under a time
target (target_step_seconds, the CPU's default) what recent steps say fits in it.

A step is the engine's unit of reaction: a caller who leaves, a new request, every
stream's next token all wait for the step already running (the loop reads its inbox
between steps). On a GPU a step of the whole budget takes milliseconds; on a CPU 2,048
prompt tokens take seconds, and several times as long while other processes load the
cores. So a timed step's prefill is cut to the tokens a step of target_step_seconds holds
at the rate recent steps ran (tokens over seconds), which follows the machine's load. A
step costs a fixed part and a part per token, so the more tokens, the higher the rate: a
step that used its whole budget measures the rate of the next full one, and one with less
work (decodes alone) only shows that rate to be at least its own. A budget set from a full
step's rate overshoots the target by at most the fixed part, and the next full step's
rate brings it back to the target. The first step may take max_num_batched_tokens.

The floor: every decode of the step and MIN_PREFILL_TOKENS of prompt, so streams get
their token each step and prompts keep moving however slow the machine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# The prompt tokens a timed step may always carry beside its decodes. The CPU's projections
# run 32 rows at half the rate per row of 2,048 (38.9 vs 1,317 ms, benchmarks/RESULTS.md,
# "CPU: offline, serving, projections"),
# so 64 at about two thirds: a floor step wastes little where a loaded machine holds steps
# at the floor.
MIN_PREFILL_TOKENS = 64


@dataclass
class StepBudget:
    max_tokens: int  # max_num_batched_tokens
    target_seconds: float | None  # None: steps are not timed, every step may take max_tokens
    tokens_per_second: float | None = None  # what a full step runs at; None before a step

    def tokens(self, decode_tokens: Iterable[int]) -> int:
        """The next step's budget, given the tokens each of its decodes takes (read only
        where steps are timed)."""
        if self.target_seconds is None or self.tokens_per_second is None:
            return self.max_tokens
        fits = int(self.target_seconds * self.tokens_per_second)
        return min(self.max_tokens, max(fits, sum(decode_tokens) + MIN_PREFILL_TOKENS))

    def record(self, num_tokens: int, budget: int, seconds: float) -> None:
        """A step of num_tokens, scheduled under budget, took seconds."""
        if self.target_seconds is None or num_tokens == 0:
            return
        rate = num_tokens / max(seconds, 1e-6)
        if num_tokens < budget and self.tokens_per_second is not None:
            rate = max(rate, self.tokens_per_second)  # a full step runs at least as fast
        self.tokens_per_second = rate
