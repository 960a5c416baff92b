"""What a user meets starting `pagedserve serve`, as a real child process: where each port
binds (the metrics endpoint and the REST shim follow `host` unless set), the one line that
says the server is up, and a clean exit when it cannot start.

A socket bound to 127.0.0.1 refuses connections to 127.0.0.2 (both loopback on Linux), one
bound to 0.0.0.0 accepts them: that tells from outside where a port listens.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest

from tests.server_process import ServerProcess, free_port, start_server_process
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


def wait_for_line(server: ServerProcess, text: str, timeout: float = 2) -> list[str]:
    """The server's stderr lines once one contains text; fails after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        lines = server.stderr().splitlines()
        if any(text in line for line in lines):
            return lines
        assert time.monotonic() < deadline, f"no line with {text!r} in:\n{server.stderr()}"
        time.sleep(0.05)


def test_serve_says_in_one_line_where_it_listens_what_it_serves_and_how_fast(tiny_model):
    """At the default log level (WARNING): one line, within moments of readiness, naming the
    model, every port and the time to ready; the other INFO logs stay off."""
    http_port, health_port = free_port(), free_port()
    ports = ("--http-port", str(http_port), "--health-port", str(health_port))
    server = start_server_process(tiny_model, *ports)
    try:
        server.wait_ready(timeout=120)
        lines = wait_for_line(server, "ready in")
        assert len(lines) == 1, lines
        (line,) = lines
        assert line.startswith(f"INFO pagedserve: serving {tiny_model.name} "), line
        for part in (
            f"gRPC 127.0.0.1:{server.grpc_port}",
            f"REST 127.0.0.1:{http_port}",
            f"metrics 127.0.0.1:{server.metrics_port}",
            f"health 127.0.0.1:{health_port}",
        ):
            assert part in line, line
        assert re.search(r"ready in \d+\.\d\d s", line), line
    finally:
        server.stop()


@pytest.mark.parametrize("doors", [(), ("--metrics-port", "0", "--http-port", "0")])
def test_a_model_that_cannot_load_is_one_error_line_and_exit_2(tmp_path, doors):
    """The server listens before the model loads; a model that fails stops it cleanly: the
    error, nothing after it (no warning from a server left open), exit 2."""
    missing = tmp_path / "no-such-model"
    command = [sys.executable, "-m", "service.cli", "serve", "--model", str(missing)]
    command += ["--grpc-port", "0", *doors]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"pagedserve: error: --model '{missing}' is not a local path (no such file or "
        "directory), not a Hugging Face repo id (org/name[@revision]) and not a known alias "
        "(known: smollm2-135m-instruct)"
    ], done.stderr
