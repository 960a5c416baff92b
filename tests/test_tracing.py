"""RequestTracer: W3C trace context from real gRPC metadata, phase spans from a real engine."""

from __future__ import annotations

import asyncio
import time

import grpc
import opentelemetry.sdk.trace
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.config import engine_config_from_flat
from engine.core.engine import LLMEngine
from engine.errors import ValidationError
from engine.sampling_params import SamplingParams
from engine.serving.async_engine import AsyncEngine, EngineThread
from service.metrics import rpc_status
from service.tracing import RequestTracer, configure_tracing
from tests.tiny_models import write_tiny_model

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
CALLER_SPAN_ID = 0xB7AD6B7169203331
TRACEPARENT = f"00-{TRACE_ID:032x}-{CALLER_SPAN_ID:016x}-01"
RPC = "t.Echo/Run"


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    path = write_tiny_model(tmp_path_factory.mktemp("tracing-tiny"), "llama")
    return LLMEngine(
        engine_config_from_flat(
            model=str(path), num_blocks=64, block_size=4, max_num_batched_tokens=4
        )
    )


@pytest.fixture
def exporter():
    return InMemorySpanExporter()


@pytest.fixture
def tracer(exporter):
    tracer = RequestTracer(exporter)
    yield tracer
    tracer.shutdown()


async def serve_and_call(tracer: RequestTracer, core: LLMEngine, request: bytes, metadata=()):
    """One RPC through a real grpc.aio server whose handler traces a real engine request."""
    engine = AsyncEngine(EngineThread(core))
    engine.start()
    # The caller gets an aborted RPC's status before the handler's finally has run: the
    # span is finished only once the handler says so, before the server stops.
    handled = asyncio.Event()

    async def handler(request: bytes, context) -> bytes:
        span = tracer.start_request(RPC, context.invocation_metadata())
        finals, error = [], None
        try:
            if request == b"bad":
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad prompt")
            params = SamplingParams(n=2, max_tokens=5, temperature=0.0, ignore_eos=True)
            async for event in await engine.submit("traced", list(request), params):
                if event.finished:
                    finals.append(event)
            return b"ok"
        except BaseException as exc:
            error = exc
            raise
        finally:
            span.finish(rpc_status(context, error), finals)
            handled.set()

    server = grpc.aio.server()
    methods = {"Run": grpc.unary_unary_rpc_method_handler(handler)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Echo", methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                await channel.unary_unary(f"/{RPC}")(request, metadata=metadata)
            except grpc.aio.AioRpcError:
                pass
        await asyncio.wait_for(handled.wait(), timeout=10)
    finally:
        await server.stop(0)
        engine.shutdown(timeout=5)
    tracer.shutdown()  # flushes the batch processor into the exporter


async def test_rpc_span_joins_the_callers_trace_with_ordered_phases(tracer, exporter, core):
    prompt = bytes(range(1, 11))  # 10 tokens, prefilled 4 a step: prefill spans 3 steps
    metadata = (("traceparent", TRACEPARENT), ("tracestate", "vendor=abc"))
    await serve_and_call(tracer, core, prompt, metadata)

    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == sorted([RPC, "queue", "prefill", "decode"])
    rpc = spans[RPC]
    assert rpc.kind is trace.SpanKind.SERVER
    assert rpc.context.trace_id == TRACE_ID
    assert rpc.parent.span_id == CALLER_SPAN_ID and rpc.parent.is_remote
    assert rpc.context.trace_state.get("vendor") == "abc"
    assert rpc.status.is_ok
    attrs = rpc.attributes
    assert attrs["pagedserve.request_id"] == "traced"
    assert attrs["gen_ai.request.choice.count"] == 2
    assert attrs["gen_ai.usage.input_tokens"] == 10
    assert attrs["gen_ai.usage.output_tokens"] == 10
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["length", "length"]
    assert attrs["rpc.method"] == "Run" and attrs["rpc.grpc.status_code"] == 0

    phases = [spans[name] for name in ("queue", "prefill", "decode")]
    for phase in phases:
        assert phase.context.trace_id == TRACE_ID
        assert phase.parent.span_id == rpc.context.span_id
        assert phase.end_time >= phase.start_time
    # Contiguous: each phase starts where the one before it ended.
    assert phases[0].end_time == phases[1].start_time
    assert phases[1].end_time == phases[2].start_time
    assert phases[1].end_time > phases[1].start_time and phases[2].end_time > phases[2].start_time
    # Inside the RPC span; the slack is float rounding of RequestTiming's seconds only.
    slack = 1_000
    assert rpc.start_time - slack <= phases[0].start_time
    assert phases[2].end_time <= rpc.end_time + slack


def test_a_wall_clock_step_mid_request_moves_no_span_out_of_its_rpc(
    tracer, exporter, core, monkeypatch
):
    # A wall clock NTP has stepped back a minute since the process started, and steps back
    # another minute while the request runs; for this module and for the OTel SDK alike.
    wall_lead_ns = [time.time_ns() - time.monotonic_ns() - 60 * 10**9]
    wall_clock = lambda: time.monotonic_ns() + wall_lead_ns[0]  # noqa: E731
    monkeypatch.setattr(time, "time_ns", wall_clock)
    monkeypatch.setattr(opentelemetry.sdk.trace, "time_ns", wall_clock)
    span = tracer.start_request(RPC, None)
    wall_lead_ns[0] -= 60 * 10**9
    core.add_request("stepped", list(range(100, 110)), SamplingParams(max_tokens=3))
    finals = []
    while core.has_unfinished_requests:
        finals += [e for e in core.step() if e.finished]
    span.finish(grpc.StatusCode.OK, finals)
    tracer.shutdown()

    spans = {s.name: s for s in exporter.get_finished_spans()}
    rpc, queue, decode = spans[RPC], spans["queue"], spans["decode"]
    assert rpc.start_time <= queue.start_time and decode.end_time <= rpc.end_time
    timing = finals[0].timing
    engine_ns = round((timing.finished - timing.arrival) * 1e9)
    assert abs((decode.end_time - queue.start_time) - engine_ns) <= 1_000


async def test_error_code_marks_the_span_and_no_context_starts_a_trace(tracer, exporter, core):
    await serve_and_call(tracer, core, b"bad")
    (span,) = exporter.get_finished_spans()  # no engine request: no phase spans
    assert span.name == RPC and span.parent is None
    assert span.status.status_code is trace.StatusCode.ERROR
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_only_reached_phases_are_recorded(tracer, exporter, core):
    params = SamplingParams(max_tokens=5, temperature=0.0)
    core.add_request("queued", [1, 2, 3], params)
    never_scheduled = core.abort_request("queued")
    core.add_request("prefilling", list(range(200, 210)), params)  # nothing cached
    core.step()  # the first 4 of 10 prompt tokens: scheduled, no token yet
    mid_prefill = core.abort_request("prefilling")
    for finals in (never_scheduled, mid_prefill):
        tracer.start_request(RPC, None).finish(grpc.StatusCode.CANCELLED, finals)
    tracer.shutdown()

    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == [RPC, "queue", RPC]
    assert all(s.status.status_code is trace.StatusCode.ERROR for s in spans if s.name == RPC)
    assert spans[1].parent.span_id == spans[2].context.span_id
    assert core.block_manager.num_used_blocks == 0


def test_tracing_off_records_nothing_and_leaves_the_global_provider(capsys):
    off = configure_tracing("none", None)
    span = off.start_request(RPC, (("traceparent", TRACEPARENT),))
    assert not off.enabled and span.span is None
    assert off.start_request(RPC, None) is span  # one shared inert span: nothing per request
    span.finish(grpc.StatusCode.INTERNAL)
    off.shutdown()

    console = configure_tracing("console", None)
    console.start_request(RPC, None).finish(grpc.StatusCode.OK)
    console.shutdown()
    assert f'"name": "{RPC}"' in capsys.readouterr().out
    # Our providers are private: the process-global one stays the no-op proxy.
    assert not isinstance(trace.get_tracer_provider(), TracerProvider)


def test_unknown_exporter_names_the_field():
    with pytest.raises(ValueError, match="trace_exporter") as err:
        configure_tracing("jaeger", None)
    assert isinstance(err.value, ValidationError) and err.value.field == "trace_exporter"
