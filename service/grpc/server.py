"""The gRPC door: a grpc.aio server with the Inference service (service/grpc/handlers.py),
the gateway's worker service (service/grpc/gateway.py), health (liveness "" and readiness
of the Inference service) and reflection, behind the interceptors (service/grpc/interceptors.py); optionally a plaintext health-only port for
probes that cannot do TLS."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc

from pagedserve.v1 import inference_pb2_grpc
from service.config import ServerConfig
from service.front_door import FrontDoor
from service.grpc import gateway
from service.grpc.handlers import SERVICE_NAME, InferenceService
from service.grpc.interceptors import ApiKeyInterceptor, ParseInterceptor
from service.tls import TlsFiles, read_pem
from service.tracing import RequestTracer

KEEPALIVE_MS = 20_000  # ping an idle connection this often; no answer this long: it is gone
# grpc.aio takes arriving calls off the event loop one at a time; those not taken yet wait
# in grpc core, which by default sheds them once 1,000 wait (every one at 3,000), each with
# a bare CANCELLED that no handler sees: a burst of thousands lost most of its calls so.
# The front door answers overload itself (the queue bound: RESOURCE_EXHAUSTED with
# retry-after-ms, counted), so every call must reach it: core never sheds.
UNBOUNDED_PENDING_CALLS = 2**31 - 1
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class GrpcServer:
    """The started gRPC door: liveness SERVING at once, readiness NOT_SERVING until told."""

    server: grpc.aio.Server
    health: health.aio.HealthServicer
    service: InferenceService
    port: int
    health_server: grpc.aio.Server | None = None  # plaintext, health only; None when off
    health_port: int | None = None

    async def set_health(self, readiness: bool, liveness: bool = True) -> None:
        await self.health.set(SERVICE_NAME, SERVING if readiness else NOT_SERVING)
        await self.health.set("", SERVING if liveness else NOT_SERVING)

    async def stop(self) -> None:
        await self.server.stop(None)
        if self.health_server is not None:
            await self.health_server.stop(None)


async def start_grpc(config: ServerConfig, door: FrontDoor, tracer: RequestTracer) -> GrpcServer:
    """Listen on config.host:config.grpc_port (0: any free port), TLS if configured."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        # A client that vanishes without closing its connection (its host gone, a network
        # cut) stops answering pings: its calls end then, and with them their requests.
        ("grpc.keepalive_time_ms", KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_MS),
        ("grpc.server.max_pending_requests", UNBOUNDED_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", UNBOUNDED_PENDING_CALLS),
    ]
    interceptors = []
    if config.api_key is not None:
        interceptors.append(ApiKeyInterceptor(config.api_key, door.metrics))
    interceptors.append(ParseInterceptor(door.metrics))  # innermost: a refused key never parses
    server = grpc.aio.server(options=options, interceptors=interceptors)
    service = InferenceService(door, tracer)
    inference_pb2_grpc.add_InferenceServicer_to_server(service, server)
    worker = gateway.GatewayWorkerService(door, tracer)
    sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(worker, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = (SERVICE_NAME, gateway.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(services, server)
    address = f"{config.host}:{config.grpc_port}"
    if config.tls is not None:
        port = server.add_secure_port(address, server_credentials(config.tls))
    else:
        port = server.add_insecure_port(address)
    await server.start()
    started = GrpcServer(server, health_servicer, service, port)
    if config.health_port is not None:  # the same servicer: one status, two doors
        started.health_server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, started.health_server)
        address = f"{config.host}:{config.health_port}"
        started.health_port = started.health_server.add_insecure_port(address)
        await started.health_server.start()
    await started.set_health(readiness=False)
    return started


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """TLS from PEM files; with a client CA, client certificates are required and must
    chain to it (the handshake fails without one)."""
    return grpc.ssl_server_credentials(
        [(read_pem(tls.key_file), read_pem(tls.cert_file))],
        root_certificates=read_pem(tls.client_ca_file) if tls.mutual else None,
        require_client_auth=tls.mutual,
    )
