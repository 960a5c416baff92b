"""The pace a normal caller sees while an attack runs (a helper, not tests).

A child process of its own (so the attacking client's work in the test process never
slows it) sends, one after another, a normal 8-token Generate over gRPC and, beside it, a
readiness health check every 0.1 s, timing each. `PaceProbe` runs it for the time an
attack runs; `measure_pace` runs it alone first, for the baseline the attack is held to:

    baseline = measure_pace(server.target, seconds=3)  # api_key= for a server with one
    with PaceProbe(server.target) as probe:
        attack()
    probe.pace.assert_kept(baseline)

Run directly it prints the pace it measured as JSON:

    python -m tests.reliability.pace 127.0.0.1:50051 --seconds 5 [--api-key KEY]
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name
NORMAL_TOKENS = 8
HEALTH_EVERY = 0.1
MAX_P50_RATIO = 2.0  # a normal request's p50 under attack, over its p50 alone
MAX_HEALTH_SECONDS = 0.5  # the slowest health check under attack
# A health check slower than this counts as unanswered (k8s' default probe timeout is 1 s).
HEALTH_TIMEOUT = 2.0


@dataclass
class Pace:
    """What the probe timed: each normal request's seconds (None: it failed) and each
    health check's (None: no SERVING answer within HEALTH_TIMEOUT)."""

    request_seconds: list[float | None]
    health_seconds: list[float | None]

    @property
    def p50(self) -> float:
        answered = [s for s in self.request_seconds if s is not None]
        return statistics.median(answered) if answered else float("inf")

    @property
    def slowest_health(self) -> float:
        answered = [s for s in self.health_seconds if s is not None]
        missed = len(answered) < len(self.health_seconds) or not answered
        return float("inf") if missed else max(answered)

    def describe(self) -> str:
        failed = self.request_seconds.count(None)
        return (
            f"{len(self.request_seconds)} normal requests, p50 {self.p50 * 1e3:.0f} ms, "
            f"{failed} failed; {len(self.health_seconds)} health checks, slowest "
            f"{self.slowest_health * 1e3:.0f} ms"
        )

    def assert_kept(self, baseline: Pace, max_p50_ratio: float = MAX_P50_RATIO) -> None:
        """The promise: under attack a normal request keeps its p50 within max_p50_ratio of
        the baseline's, none fails, and every health check answers SERVING within
        MAX_HEALTH_SECONDS."""
        report = f"under attack: {self.describe()}; alone: {baseline.describe()}"
        assert self.request_seconds, f"no normal request finished during the attack; {report}"
        assert None not in self.request_seconds, report
        assert self.p50 <= max_p50_ratio * baseline.p50, report
        assert self.slowest_health <= MAX_HEALTH_SECONDS, report


class PaceProbe:
    """The probe process, from `with` to its end; its Pace is `pace` after the block."""

    def __init__(self, target: str, api_key: str | None = None) -> None:
        self.target = target
        self.api_key = api_key
        self.pace: Pace | None = None

    def __enter__(self) -> PaceProbe:
        command = [sys.executable, "-m", "tests.reliability.pace", self.target]
        if self.api_key is not None:
            command += ["--api-key", self.api_key]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        # It says "ready" once its channels are connected and its first request answered,
        # so the attack starts against a probe already measuring.
        ready = self.proc.stdout.readline().strip()
        if ready != "ready":
            self.proc.kill()
            raise RuntimeError(f"the pace probe did not start: {ready!r}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.proc.send_signal(signal.SIGINT)  # finish the request in hand, then report
        out, _ = self.proc.communicate(timeout=60)
        self.pace = Pace(**json.loads(out))


def measure_pace(target: str, seconds: float, api_key: str | None = None) -> Pace:
    """The pace of an unattacked server over `seconds`."""
    with PaceProbe(target, api_key) as probe:
        time.sleep(seconds)
    return probe.pace


def _probe(target: str, stop: threading.Event, api_key: str | None) -> Pace:
    pace = Pace([], [])
    metadata = (("authorization", f"Bearer {api_key}"),) if api_key is not None else None
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=[5, 17, 42, 9, 33, 71]),
        sampling=pb.SamplingOptions(temperature=0.0),
        stopping=pb.StoppingOptions(max_tokens=NORMAL_TOKENS, ignore_eos=True),
    )
    check = health_pb2.HealthCheckRequest(service=SERVICE_NAME)

    def health_loop() -> None:
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    status = stub.Check(check, timeout=HEALTH_TIMEOUT).status
                    took = time.perf_counter() - started
                    ok = status == health_pb2.HealthCheckResponse.SERVING
                    pace.health_seconds.append(took if ok else None)
                except grpc.RpcError:
                    pace.health_seconds.append(None)
                stop.wait(max(0.0, HEALTH_EVERY - (time.perf_counter() - started)))

    with grpc.insecure_channel(target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        stub.Generate(request, timeout=60, metadata=metadata)  # connected and warm first
        print("ready", flush=True)
        health = threading.Thread(target=health_loop)
        health.start()
        while not stop.is_set():
            started = time.perf_counter()
            try:
                stub.Generate(request, timeout=60, metadata=metadata)
                pace.request_seconds.append(time.perf_counter() - started)
            except grpc.RpcError:
                pace.request_seconds.append(None)
        health.join()
    return pace


def main() -> None:
    parser = argparse.ArgumentParser(description="time normal requests and health checks")
    parser.add_argument("target")
    parser.add_argument("--seconds", type=float, default=None, help="unset: until SIGINT")
    parser.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if args.seconds is not None:
        threading.Timer(args.seconds, stop.set).start()
    pace = _probe(args.target, stop, args.api_key)
    print(
        json.dumps({"request_seconds": pace.request_seconds, "health_seconds": pace.health_seconds})
    )


if __name__ == "__main__":
    main()
