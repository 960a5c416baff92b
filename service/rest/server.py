"""The REST door's HTTP server: uvicorn on the gRPC server's event loop, without its own
signal handling (serve() owns SIGTERM), TLS from the gRPC port's files, and a deadline on
each request's head so a slowloris client cannot hold a connection."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.config import ServerConfig
from service.front_door import FrontDoor
from service.rest.app import create_app
from service.rest.calls import Calls
from service.tls import TlsFiles


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: serve() owns SIGTERM (drain, then stop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _ssl_options(tls: TlsFiles | None) -> dict[str, Any]:
    """uvicorn's TLS settings for the same files the gRPC port uses."""
    if tls is None:
        return {}
    options: dict[str, Any] = {"ssl_certfile": tls.cert_file, "ssl_keyfile": tls.key_file}
    if tls.mutual:
        options |= {"ssl_ca_certs": tls.client_ca_file, "ssl_cert_reqs": ssl.CERT_REQUIRED}
    return options


class _TimedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with deadlines: a client that has not sent all of a
    request's headers within head_timeout seconds of its first byte (or of the connection's
    opening) is disconnected, so a slowloris client cannot hold a connection. (A body's
    deadline is the app's: _Api.body.)

    A request answered before its body was read (a refusal: 401, 413) leaves the rest of
    the body on the connection, which HTTP/1.1 must read past to reach the next request;
    uvicorn reads and drops it for as long as it comes. Here it has head_timeout seconds
    from its first byte after the answer, then the connection is closed: a client without
    the key cannot stream into it without end. (Closing at once, or after a byte count,
    resets a client still sending an over-large body before it reads its 413.)"""

    def __init__(self, *args: Any, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout = head_timeout
        self._head_deadline: asyncio.TimerHandle | None = None
        self._drain_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a head begun and not yet whole
            self._await_head()
        elif self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY:
            # Answered: what comes is a refused body's rest.
            if self._drain_deadline is None:
                self._drain_deadline = self.loop.call_later(self.head_timeout, self._drain_late)
        elif self._drain_deadline is not None:  # that body ended in time
            self._drain_deadline.cancel()
            self._drain_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        for deadline in (self._head_deadline, self._drain_deadline):
            if deadline is not None:
                deadline.cancel()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(self.head_timeout, self._head_late)

    def _head_late(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def _drain_late(self) -> None:
        self._drain_deadline = None
        if not self.transport.is_closing():
            self.transport.close()


@dataclass
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task
    port: int
    calls: Calls

    async def stop(self) -> None:
        """End what the REST door still answers (each its 503), then stop listening."""
        await self.calls.close(timeout=1.0)
        self.server.should_exit = True
        await self.task


async def start_http(door: FrontDoor, config: ServerConfig) -> HttpServer:
    """Serve the REST app on the running loop, at config.http_bind_host:config.http_port;
    returns once it listens (port 0: any free port, the bound one is HttpServer.port). With
    TLS files, HTTPS; with their client CA, clients must present a certificate that chains
    to it. A client has http_read_timeout seconds to send a request's headers, and as long
    again for its body; a body may be as large as a gRPC message (max_message_bytes)."""
    host = config.http_bind_host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, config.http_port))
    read_timeout = config.http_read_timeout
    app = create_app(door, config.api_key, config.max_message_bytes, read_timeout)
    uvicorn_config = uvicorn.Config(
        app,
        http=functools.partial(_TimedH11Protocol, head_timeout=read_timeout),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=1,  # the drain has already waited for work in flight
        **_ssl_options(config.tls),
    )
    server = _Uvicorn(uvicorn_config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raises what stopped it
            raise RuntimeError("the REST server stopped while starting")
        await asyncio.sleep(0.01)
    return HttpServer(server, task, sock.getsockname()[1], app.state.calls)
