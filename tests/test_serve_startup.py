"""What a user meets starting `pagedserve serve`, as a real child process: where each port
binds (the metrics endpoint and the REST shim follow `host` unless set), the one line that
says the server is up, and a clean exit when it cannot start.

A socket bound to 127.0.0.1 refuses connections to 127.0.0.2 (both loopback on Linux), one
bound to 0.0.0.0 accepts them: that tells from outside where a port listens.
"""

from __future__ import annotations

import socket
import time

import pytest

from tests.server_process import free_port, start_server_process
from tests.tiny_models import write_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("startup-tiny"), "llama")


def accepts(host: str, port: int) -> bool:
    """Whether something listening takes a TCP connection to host:port."""
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


def wait_listening(host: str, port: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not accepts(host, port):
        assert time.monotonic() < deadline, f"nothing listens on {host}:{port}"
        time.sleep(0.1)


def test_metrics_and_rest_bind_the_default_host_loopback_only(tiny_model):
    """No host given: gRPC, /metrics and REST all on 127.0.0.1, none on other addresses."""
    http_port = free_port()
    server = start_server_process(tiny_model, "--http-port", str(http_port))
    try:
        server.wait_ready(timeout=120)
        for port in (server.grpc_port, server.metrics_port, http_port):
            assert accepts("127.0.0.1", port)
            assert not accepts("127.0.0.2", port), f"port {port} listens beyond loopback"
    finally:
        server.stop()


def test_metrics_and_rest_follow_host_unless_set(tiny_model):
    """--host 127.0.0.2: /metrics and REST bind there too; --metrics-host overrides."""
    http_port = free_port()
    server = start_server_process(tiny_model, "--host", "127.0.0.2", "--http-port", str(http_port))
    try:
        for port in (server.grpc_port, server.metrics_port, http_port):
            wait_listening("127.0.0.2", port)  # all three listen before the model loads
            assert not accepts("127.0.0.1", port), port
    finally:
        server.stop()
    server = start_server_process(tiny_model, "--host", "127.0.0.2", "--metrics-host", "127.0.0.1")
    try:
        wait_listening("127.0.0.1", server.metrics_port)
        assert not accepts("127.0.0.2", server.metrics_port)
    finally:
        server.stop()
