"""What every gRPC call passes before its handler: the API key, then a request that
parses. Each refusal is counted in the request metric as the handlers count theirs."""

from __future__ import annotations

import grpc
from google.protobuf import message_factory
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from engine.errors import ValidationError
from pagedserve.v1 import inference_pb2 as pb
from service.front_door import authorized, unauthenticated_message
from service.grpc import gateway, messages
from service.metrics import ServerMetrics


def rpc_label(method: str) -> str:
    """A method's name in the request metric, as its service's handlers count it."""
    service, _, name = method.rpartition("/")
    return gateway.METRIC_PREFIX + name if service == f"/{gateway.SERVICE_NAME}" else name


async def refuse(
    metrics: ServerMetrics, rpc: str, context, code: grpc.StatusCode, message: str
) -> None:
    """Abort a call in an interceptor, before its handler runs: counted in the RPC metric
    as the handlers count their own outcomes."""
    metrics.rpc_finished(rpc, code)
    await context.abort(code, message)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls without exactly one `authorization: Bearer <key>` metadata
    entry (front_door.authorized, the REST door's rule too); health checks and reflection
    stay open, so Kubernetes probes and grpcurl need no key. Refusals are counted in the
    RPC metric (refuse())."""

    OPEN_SERVICES = (f"/{health.SERVICE_NAME}/", f"/{reflection.SERVICE_NAME}/")

    def __init__(self, api_key: str, metrics: ServerMetrics) -> None:
        self.api_key = api_key
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.OPEN_SERVICES):
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        values = [value for key, value in metadata if key == "authorization"]
        if authorized(values, self.api_key):
            return handler

        async def deny(request, context):
            rpc = rpc_label(handler_call_details.method)
            message = unauthenticated_message(values)
            await refuse(self.metrics, rpc, context, grpc.StatusCode.UNAUTHENTICATED, message)

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        return make(
            deny,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


# The services whose requests are parsed here, by the path prefix of their methods.
PARSED_SERVICES = {
    f"/{service.full_name}": service
    for service in (
        pb.DESCRIPTOR.services_by_name["Inference"],
        gateway.pb.DESCRIPTOR.services_by_name["SglangScheduler"],
    )
}


class ParseInterceptor(grpc.aio.ServerInterceptor):
    """Inference and gateway requests whose bytes do not parse (a string that is not UTF-8, a corrupt
    wire format) get INVALID_ARGUMENT naming the field; grpc.aio would answer UNKNOWN.
    Counted in the RPC metric (refuse())."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        service, _, name = handler_call_details.method.rpartition("/")
        if handler is None or service not in PARSED_SERVICES:
            return handler
        method = PARSED_SERVICES[service].methods_by_name[name]
        message_type = message_factory.GetMessageClass(method.input_type)

        async def parsed(data: bytes, context):
            try:
                return messages.parse(message_type, data)
            except ValidationError as exc:
                await refuse(
                    self.metrics,
                    rpc_label(handler_call_details.method),
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    str(exc),
                )

        async def unary(data: bytes, context):
            return await handler.unary_unary(await parsed(data, context), context)

        async def stream(data: bytes, context):
            async for message in handler.unary_stream(await parsed(data, context), context):
                yield message

        if handler.response_streaming:
            make, behavior = grpc.unary_stream_rpc_method_handler, stream
        else:
            make, behavior = grpc.unary_unary_rpc_method_handler, unary
        return make(behavior, response_serializer=handler.response_serializer)
