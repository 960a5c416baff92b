"""The Inference RPCs over the front door (service/front_door.py).

A call's path: parse into a GenerationRequest (service/grpc/messages.py) -> the front
door's convert and submit (errors answered by service/errors.py's table, never reaching
the engine) -> events written back. Leaving early, by client disconnect, RPC cancellation
or deadline, cancels the engine request, which returns all its KV blocks.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import grpc

from engine.errors import DuplicateRequest
from engine.outputs import CandidateEvent, FinishReason, RequestOutputBuilder
from engine.serving.async_engine import AsyncEngine
from engine.serving.request_stream import RequestStream, StreamOverflow
from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc
from service.answer import Answer
from service.convert import EngineInputs, named_as_sent, tokenize
from service.errors import INTERNAL, RETRY_AFTER_SECONDS, RequestFailed, TooLarge, status_of
from service.front_door import FrontDoor, check_request_id
from service.grpc import messages
from service.metrics import rpc_status
from service.request import GenerationRequest
from service.tls import caller_scope
from service.tool_calls import ToolCallReader
from service.tracing import RequestTracer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name


async def abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    """End the call with `exc`'s status (service/errors.py), its retry hint if it has one."""
    status = status_of(exc)
    if status.retry:
        retry_ms = str(int(RETRY_AFTER_SECONDS * 1000))
        context.set_trailing_metadata((("retry-after-ms", retry_ms),))
    message = _fault(exc) if status is INTERNAL else str(exc)
    await context.abort(status.grpc, message)


def _fault(exc: Exception) -> str:
    """An engine fault's message: the engine's own words for a request it failed."""
    return str(exc) if isinstance(exc, RequestFailed) else f"{type(exc).__name__}: {exc}"


class ObservedCalls:
    """What every gRPC service over the front door does around its calls: count each by
    outcome, trace it, and refuse work while no warm engine takes it (UNAVAILABLE)."""

    def __init__(
        self, door: FrontDoor, tracer: RequestTracer, service_name: str, metric_prefix: str = ""
    ) -> None:
        self.door = door
        self.tracer = tracer
        self.service_name = service_name
        self.metric_prefix = metric_prefix  # before each RPC's name in the request metric

    @contextlib.contextmanager
    def observed(self, rpc: str, context) -> Iterator[list[CandidateEvent]]:
        """Count the RPC by outcome and trace it; the caller appends the final events it saw."""
        span = self.tracer.start_request(
            f"{self.service_name}/{rpc}", context.invocation_metadata()
        )
        finals: list[CandidateEvent] = []
        error: BaseException | None = None
        try:
            yield finals
        except BaseException as exc:  # CancelledError too: the client left or its deadline passed
            error = exc
            raise
        finally:
            code = rpc_status(context, error)
            self.door.metrics.rpc_finished(self.metric_prefix + rpc, code)
            if finals:
                self.door.metrics.request_finished(finals)
            span.finish(code, finals)

    async def ready(self, context) -> AsyncEngine:
        try:
            return self.door.ready_engine()
        except Exception as exc:
            await abort(context, exc)

    async def submit_call(
        self,
        engine: AsyncEngine,
        context,
        request_id: str,
        parse: Callable[[], GenerationRequest],
        door: str,
        stop_rpc: str = "cancel",
    ) -> tuple[str, EngineInputs, RequestStream]:
        """Parse (parse()), convert and queue one call's request; aborts the RPC with its
        status on failure. Returns the caller's request id (one drawn where it sent none),
        the inputs, and the stream, which carries the engine's id (engine_request_id). The
        moment the RPC ends, however it ends (the client cancels, its deadline passes, its
        channel or process goes), the engine request is cancelled unless it finished: a
        unary call writes nothing until its end, so no failed write would tell. stop_rpc:
        what the service calls stopping a request, for the duplicate id's message."""
        request_id = request_id or uuid.uuid4().hex  # 122 random bits: unguessable
        engine_id = engine_request_id(caller_scope(context), request_id)
        try:
            check_request_id(request_id)
            call = parse()
            inputs = self.door.convert(engine, call)
            [stream] = await self.door.submit(engine, call, inputs, engine_id, [engine_id], door)
        except DuplicateRequest:  # the caller's own request with this id is running
            message = f"{request_id!r} is already running; {stop_rpc} it or pick another"
            await abort(context, DuplicateRequest("request_id", message))
        except Exception as exc:
            await abort(context, exc)
        context.add_done_callback(lambda _: stream.cancel())
        return request_id, inputs, stream


class InferenceService(ObservedCalls, inference_pb2_grpc.InferenceServicer):
    """The RPCs, behind the front door's rules: while no warm engine takes work (loading,
    draining) they answer UNAVAILABLE. The REST door shares the same front door."""

    def __init__(self, door: FrontDoor, tracer: RequestTracer) -> None:
        super().__init__(door, tracer, SERVICE_NAME)

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        with self.observed("Generate", context) as finals, self.door.in_flight_call():
            engine = await self.ready(context)
            answer, stream = await self._submit(engine, request, context, "grpc_unary")
            try:
                async for event in stream:  # leaving early, by any door, cancels the request
                    answer.add(0, event)
                    if event.finished:
                        finals.append(event)
                        await _abort_on_error(event, context)
            except StreamOverflow as exc:  # too far behind its events
                await abort(context, exc)
            finally:
                self.door.log_outputs(stream.request_id, answer.texts())
            response = messages.generate_response(answer, engine.tokenizer)
            advice = "ask for fewer candidates, tokens or logprobs, or use StreamGenerate"
            await self._check_size(response, context, advice)
            return response

    async def StreamGenerate(
        self, request: pb.GenerateRequest, context
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        with self.observed("StreamGenerate", context) as finals, self.door.in_flight_call():
            engine = await self.ready(context)
            answer, stream = await self._submit(engine, request, context, "grpc_stream")
            try:
                async for event in stream:  # leaving early, by any door, cancels the request
                    if event.finished:
                        finals.append(event)
                        await _abort_on_error(event, context)
                    if self.door.log_requests:
                        answer.add(0, event)
                    yield messages.stream_message(event, answer, engine.tokenizer)
            except StreamOverflow as exc:  # this client stopped reading; it alone fails
                await abort(context, exc)
            finally:
                self.door.log_outputs(stream.request_id, answer.texts())

    async def Cancel(self, request: pb.CancelRequest, context) -> pb.CancelResponse:
        with self.observed("Cancel", context):
            try:
                check_request_id(request.request_id)
            except Exception as exc:
                await abort(context, exc)
            engine = self.door.engine
            if engine is None:  # a draining server still cancels: that only frees work
                await context.abort(grpc.StatusCode.UNAVAILABLE, "model is still loading")
            # Only the caller's own requests: under mTLS another caller's equal id is another
            # engine request (engine_request_id), which this never names.
            request_id = engine_request_id(caller_scope(context), request.request_id)
            live = engine.is_running(request_id)
            engine.cancel(request_id)
            return pb.CancelResponse(cancelled=live)

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        with self.observed("Tokenize", context):
            engine = await self.ready(context)
            tokenizer = engine.tokenizer
            try:  # Generate's guard: text that cannot fit the context is refused unencoded
                prompt, field_names = messages.tokenize_prompt(request)
                with named_as_sent(field_names):
                    ids = tokenize(prompt, self.door.prompts(engine), request.add_special_tokens)
            except Exception as exc:
                await abort(context, exc)
            tokens = [tokenizer.id_to_token(i) or "" for i in ids]
            response = pb.TokenizeResponse(token_ids=ids, tokens=tokens)
            await self._check_size(response, context, "send shorter text")
            return response

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        with self.observed("GetModelInfo", context):
            engine = await self.ready(context)
            info = engine.info
            return pb.ModelInfo(
                name=self.door.model_name,
                architecture=info.architecture,
                max_context_length=info.max_model_len,
                vocab_size=info.vocab_size,
                eos_token_ids=info.eos_token_ids,
                kv_block_size=info.kv_block_size,
                kv_num_blocks=info.kv_num_blocks,
                kv_capacity_tokens=info.kv_capacity_tokens,
                has_chat_template=engine.tokenizer.has_chat_template,
            )

    async def _check_size(self, response, context, advice: str) -> None:
        """RESOURCE_EXHAUSTED naming the response when it is over max_message_bytes: else
        gRPC fails the send itself, after all the work, and logs a traceback."""
        limit = self.door.max_message_bytes
        if (size := response.ByteSize()) > limit:
            message = f"response: {size} bytes, over max_message_bytes ({limit}); {advice}"
            await abort(context, TooLarge(message))

    async def _submit(
        self, engine: AsyncEngine, request: pb.GenerateRequest, context, door: str
    ) -> tuple[Answer, RequestStream]:
        """Parse, convert and queue (submit_call); the answer to gather, under the caller's
        request id, and the stream."""
        request_id, inputs, stream = await self.submit_call(
            engine, context, request.request_id, lambda: messages.generation_request(request), door
        )
        output = RequestOutputBuilder.start(request_id, inputs.prompts[0], inputs.params.n)
        return Answer([output], inputs.params.n, ToolCallReader(inputs.tools)), stream


def engine_request_id(scope: str, request_id: str) -> str:
    """The engine's id for a caller's request id. Under mTLS each caller (client
    certificate) has its own ids: two callers may use the same one at once, and neither can
    cancel the other's. Without client certificates all callers are one principal: their ids
    are the engine's, so pick unguessable ones (or leave them to the server, uuid4)."""
    return f"{request_id}@{scope}" if scope else request_id


async def _abort_on_error(final: CandidateEvent, context) -> None:
    """A request the engine failed: INVALID_ARGUMENT where a field of it was at fault (a
    constraint whose grammar could not be followed), else INTERNAL, an engine fault; the
    engine serves on either way."""
    if final.finish_reason is FinishReason.ERROR:
        await abort(context, RequestFailed.of(final))
