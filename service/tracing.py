"""OpenTelemetry tracing: one server span per RPC, with queue / prefill / decode children.

The RPC span's parent comes from the caller's W3C `traceparent` / `tracestate` gRPC
metadata, so a request shows up inside the caller's trace. The engine's milestones are
known only once the request has finished, so the child spans are recorded afterwards
with explicit start and end times taken from RequestTiming.

Off by default. Disabled, RequestTracer hands out one shared inert RequestSpan, so the
RPC handlers carry no branches and tracing costs a method call that returns at once.
The provider is ours, never the global one: tests build several servers in one process.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from engine.errors import ValidationError
from engine.outputs import CandidateEvent

TRACE_EXPORTERS = ("none", "console", "otlp")

# Explicitly W3C, whatever OTEL_PROPAGATORS or the global propagator say.
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True)
class RequestSpan:
    """The span of one RPC; `span` None means tracing is off and every method is a no-op."""

    span: trace.Span | None = None
    tracer: trace.Tracer | None = None
    # RequestTiming holds time.monotonic() readings; spans need Unix-epoch nanoseconds.
    # Both clocks are read once, as the span starts, and every later time is placed by its
    # monotonic distance from that moment: the children then sit inside their RPC span
    # exactly, and an NTP step of the wall clock mid-request cannot move one against another.
    start_epoch_ns: int = 0
    start_monotonic_ns: int = 0

    def _epoch_ns(self, monotonic_ns: int) -> int:
        return self.start_epoch_ns + monotonic_ns - self.start_monotonic_ns

    def finish(self, code: grpc.StatusCode, final_events: Sequence[CandidateEvent] = ()) -> None:
        """End the span: request attributes and child spans from the final events (if the
        RPC got them), error status for any code but OK."""
        if self.span is None:
            return
        self._record(final_events)
        self.span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            self.span.set_status(trace.StatusCode.ERROR, code.name)
        self.span.end(end_time=self._epoch_ns(time.monotonic_ns()))

    def _record(self, final_events: Sequence[CandidateEvent]) -> None:
        if not final_events:
            return
        finals = sorted(final_events, key=lambda e: e.index)
        span = self.span
        span.set_attribute("pagedserve.request_id", finals[0].request_id)
        span.set_attribute("gen_ai.request.choice.count", len(finals))
        span.set_attribute(
            "gen_ai.response.finish_reasons", [e.finish_reason.value for e in finals]
        )
        usages = [e.usage for e in finals if e.usage is not None]
        if usages:
            span.set_attribute("gen_ai.usage.input_tokens", usages[0].prompt_tokens)
            span.set_attribute(
                "gen_ai.usage.output_tokens", sum(u.completion_tokens for u in usages)
            )
            span.set_attribute("pagedserve.cached_tokens", usages[0].cached_tokens)

        timing = next((e.timing for e in finals if e.timing is not None), None)
        if timing is None:  # the engine loop died: its failure events carry no timing
            return
        parent = trace.set_span_in_context(span)
        phases = (
            ("queue", timing.arrival, timing.first_scheduled),
            ("prefill", timing.first_scheduled, timing.first_token),
            ("decode", timing.first_token, timing.finished),
        )
        for name, start, end in phases:
            if start is None or end is None:  # e.g. cancelled while queued: no prefill
                continue
            start_ns = self._epoch_ns(round(start * 1e9))
            child = self.tracer.start_span(name, context=parent, start_time=start_ns)
            child.end(end_time=self._epoch_ns(round(end * 1e9)))


_DISABLED = RequestSpan()


class RequestTracer:
    """Starts RPC spans on a TracerProvider of its own; None as exporter: tracing off."""

    def __init__(self, span_exporter: SpanExporter | None):
        self._provider: TracerProvider | None = None
        self._tracer: trace.Tracer | None = None
        if span_exporter is None:
            return
        # Resource.create also honours OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES.
        self._provider = TracerProvider(resource=Resource.create({"service.name": "pagedserve"}))
        # Batched: exporting happens on the processor's thread, never on the RPC's path.
        self._provider.add_span_processor(BatchSpanProcessor(span_exporter))
        self._tracer = self._provider.get_tracer("pagedserve")

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start_request(
        self, rpc: str, metadata: Iterable[tuple[str, str | bytes]] | None
    ) -> RequestSpan:
        """Start the server span of `rpc` ("pagedserve.v1.Inference/Generate"), parented by
        the trace context in the RPC's invocation metadata, if it carries one."""
        if self._tracer is None:
            return _DISABLED
        carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
        service, _, method = rpc.partition("/")
        start_epoch_ns, start_monotonic_ns = time.time_ns(), time.monotonic_ns()
        span = self._tracer.start_span(
            rpc,
            context=_PROPAGATOR.extract(carrier),
            kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method},
            start_time=start_epoch_ns,
        )
        return RequestSpan(span, self._tracer, start_epoch_ns, start_monotonic_ns)

    def shutdown(self) -> None:
        """Flush queued spans to the exporter and stop it."""
        if self._provider is not None:
            self._provider.shutdown()


def configure_tracing(exporter: str, otlp_endpoint: str | None = None) -> RequestTracer:
    """The tracer ServerConfig asks for: trace_exporter none | console | otlp."""
    if exporter == "none":
        return RequestTracer(None)
    if exporter == "console":
        # The exporter's default stream is sys.stdout as it was at import; take today's.
        return RequestTracer(ConsoleSpanExporter(out=sys.stdout))
    if exporter == "otlp":
        # Imported only when asked for: it adds ~0.15 s to every start-up otherwise.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # endpoint None: OTEL_EXPORTER_OTLP_ENDPOINT or localhost:4317; http:// means insecure.
        return RequestTracer(OTLPSpanExporter(endpoint=otlp_endpoint))
    raise ValidationError(
        "trace_exporter", f"must be one of {', '.join(TRACE_EXPORTERS)}, got {exporter!r}"
    )
