"""The gateway door: the worker service a model-aware router drives, on the gRPC port beside
Inference.

The Shepherd Model Gateway (smg) tells a gRPC worker's kind by which service answers its
HealthCheck, and `sglang.grpc.scheduler.SglangScheduler` is the one it asks first; its
contract comes from the published protos (the smg-grpc-proto package). The router does the
text work itself: it fetches the model's tokenizer and chat template from the worker
(GetTokenizer), applies the template, tokenizes, parses tool calls and detokenizes. So a
Generate brings token ids and sampling parameters, and gets token ids back: a chunk of new
tokens per step where the caller streams, and a Complete per candidate.

It is one more door onto the same front door (service/front_door.py): the same queue, limits,
API key, metrics, drain, and a request cancelled the moment its call ends (the router
cancels the stream and sends Abort when its client leaves). The prefix cache's KV events
stream to the router's cache-aware policy (SubscribeKvEvents, from service/kv_events.py).
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import time
import zipfile
from collections.abc import AsyncIterator

import grpc
from google.protobuf import struct_pb2
from smg_grpc_proto.generated import common_pb2, sglang_scheduler_pb2_grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb

from engine.errors import ValidationError
from engine.kv.events import BlockRemoved, BlockStored
from engine.outputs import CandidateEvent, FinishReason, RequestOutputBuilder, TokenLogprob
from engine.structured.constraints import Constraint
from engine.text.tokenizer import Tokenizer
from service.convert import prompt_named
from service.errors import RequestFailed, ServiceUnavailable
from service.front_door import FrontDoor
from service.grpc.handlers import ObservedCalls, abort, engine_request_id
from service.kv_events import KvEventBatch, ResumeTooOld, SubscriberFellBehind
from service.request import GenerationRequest, Prompt
from service.tls import caller_scope
from service.tracing import RequestTracer

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SglangScheduler"].full_name
DOOR = "gateway"  # the engine's stats count this door's aborts under it
METRIC_PREFIX = "gateway/"  # its RPCs in the request metric: gateway/Generate, ...
TOKENIZER_CHUNK_BYTES = 64 * 1024
# The router's finish reasons: OpenAI's, plus "abort".
FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CONTEXT_LIMIT: "length",
    FinishReason.CANCELLED: "abort",
}
# The constraint oneof's fields -> the engine's kinds (SGLang's EBNF is GBNF, which the
# grammar compiler reads).
CONSTRAINTS = {"regex": "regex", "json_schema": "json_schema", "ebnf_grammar": "grammar"}


class GatewayWorkerService(ObservedCalls, sglang_scheduler_pb2_grpc.SglangSchedulerServicer):
    """The worker RPCs behind the front door's rules. Those a router may call that this
    engine has nothing for (Embed, FlushCache, profiling, LoRA adapters) stay UNIMPLEMENTED,
    which the router takes as "not offered"."""

    def __init__(self, door: FrontDoor, tracer: RequestTracer) -> None:
        super().__init__(door, tracer, SERVICE_NAME, METRIC_PREFIX)
        self.started = time.time()

    async def HealthCheck(self, request, context) -> pb.HealthCheckResponse:
        """Whether this worker takes work now: false while loading, draining or stuck (the
        router then sends it none), with why."""
        try:
            self.door.ready_engine()
        except ServiceUnavailable as exc:
            return pb.HealthCheckResponse(healthy=False, message=str(exc))
        if self.door.fault is not None:
            return pb.HealthCheckResponse(healthy=False, message=self.door.fault)
        return pb.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request, context) -> pb.GetModelInfoResponse:
        with self.observed("GetModelInfo", context):
            engine = await self.ready(context)
            info, tokenizer = engine.info, engine.tokenizer
            return pb.GetModelInfoResponse(
                # Where the model lives here: a router on another host finds no such path and
                # asks for the tokenizer (GetTokenizer) instead of fetching a hub id.
                model_path=info.model_path,
                is_generation=True,
                served_model_name=self.door.model_name,
                max_context_length=info.max_model_len,
                vocab_size=info.vocab_size,
                model_type=info.architecture,
                architectures=[info.architecture],
                eos_token_ids=list(info.eos_token_ids),
                bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else -1,
                max_req_input_len=info.max_model_len - 1,
            )

    async def GetServerInfo(self, request, context) -> pb.GetServerInfoResponse:
        with self.observed("GetServerInfo", context):
            engine = await self.ready(context)
            info = engine.info
            server_args = struct_pb2.Struct()
            server_args.update(
                {
                    "model_path": info.model_path,
                    "served_model_name": self.door.model_name,
                    "context_length": info.max_model_len,
                    "max_total_tokens": info.kv_capacity_tokens,
                    "page_size": info.kv_block_size,
                    "tp_size": 1,
                    "dp_size": 1,
                    "pp_size": 1,
                    "is_embedding": False,
                    "vocab_size": info.vocab_size,
                }
            )
            stats = engine.stats
            return pb.GetServerInfoResponse(
                server_args=server_args,
                active_requests=stats.num_running_requests if stats else 0,
                uptime_seconds=time.time() - self.started,
                server_type="pagedserve",
                max_total_num_tokens=info.kv_capacity_tokens,
            )

    async def GetLoads(self, request, context) -> pb.GetLoadsResponse:
        with self.observed("GetLoads", context):
            engine = await self.ready(context)
            stats, info = engine.stats, engine.info
            load = pb.SchedulerLoad(
                dp_rank=0,
                num_running_reqs=stats.num_running_requests,
                num_waiting_reqs=stats.num_waiting_requests,
                num_total_reqs=stats.num_running_requests + stats.num_waiting_requests,
                num_used_tokens=stats.num_kv_blocks_used * info.kv_block_size,
                max_total_num_tokens=info.kv_capacity_tokens,
                token_usage=stats.kv_cache_usage,
                cache_hit_rate=stats.prefix_cache_hit_rate,
            )
            now = datetime.datetime.now(datetime.timezone.utc).isoformat()
            return pb.GetLoadsResponse(timestamp=now, dp_rank_count=1, loads=[load])

    async def GetTokenizer(self, request, context) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        """The model's tokenizer files as one zip, in chunks; the last carries its SHA-256."""
        with self.observed("GetTokenizer", context):
            engine = await self.ready(context)
            bundle = tokenizer_bundle(engine.tokenizer)
            digest = hashlib.sha256(bundle).hexdigest()
            for start in range(0, len(bundle), TOKENIZER_CHUNK_BYTES):
                end = start + TOKENIZER_CHUNK_BYTES
                last = end >= len(bundle)
                yield common_pb2.GetTokenizerChunk(
                    data=bundle[start:end], sha256=digest if last else ""
                )

    async def Generate(self, request: pb.GenerateRequest, context) -> AsyncIterator:
        with self.observed("Generate", context) as finals, self.door.in_flight_call():
            engine = await self.ready(context)
            request_id, inputs, stream = await self.submit_call(
                engine,
                context,
                request.request_id,
                lambda: generation_request(request),
                DOOR,
                stop_rpc="abort",
            )
            output = RequestOutputBuilder.start(request_id, inputs.prompts[0], inputs.params.n)
            async for event in stream:  # leaving early, by any door, cancels the request
                output.add(event)
                if request.stream and event.token_ids:
                    chunk = stream_chunk(event, output)
                    yield pb.GenerateResponse(request_id=request_id, chunk=chunk)
                if event.finished:
                    finals.append(event)
                    if event.finish_reason is FinishReason.ERROR:
                        await abort(context, RequestFailed.of(event))
                    complete = completion(event, output)
                    yield pb.GenerateResponse(request_id=request_id, complete=complete)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        """Cancel the caller's own request of this id; an unknown or finished one is no
        error (the router aborts whatever its client left, maybe just after it ended)."""
        with self.observed("Abort", context):
            engine = self.door.engine
            if engine is None:
                return pb.AbortResponse(success=False, message="model is still loading")
            request_id = engine_request_id(caller_scope(context), request.request_id)
            live = engine.is_running(request_id)
            engine.cancel(request_id, DOOR)  # the router's word that its client left
            return pb.AbortResponse(success=live, message="aborted" if live else "not running")

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        """The prefix cache's KV events from the batch after start_sequence_number (0: from
        the next one). OUT_OF_RANGE where those batches are gone (the subscriber clears its
        view of this worker and subscribes from 0); DATA_LOSS where it read too slowly."""
        with self.observed("SubscribeKvEvents", context):
            try:
                subscription = self.door.kv_events.subscribe(request.start_sequence_number)
            except ResumeTooOld as exc:
                await context.abort(grpc.StatusCode.OUT_OF_RANGE, str(exc))
            # Headers at once: the subscriber knows it is subscribed before any event.
            await context.send_initial_metadata(())
            try:
                async for batch in subscription:
                    yield kv_event_batch(batch)
            except SubscriberFellBehind as exc:
                await context.abort(grpc.StatusCode.DATA_LOSS, str(exc))


def stream_chunk(event: CandidateEvent, output: RequestOutputBuilder) -> pb.GenerateStreamChunk:
    """A step's new tokens of one candidate, with its counts so far."""
    return pb.GenerateStreamChunk(
        token_ids=event.token_ids,
        prompt_tokens=len(output.prompt_token_ids),
        completion_tokens=len(output.token_ids[event.index]),
        output_logprobs=output_logprobs(event.logprobs),
        input_logprobs=input_logprobs(event.prompt_logprobs),
        index=event.index,
    )


def completion(final: CandidateEvent, output: RequestOutputBuilder) -> pb.GenerateComplete:
    """A candidate's whole answer, on its final event."""
    usage, index = final.usage, final.index
    complete = pb.GenerateComplete(
        output_ids=output.token_ids[index],
        finish_reason=FINISH_REASONS[final.finish_reason],
        prompt_tokens=usage.prompt_tokens if usage else len(output.prompt_token_ids),
        completion_tokens=len(output.token_ids[index]),
        cached_tokens=usage.cached_tokens if usage else 0,
        output_logprobs=output_logprobs(output.outputs[index].logprobs),
        input_logprobs=input_logprobs(final.prompt_logprobs),
        index=index,
    )
    if isinstance(final.matched_stop, str):
        complete.matched_stop_str = final.matched_stop
    elif isinstance(final.matched_stop, int):
        complete.matched_token_id = final.matched_stop
    return complete


def generation_request(request: pb.GenerateRequest) -> GenerationRequest:
    """A worker Generate as the door-neutral request; errors name its fields."""
    params = request.sampling_params
    if request.HasField("mm_inputs") or request.input_embeds:
        raise ValidationError("mm_inputs", "this worker serves text models: send token ids")
    if params.logit_bias:
        raise ValidationError("sampling_params.logit_bias", "is not supported")
    if request.return_logprob and request.logprob_start_len > 0:
        raise ValidationError(
            "logprob_start_len", "prompt logprobs start at 0 or are off (-1); got a later start"
        )
    sampling: dict[str, object] = {
        "n": params.n or 1,
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repetition_penalty": params.repetition_penalty,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        # Unset: up to the context, as an OpenAI chat without max_tokens asks.
        "max_tokens": params.max_new_tokens if params.HasField("max_new_tokens") else None,
        "min_tokens": params.min_new_tokens,
        "stop": params.stop,
        "stop_token_ids": params.stop_token_ids,
        "ignore_eos": params.ignore_eos,
        "include_stop_str_in_output": params.no_stop_trim,
        "skip_special_tokens": params.skip_special_tokens,
    }
    if request.return_logprob:
        sampling["logprobs"] = request.top_logprobs_num
        if request.logprob_start_len == 0:
            sampling["prompt_logprobs"] = request.top_logprobs_num
    names = {name: f"sampling_params.{name}" for name in sampling}
    names.update(
        n="sampling_params.n",
        max_tokens="sampling_params.max_new_tokens",
        min_tokens="sampling_params.min_new_tokens",
        include_stop_str_in_output="sampling_params.no_stop_trim",
        logprobs="top_logprobs_num",
        prompt_logprobs="top_logprobs_num",
        **prompt_named("tokenized.input_ids"),
    )
    return GenerationRequest(
        prompts=[Prompt(token_ids=request.tokenized.input_ids)],
        sampling=sampling,
        constraint=_constraint(params),
        field_names=names,
    )


def _constraint(params: pb.SamplingParams) -> Constraint | None:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    field = f"sampling_params.{kind}"
    if kind not in CONSTRAINTS:
        raise ValidationError(field, "is not supported; use json_schema, regex or ebnf_grammar")
    return Constraint(CONSTRAINTS[kind], getattr(params, kind), field=field)


def output_logprobs(logprobs: list[TokenLogprob] | None) -> pb.OutputLogProbs | None:
    if not logprobs:
        return None
    return pb.OutputLogProbs(
        token_logprobs=[lp.logprob for lp in logprobs],
        token_ids=[lp.token_id for lp in logprobs],
        top_logprobs=[_top(lp) for lp in logprobs],
    )


def input_logprobs(logprobs: list[TokenLogprob | None] | None) -> pb.InputLogProbs | None:
    if not logprobs:
        return None
    return pb.InputLogProbs(
        token_logprobs=[
            pb.InputTokenLogProb(value=lp.logprob) if lp else pb.InputTokenLogProb()
            for lp in logprobs
        ],
        token_ids=[lp.token_id if lp else 0 for lp in logprobs],
        top_logprobs=[_top(lp) if lp else pb.TopLogProbs() for lp in logprobs],
    )


def _top(logprob: TokenLogprob) -> pb.TopLogProbs:
    return pb.TopLogProbs(
        values=[value for _, value in logprob.top], token_ids=[i for i, _ in logprob.top]
    )


def tokenizer_bundle(tokenizer: Tokenizer) -> bytes:
    """The files a router builds the model's tokenizer from, zipped flat: tokenizer.json
    (a GGUF's vocabulary exported), tokenizer_config.json with the chat template and the
    special tokens, and generation_config.json with the ids that end a generation."""
    config = {
        **tokenizer.special_tokens,
        "chat_template": tokenizer.chat_template,
        "add_bos_token": tokenizer.add_bos,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    generation = {"eos_token_id": list(tokenizer.eos_token_ids)}
    if tokenizer.bos_token_id is not None:
        generation["bos_token_id"] = tokenizer.bos_token_id
    files = {
        "tokenizer.json": tokenizer.backend.to_str(),
        "tokenizer_config.json": json.dumps({k: v for k, v in config.items() if v is not None}),
        "generation_config.json": json.dumps(generation),
    }
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
        for name, text in files.items():
            bundle.writestr(name, text)
    return buffer.getvalue()


def kv_event_batch(batch: KvEventBatch) -> common_pb2.KvEventBatch:
    """A batch of KV events as the gateway's stream carries them: a stored run becomes one
    block per block_size tokens, chained on the run's parent."""
    events = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            size = event.block_size
            blocks = [
                common_pb2.KvBlock(
                    block_hash=block_hash,
                    token_ids=event.token_ids[i * size : (i + 1) * size],
                    block_size=size,
                )
                for i, block_hash in enumerate(event.block_hashes)
            ]
            stored = common_pb2.KvBlocksStored(
                blocks=blocks, parent_block_hash=event.parent_block_hash
            )
            events.append(common_pb2.KvCacheEvent(stored=stored))
        elif isinstance(event, BlockRemoved):
            removed = common_pb2.KvBlocksRemoved(block_hashes=event.block_hashes)
            events.append(common_pb2.KvCacheEvent(removed=removed))
        else:
            events.append(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))
    return common_pb2.KvEventBatch(
        sequence_number=batch.sequence_number, timestamp=batch.timestamp, events=events
    )
