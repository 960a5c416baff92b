"""Prometheus metrics: RPC outcomes, request latency histograms, engine load at scrape time.

ServerMetrics owns its own CollectorRegistry (never the process-global one), so several
servers can live in one process. Engine gauges and counters are not pushed: a collector
reads the EngineStats snapshot the engine thread last published, at scrape time, and
emits nothing while no engine is attached (the server starts before the model loads).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator, Sequence
from threading import Thread
from wsgiref.simple_server import WSGIServer

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import start_http_server as start_prometheus_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.outputs import CandidateEvent
from engine.stats import GRAMMAR_BUILD_SECONDS_BOUNDS, EngineStats

# Seconds. Wide enough for a CPU host (a prefill of seconds, decode of 100s of ms per
# token) and fine enough at the bottom for a GPU (ms TTFT, a few ms per token).
TTFT_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
E2E_BUCKETS = (
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0,
    120.0, 240.0, 480.0, 960.0,
)  # fmt: skip
QUEUE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats | None] = lambda: None):
        """engine_stats returns the engine's latest snapshot, or None while there is none."""
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pagedserve_requests",
            "RPCs finished, by method and gRPC status code.",
            ["rpc", "code"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "pagedserve_time_to_first_token_seconds",
            "Arrival at the engine to the first sampled token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "pagedserve_time_per_output_token_seconds",
            "First token to finish, divided by the tokens after the first (longest candidate).",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "pagedserve_e2e_request_latency_seconds",
            "Arrival at the engine to the last candidate finishing.",
            buckets=E2E_BUCKETS,
            registry=self.registry,
        )
        self.queue_time = Histogram(
            "pagedserve_queue_time_seconds",
            "Arrival at the engine to the first step that scheduled the request.",
            buckets=QUEUE_BUCKETS,
            registry=self.registry,
        )
        self.time_to_ready = Gauge(
            "pagedserve_time_to_ready_seconds",
            "Process start to readiness SERVING: model load, KV profile, CUDA graphs and "
            "warm-up included (0 until ready); short by at most a clock tick and 10 ms.",
            registry=self.registry,
        )
        self.registry.register(_EngineStatsCollector(engine_stats))
        self._http: tuple[WSGIServer, Thread] | None = None

    def rpc_finished(self, rpc: str, code: grpc.StatusCode) -> None:
        self.requests.labels(rpc=rpc, code=code.name).inc()

    def request_finished(self, final_events: Sequence[CandidateEvent]) -> None:
        """Observe one request's latencies from its candidates' final events.

        The candidates share one RequestTiming. Events without timing (the engine loop
        died) and milestones never reached (cancelled while queued) are skipped.
        """
        timing = next((e.timing for e in final_events if e.timing is not None), None)
        if timing is None:
            return
        if timing.first_scheduled is not None:
            self.queue_time.observe(timing.first_scheduled - timing.arrival)
        if timing.first_token is not None:
            self.time_to_first_token.observe(timing.first_token - timing.arrival)
        if timing.finished is None:
            return
        self.e2e_latency.observe(timing.finished - timing.arrival)
        # Candidates decode side by side, so the longest one spans first_token..finished.
        longest = max((e.usage.completion_tokens for e in final_events if e.usage), default=0)
        if timing.first_token is not None and longest > 1:
            self.time_per_output_token.observe(
                (timing.finished - timing.first_token) / (longest - 1)
            )

    def render(self) -> bytes:
        """The exposition text a scrape returns."""
        return generate_latest(self.registry)

    def start_http_server(self, host: str, port: int) -> int:
        """Serve /metrics on a daemon thread; returns the bound port (port 0 picks one)."""
        assert self._http is None, "already serving"
        self._http = start_prometheus_http_server(port, addr=host, registry=self.registry)
        return self._http[0].server_port

    def stop_http_server(self) -> None:
        if self._http is None:
            return
        server, thread = self._http
        self._http = None
        server.shutdown()
        server.server_close()
        thread.join()


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that is unknown.

    At most the true age: the kernel truncates both the start (to a clock tick) and the
    uptime (to 10 ms), so the start is taken one tick later than the one it reports."""
    try:
        with open("/proc/self/stat") as f:
            # Fields after the command name, which may hold spaces; starttime is field 22.
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - (start_ticks + 1) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def rpc_status(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    """The status an RPC handler ended with, given the exception that left it (None: none).

    grpc.aio cancels the handler on client cancel, disconnect and deadline alike; the
    deadline is told apart by the time left. An abort leaves its code on the context; any
    other exception becomes UNKNOWN on the wire.
    """
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED
    code = context.code()
    if code is not None:
        return code
    return grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN


class _EngineStatsCollector(Collector):
    def __init__(self, engine_stats: Callable[[], EngineStats | None]):
        self._engine_stats = engine_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats()
        if stats is None:
            return
        yield _gauge(
            "num_requests_running",
            "Requests with a candidate in the running batch.",
            stats.num_running_requests,
        )
        yield _gauge(
            "num_requests_waiting",
            "Admitted requests with no candidate running.",
            stats.num_waiting_requests,
        )
        yield _gauge(
            "kv_cache_usage_ratio",
            "Fraction of KV blocks held by live sequences.",
            stats.kv_cache_usage,
        )
        yield _gauge(
            "kv_cache_blocks_used", "KV blocks held by live sequences.", stats.num_kv_blocks_used
        )
        yield _gauge("kv_cache_blocks_total", "KV blocks in the pool.", stats.num_kv_blocks_total)
        # The KV pool's shape as labels of one series, as endpoint pickers read it.
        cache_config = GaugeMetricFamily(
            "pagedserve_cache_config_info",
            "The KV cache's shape: tokens per block and blocks in the pool (value 1).",
            labels=["block_size", "num_gpu_blocks"],
        )
        cache_config.add_metric([str(stats.kv_block_size), str(stats.num_kv_blocks_total)], 1)
        yield cache_config
        yield _gauge(
            "prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache per token looked up, since start.",
            stats.prefix_cache_hit_rate,
        )
        yield _counter(
            "preemptions",
            "Sequences preempted (their KV is recomputed later).",
            stats.num_preemptions,
        )
        yield _counter(
            "prompt_tokens",
            "Prompt tokens computed: prefix-cache hits excluded, "
            "recomputation after preemption included.",
            stats.num_prompt_tokens_computed,
        )
        yield _counter(
            "generation_tokens",
            "Output tokens: sampled, or forced by a grammar; every candidate counted.",
            stats.num_generated_tokens,
        )
        yield _counter(
            "grammar_forced_tokens",
            "Output tokens a grammar forced, appended without a step of their own.",
            stats.num_forced_tokens,
        )
        yield _counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_cache_queried_tokens,
        )
        yield _counter(
            "prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            stats.prefix_cache_hit_tokens,
        )
        yield _counter("engine_steps", "Model steps run.", stats.num_steps)
        aborted = CounterMetricFamily(
            "pagedserve_requests_aborted",
            "Requests whose callers left or cancelled them, by the door they left by "
            "(grpc_unary, grpc_stream, rest_unary, rest_stream, cancel_rpc, slow_reader) "
            "and the stage they were at (inbox, compiling, waiting, prefill, decode, preempted).",
            labels=["door", "stage"],
        )
        for door, stage, count in stats.aborts:
            aborted.add_metric([door, stage], count)
        yield aborted
        grammar = stats.grammar
        yield _counter(
            "grammar_cache_hits",
            "Constraints whose grammar was already built (cached per constraint).",
            grammar.cache_hits,
        )
        bounds = [f"{bound:g}" for bound in GRAMMAR_BUILD_SECONDS_BOUNDS] + ["+Inf"]
        yield HistogramMetricFamily(
            "pagedserve_grammar_build_seconds",
            "Grammar builds of constraints (cache misses), whether or not their callers "
            "still waited for them.",
            buckets=list(zip(bounds, [*grammar.builds_within, grammar.builds], strict=True)),
            sum_value=grammar.build_seconds,
        )


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"pagedserve_{name}", doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"pagedserve_{name}", doc, value=value)
