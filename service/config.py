"""The server's settings (service/settings.py reads them from flags, a file and the
environment), checked when made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import ValidationError
from engine.text.tool_use import TOOL_FORMATS
from service.front_door import MAX_MESSAGE_BYTES
from service.tls import TlsFiles, check_tls_files
from service.tracing import TRACE_EXPORTERS


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_queued_requests: int = 1024  # the engine's bounded request queue
    mailbox_size: int = 256  # events a candidate may have unread before its stream fails
    # The engine loop in a child process (None: on for CUDA, where the loop's host work
    # and the server's per-token writes each need a core), else on a thread.
    engine_process: bool | None = None
    drain_seconds: float = 30.0  # grace for in-flight requests after SIGTERM
    # Work outstanding and no step finished for this long: the loop is stuck, and health
    # is NOT_SERVING until it steps again. Far above any one step (a long prefill).
    engine_stall_seconds: float = 60.0
    metrics_host: str | None = None  # None: host's
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off
    trace_exporter: str = "none"  # none | console | otlp
    otlp_endpoint: str | None = None  # e.g. http://collector:4317 (otlp only)
    http_host: str | None = None  # None: host's
    http_port: int | None = None  # the OpenAI-compatible REST shim; None: off
    # Seconds a REST client has to send a request's headers, and again its body.
    http_read_timeout: float = 30.0
    # Callers must send "Authorization: Bearer <key>" (REST header, gRPC metadata); None: off.
    api_key: str | None = field(default=None, repr=False)  # never in logs
    # TLS on the gRPC port and the REST shim (PEM files); with a client CA, mTLS: callers
    # must present a certificate that chains to it. Files are checked here, at config time.
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    # A plaintext gRPC port with only the health service, for probes that cannot do TLS
    # (Kubernetes' grpc probe); None: health only on grpc_port.
    health_port: int | None = None
    log_requests: bool = False  # prompts and outputs in the log (logger service.requests)
    # The format the model writes tool calls in: auto (from its chat template) or one of
    # engine/text/tool_use.py's TOOL_FORMATS.
    tool_parser: str = "auto"
    # The prefix cache's KV events over ZMQ (service/kv_events.py): the endpoint a PUB
    # socket binds (tcp://*:5557) or connects to (tcp://picker:5557); None: not published.
    kv_events_endpoint: str | None = None
    kv_events_topic: str | None = None  # None: kv@<host name>@<served model name>

    def __post_init__(self) -> None:
        for name in ("grpc_port", "metrics_port", "http_port", "health_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValidationError(name, f"must be a port in [0, 65535], got {port}")
        if not 1 <= self.max_message_bytes <= 2**31 - 1:
            raise ValidationError(
                "max_message_bytes", f"must be in [1, 2**31 - 1], got {self.max_message_bytes}"
            )
        for name in ("max_queued_requests", "mailbox_size"):
            if getattr(self, name) < 1:
                raise ValidationError(name, f"must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.drain_seconds < math.inf:
            raise ValidationError(
                "drain_seconds", f"must be a finite number >= 0, got {self.drain_seconds}"
            )
        if not 0 < self.http_read_timeout < math.inf:
            raise ValidationError(
                "http_read_timeout", f"must be a finite number > 0, got {self.http_read_timeout}"
            )
        if not 0 < self.engine_stall_seconds < math.inf:
            raise ValidationError(
                "engine_stall_seconds",
                f"must be a finite number > 0, got {self.engine_stall_seconds}",
            )
        if self.tool_parser not in ("auto", *TOOL_FORMATS):
            raise ValidationError(
                "tool_parser",
                f"must be auto or one of {', '.join(TOOL_FORMATS)}, got {self.tool_parser!r}",
            )
        if self.trace_exporter not in TRACE_EXPORTERS:
            raise ValidationError(
                "trace_exporter",
                f"must be one of {', '.join(TRACE_EXPORTERS)}, got {self.trace_exporter!r}",
            )
        for name in ("host", "metrics_host", "http_host"):
            if getattr(self, name) == "":
                raise ValidationError(name, "must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ValidationError("api_key", "must not be empty or blank")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            missing = "tls_key_file" if self.tls_key_file is None else "tls_cert_file"
            raise ValidationError(missing, "must be set too: TLS needs a certificate and its key")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValidationError(
                "tls_client_ca_file", "needs tls_cert_file and tls_key_file (mTLS is TLS too)"
            )
        if self.tls_cert_file is not None:
            check_tls_files(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)

    @property
    def metrics_bind_host(self) -> str:
        """Where /metrics listens: metrics_host, else where gRPC does."""
        return self.host if self.metrics_host is None else self.metrics_host

    @property
    def http_bind_host(self) -> str:
        """Where the REST shim listens: http_host, else where gRPC does."""
        return self.host if self.http_host is None else self.http_host

    @property
    def tls(self) -> TlsFiles | None:
        """The TLS files of both the gRPC port and the REST shim; None: plaintext."""
        if self.tls_cert_file is None:
            return None
        return TlsFiles(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
