"""`pagedserve serve` as a real child process for integration tests (a helper, not tests).

The server is driven only from outside: generated stubs over loopback gRPC, the health
service for readiness, and the Prometheus endpoint for what the engine holds.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from service.grpc.handlers import SERVICE_NAME


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape_metrics(url: str) -> dict[str, float]:
    """Every sample of a /metrics scrape, keyed `name{label="v",...}` (labels sorted)."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    grpc_port: int
    metrics_port: int
    log: tempfile._TemporaryFileWrapper  # stderr: a file, so a chatty server never blocks

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def metrics(self) -> dict[str, float]:
        return scrape_metrics(f"http://127.0.0.1:{self.metrics_port}/metrics")

    def settled_metrics(self, names: tuple[str, ...], quiet: float = 0.3) -> dict[str, float]:
        """A scrape once the given metrics stayed unchanged for `quiet` seconds: work that
        earlier tests left in flight (a cancelled stream's last step) is counted by then."""
        deadline = time.monotonic() + 10
        seen = self.metrics()
        while time.monotonic() < deadline:
            time.sleep(quiet)
            now = self.metrics()
            if all(now.get(name) == seen.get(name) for name in names):
                return now
            seen = now
        return seen

    def wait_for_metric(self, name: str, value: float, timeout: float = 10) -> float:
        """Poll until the metric equals value; returns the last value seen."""
        deadline = time.monotonic() + timeout
        while True:
            seen = self.metrics().get(name)
            if seen == value or time.monotonic() > deadline:
                return seen
            time.sleep(0.05)

    def health(self, service: str = SERVICE_NAME) -> int:
        with grpc.insecure_channel(self.target) as channel:
            request = health_pb2.HealthCheckRequest(service=service)
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=2).status

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.stderr()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"server not ready after {timeout} s: {self.stderr()}")
            time.sleep(0.1)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def start_server_process(
    model: Path, *args: str, env: dict[str, str] | None = None
) -> ServerProcess:
    """Start `pagedserve serve` on free loopback ports (not waiting for readiness), with env
    added to this process's environment."""
    grpc_port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "service.cli", "serve", "--model", str(model)]
    command += ["--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), *args]
    log = tempfile.TemporaryFile("w+")
    environment = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=log, text=True, env=environment
    )
    return ServerProcess(proc, grpc_port, metrics_port, log)


@contextlib.contextmanager
def running_server(
    model: Path, *args: str, env: dict[str, str] | None = None, ready_within: float = 120
) -> Iterator[ServerProcess]:
    """start_server_process's server once it is ready, killed when the block ends."""
    server = start_server_process(model, *args, env=env)
    try:
        server.wait_ready(ready_within)
        yield server
    finally:
        server.stop()


@dataclass
class RouterProcess:
    """The Shepherd Model Gateway (`smg launch`) in front of gRPC workers."""

    proc: subprocess.Popen
    port: int
    log: tempfile._TemporaryFileWrapper

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        """Until its readiness answers 200: a worker is healthy and the model's tokenizer,
        fetched from a worker, is loaded."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.base_url}/readiness", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass  # not listening yet, or not ready (503)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the router is not ready: {self.output()[-3000:]}")
            time.sleep(0.1)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_router(workers: list[ServerProcess], policy: str, *args: str) -> RouterProcess:
    """`smg launch` on a free loopback port with `workers` as grpc:// workers (it learns
    their kind, model and tokenizer from them), not waiting for readiness."""
    smg = Path(sys.executable).with_name("smg")
    port, prometheus_port = free_port(), free_port()
    command = [str(smg), "launch", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--worker-urls", *(f"grpc://{worker.target}" for worker in workers)]
    command += ["--policy", policy, "--prometheus-port", str(prometheus_port), *args]
    log = tempfile.TemporaryFile("w+")
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    return RouterProcess(proc, port, log)
