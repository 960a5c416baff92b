"""The start-up report's figures, on the CPU: the device memory CUDA graphs hold, measured
against a stand-in for torch's caching allocator, and how StartupTimes writes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.cuda_graphs import device_memory_taken
from engine.stats import StartupTimes

GIB = 2**30


@dataclass
class CachingAllocator:
    """A device as torch.cuda reports it: memory tensors use, plus blocks the allocator
    keeps cached after their tensors are gone, until empty_cache() hands them back."""

    total: int = 80 * GIB
    in_use: int = 0
    cached: int = 0

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.total - self.in_use - self.cached, self.total

    def empty_cache(self) -> None:
        self.cached = 0


def test_graphs_are_charged_what_they_hold_not_what_a_profile_left_cached(monkeypatch):
    """The KV pool is sized after a profile of the largest step, whose 3.91 GiB of
    activations stay cached; a graph capture empties the cache and then holds 0.41 GiB."""
    device = CachingAllocator(in_use=20 * GIB, cached=int(3.91 * GIB))
    monkeypatch.setattr(torch.cuda, "mem_get_info", device.mem_get_info)
    monkeypatch.setattr(torch.cuda, "empty_cache", device.empty_cache)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def capture() -> None:
        device.empty_cache()  # torch.cuda.graph() does, before it captures
        device.in_use += int(0.41 * GIB)  # the graphs' pool, workspaces, loaded kernels
        device.cached += 64 * 2**20  # and some blocks freed in passing, cached again

    assert device_memory_taken(capture, torch.device("cuda")) == int(0.41 * GIB)


def test_the_start_up_report_names_what_the_graphs_hold():
    times = StartupTimes(
        model_load=1.5, kv_profile=2.25, cuda_graphs=0.5, warmup=3, cuda_graph_bytes=440401920
    )
    assert times.describe() == (
        "model load 1.50 s, KV profile 2.25 s, CUDA graphs 0.50 s (0.41 GiB), warm-up 3.00 s"
    )
    eager = StartupTimes(model_load=1.5, kv_profile=0.25, warmup=3)  # the CPU: no graphs
    assert eager.describe() == (
        "model load 1.50 s, KV profile 0.25 s, CUDA graphs 0.00 s, warm-up 3.00 s"
    )
