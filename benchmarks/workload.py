"""The benchmarks' shared workload and run metadata.

Seeded random token-id prompts with lengths uniform in [min_in, max_in] and output lengths
uniform in [min_out, max_out]; requests set ignore_eos, so each produces exactly its output
length. Every tool draws the same prompts from the same flags, so their figures compare.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import subprocess
import sys
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class WorkloadSpec:
    num_prompts: int = 32
    min_in: int = 16
    max_in: int = 256
    min_out: int = 16
    max_out: int = 128
    max_token_id: int = 10000
    seed: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkloadSpec:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)

    def describe(self) -> dict:
        return {
            "prompts": len(self.prompts),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
        }


def make_workload(spec: WorkloadSpec) -> Workload:
    rng = random.Random(spec.seed)
    prompts = [
        [rng.randint(0, spec.max_token_id) for _ in range(rng.randint(spec.min_in, spec.max_in))]
        for _ in range(spec.num_prompts)
    ]
    output_lens = [rng.randint(spec.min_out, spec.max_out) for _ in range(spec.num_prompts)]
    return Workload(prompts, output_lens)


def add_workload_args(parser: argparse.ArgumentParser, num_prompts: int = 32) -> None:
    g = parser.add_argument_group("workload")
    g.add_argument("--num-prompts", type=int, default=num_prompts)
    g.add_argument("--min-in", type=int, default=WorkloadSpec.min_in)
    g.add_argument("--max-in", type=int, default=WorkloadSpec.max_in)
    g.add_argument("--min-out", type=int, default=WorkloadSpec.min_out)
    g.add_argument("--max-out", type=int, default=WorkloadSpec.max_out)
    g.add_argument("--max-token-id", type=int, default=WorkloadSpec.max_token_id)
    g.add_argument("--seed", type=int, default=WorkloadSpec.seed)


def run_info() -> dict:
    """What a result needs to be reproduced: the command, the commit, the machine."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # A copy of the tree on another machine may have stale git metadata: the caller names
    # the commit there (BENCH_COMMIT=...), having committed first.
    commit = (
        os.environ.get("BENCH_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    )
    dirty = (
        "BENCH_COMMIT" not in os.environ
        and subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=ROOT,
        ).stdout.strip()
    )
    return {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit + ("-dirty" if dirty else ""),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": version("torch"),
    }


@dataclass
class CpuShare:
    """CPU time the whole machine spent busy during a timed run, and how much of it was ours.

    On a shared machine the rest ("others_s") is what other people's work took from the
    cores while we measured. Linux only (/proc); `pids` are our processes (self, a server,
    an engine child), read before they exit.
    """

    pids: list[int]
    _machine: float = 0.0
    _ours: float = 0.0

    def start(self) -> CpuShare:
        self._machine, self._ours = _machine_busy_s(), self._ours_s()
        return self

    def stop(self, warn: bool = True) -> dict:
        machine = _machine_busy_s() - self._machine
        ours = self._ours_s() - self._ours
        others = max(0.0, machine - ours)
        if warn and others > 0.05 * machine:
            print(f"warning: other processes took {others:.0f} of {machine:.0f} busy CPU seconds")
        return {
            "machine_busy_s": round(machine, 1),
            "ours_s": round(ours, 1),
            "others_s": round(others, 1),
        }

    def _ours_s(self) -> float:
        total = 0.0
        for pid in self.pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
        return total


_TICKS = os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / _TICKS
