"""What a hostile or careless REST client sends costs it alone, on `pagedserve serve`.

Each attack runs against a real server process while a probe in a process of its own
(tests/reliability/pace.py) times a normal 8-token request and the readiness check: the
promise is that under attack the normal request keeps its p50 within 2x of the
unattacked one (for bodies of wrong values, within 1.5x of its pace beside a client
sending valid bodies as large: the bytes' own cost) and health answers within 0.5 s. And
each attack gets its own answer:

- bodies near the 16 MiB limit whose entries all have the wrong type, or hold a million
  dictionary entries, are refused at their first wrong value (400 naming it), without the
  server holding its loop or growing its memory by more than a few times the body's size;
- bodies from a client without the API key are refused before they are read (401), and
  what of them follows the refusal is read for http_read_timeout at most;
- a completion of many prompts whose caller hangs up stops all its work at once;
- headers or a body trickled in (slowloris) are cut off within http_read_timeout;
- two Authorization headers are refused, whichever holds the key.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

import httpx2 as httpx
import psutil
import pytest

from tests.reliability.pace import PaceProbe, measure_pace
from tests.server_process import ServerProcess, free_port, running_server
from tests.tiny_models import write_tiny_model

T = TypeVar("T")
API_KEY = "hostile-rest-key"
AUTH = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
READ_TIMEOUT = 2.0  # the server's http_read_timeout
BODY_BYTES = 15 * 1024 * 1024  # each attack body: near the 16 MiB message limit
# Peak resident growth while a body is refused, as a multiple of the body's size: the bytes
# themselves, and what was built of them before the first wrong value.
MAX_RSS_GROWTH = 4
# Moving 15 MB bodies through the server is itself work the normal request shares the
# cores with (on a slow machine about 0.1 s a body, back to back: the unattacked pace
# doubled before a byte was refused), so a wrong body is held to the pace beside an
# ordinary client sending valid bodies as large: what is left is the refusal's own cost.
MAX_ATTACK_RATIO = 1.5
ATTACK_SECONDS = 4.0  # an attack goes on at least this long: the probe's window


def attack_rounds(attacks: list[T]) -> Iterator[T]:
    """The attacks one after another, all of them at least once, again and again until
    ATTACK_SECONDS have passed (so the probe times enough normal requests meanwhile)."""
    until = time.monotonic() + ATTACK_SECONDS
    yield from attacks
    while time.monotonic() < until:
        yield from attacks


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("hostile-rest"), "llama")


@pytest.fixture(scope="module")
def served(tiny_model):
    """A server with REST and an API key: (process, REST port). It runs torch on one thread,
    as the other paced tests do: the attacking client shares this machine's cores, and two
    OpenMP threads spin at every barrier while it holds one, which alone took the normal
    request's p50 from 14 ms to 39 ms with no attack bytes reaching the loop."""
    http_port = free_port()
    with running_server(
        tiny_model,
        "--http-port", str(http_port),
        "--api-key", API_KEY,
        "--http-read-timeout", str(READ_TIMEOUT),
        "--max-queued-requests", "4096",
        "--max-num-seqs", "16",
        env={"PAGEDSERVE_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"},
    ) as server:  # fmt: skip
        yield server, http_port


def filled(template: str, piece: str) -> bytes:
    """template with its {} filled by comma-joined copies of piece, up to BODY_BYTES."""
    count = (BODY_BYTES - len(template)) // (len(piece) + 1)
    return template.replace("{}", ",".join([piece] * count)).encode()


# A valid completion as large as an attack body: a one-token answer, its 15 MB in `user`.
NEIGHBOUR_BODY = filled('{"prompt": "x", "max_tokens": 1, "user": "{}"}', "a")
# (what it is, body, the field its refusal names)
WRONG_BODIES = [
    ("lists of strings where token ids go", filled('{"prompt": [{}]}', json.dumps(["x"] * 1000)), "prompt.0.0"),
    ("empty lists where prompts go", filled('{"prompt": [{}]}', "[]"), "prompt"),
    ("a million wrong logit_bias values", filled('{"prompt": "x", "logit_bias": {{}}}', '"1": "a"'), "logit_bias"),
    ("a million logit_bias floats", filled('{"prompt": "x", "logit_bias": {{}}}', '"1": 1.5'), "logit_bias"),
    ("a schema of a million properties", filled('{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"properties": {{}}}}}}', '"p": {"type": "string"}'), "response_format.json_schema.schema"),
    ("a million stop strings", filled('{"prompt": "x", "stop": [{}]}', '"s"'), "stop"),
]  # fmt: skip


class PeakRss:
    """The highest resident size of a process (and its children) while `with` runs."""

    def __init__(self, pid: int) -> None:
        process = psutil.Process(pid)
        # Found once: finding children walks every process on the machine, and doing it
        # every 5 ms would load the cores the server and the pace probe share.
        self.processes = [process, *process.children(recursive=True)]
        self.peak = self.start = self.rss()

    def rss(self) -> int:
        return sum(p.memory_info().rss for p in self.processes)

    def __enter__(self) -> PeakRss:
        self.running = True
        self.thread = threading.Thread(target=self._sample)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.005)

    def __exit__(self, *exc_info: object) -> None:
        self.running = False
        self.thread.join()


def test_bodies_of_wrong_or_huge_values_are_refused_at_once(served):
    server, http_port = served
    url = f"http://127.0.0.1:{http_port}/v1/completions"
    with httpx.Client(timeout=60) as http:
        with PaceProbe(server.target, API_KEY) as beside_neighbour:
            for body in attack_rounds([NEIGHBOUR_BODY]):
                with PeakRss(server.proc.pid):  # the sampler's own load, as in the attack
                    response = http.post(url, content=body, headers=AUTH)
                assert response.status_code == 200, response.text[:300]
        refusals = []
        with PaceProbe(server.target, API_KEY) as probe:
            for label, body, field in attack_rounds(WRONG_BODIES):
                with PeakRss(server.proc.pid) as rss:
                    started = time.monotonic()
                    response = http.post(url, content=body, headers=AUTH)
                    took = time.monotonic() - started
                error = response.json()["error"]
                refusals.append(
                    (label, took, (rss.peak - rss.start) / len(body), error["message"][:80])
                )
                assert response.status_code == 400, (label, response.text[:300])
                assert error["param"] == field, (label, error)
                assert error["message"].startswith(f"{field}: "), (label, error)
                assert rss.peak - rss.start <= MAX_RSS_GROWTH * len(body), refusals[-1]
    report = "\n".join(
        f"{label}: {took:.2f} s, peak RSS +{growth:.1f}x, {m}"
        for label, took, growth, m in refusals
    )
    neighboured = beside_neighbour.pace
    print(f"{report}\nbeside valid bodies: {neighboured.describe()}")
    print(f"under attack: {probe.pace.describe()}")
    probe.pace.assert_kept(neighboured, max_p50_ratio=MAX_ATTACK_RATIO)


def keyless_attack(url: str) -> list[int]:
    """Four keyless posts of a body near the limit at once, each from a client of its own,
    again and again for ATTACK_SECONDS: their statuses."""
    body = filled('{"prompt": [{}]}', "[]")

    async def keyless() -> int:
        async with httpx.AsyncClient(timeout=60) as http:
            headers = {"content-type": "application/json"}
            return (await http.post(url, content=body, headers=headers)).status_code

    async def four_at_once() -> list[int]:
        return await asyncio.gather(*(keyless() for _ in range(4)))

    return [status for _ in attack_rounds([None]) for status in asyncio.run(four_at_once())]


def test_a_client_without_the_key_is_refused_before_its_body_is_read(served):
    """The app reads none of it (the connection drops what follows the 401: the next test
    bounds that). The attacker runs in a process of its own at the lowest priority: it
    stands for a client on another machine (beside the server it would take one of this
    machine's two cores for itself, and halve the normal request's pace whatever the
    server did)."""
    server, http_port = served
    baseline = measure_pace(server.target, 3, API_KEY)
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, spawn, initializer=os.nice, initargs=(19,)) as attacker:
        # Started, with this module imported there, before the probe's window opens.
        attacker.submit(filled, "{}", "").result()
        with PaceProbe(server.target, API_KEY) as probe:
            url = f"http://127.0.0.1:{http_port}/v1/completions"
            statuses = attacker.submit(keyless_attack, url).result()
    assert statuses and set(statuses) == {401}, statuses
    print(f"{len(statuses)} refused\nalone: {baseline.describe()}")
    print(f"under attack: {probe.pace.describe()}")
    probe.pace.assert_kept(baseline)


def test_the_rest_of_a_refused_body_is_read_no_longer_than_the_read_timeout(served):
    """After a refusal sent before its body was read, what the client goes on sending is
    read and dropped (so that a client still sending gets its answer, not a reset), but
    only for http_read_timeout: an endless body, sent as fast as it goes or trickled, is
    cut off then."""
    _, http_port = served
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    chunk = b"10000\r\n" + b"[" * 0x10000 + b"\r\n"
    sock = socket.create_connection(("127.0.0.1", http_port))
    sock.sendall(head)
    sock.settimeout(READ_TIMEOUT)
    assert sock.recv(100).startswith(b"HTTP/1.1 401 "), "refused at its head"
    started = time.monotonic()
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        while time.monotonic() - started < 3 * READ_TIMEOUT:
            sock.sendall(chunk)
    cut_after = time.monotonic() - started
    sock.close()
    assert READ_TIMEOUT - 0.5 < cut_after < READ_TIMEOUT + 1.0, cut_after

    sock = socket.create_connection(("127.0.0.1", http_port))
    sock.sendall(head)
    sock.settimeout(READ_TIMEOUT)
    assert sock.recv(100).startswith(b"HTTP/1.1 401 ")
    body_bytes = itertools.repeat(b"1\r\n[\r\n", round(3 * READ_TIMEOUT / 0.1))  # 3x the timeout
    closed_after = seconds_until_closed(sock, body_bytes)
    sock.close()
    assert closed_after is not None and closed_after < READ_TIMEOUT + 1.0, closed_after


def test_two_authorization_headers_are_refused(served):
    _, http_port = served
    url = f"http://127.0.0.1:{http_port}/v1/models"
    for headers in (
        [("authorization", f"Bearer {API_KEY}"), ("authorization", "Bearer wrong")],
        [("authorization", "Bearer wrong"), ("authorization", f"Bearer {API_KEY}")],
        [("authorization", f"Bearer {API_KEY}"), ("authorization", f"Bearer {API_KEY}")],
    ):
        response = httpx.get(url, headers=headers)
        assert response.status_code == 401, (headers, response.text)
        assert "exactly one" in response.json()["error"]["message"]
    assert httpx.get(url, headers=[("authorization", f"Bearer {API_KEY}")]).status_code == 200


def wait_until_idle(server: ServerProcess, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = server.metrics()
        if not (
            metrics["pagedserve_num_requests_running"] or metrics["pagedserve_num_requests_waiting"]
        ):
            return
        time.sleep(0.05)
    raise AssertionError(f"still busy after {timeout} s")


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("leave_after", [0.05, 0.5], ids=["while-submitting", "while-running"])
def test_a_caller_of_many_prompts_who_hangs_up_stops_all_its_work(served, stream, leave_after):
    server, http_port = served
    wait_until_idle(server)
    body = {
        "prompt": [[5 + i % 50, 9, 13] for i in range(256)],
        "n": 8,
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0.8,
        "stream": stream,
    }
    sock = socket.create_connection(("127.0.0.1", http_port))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {API_KEY}\r\ncontent-length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    time.sleep(leave_after)
    busy = server.metrics()
    sock.close()
    time.sleep(1.0)
    after_one_second = server.metrics()
    time.sleep(2.0)
    after_three_seconds = server.metrics()
    tokens = "pagedserve_generation_tokens_total"
    report = {
        "while there": {k: busy[k] for k in ("pagedserve_num_requests_running", "pagedserve_num_requests_waiting")},
        "tokens 1 s after": after_one_second[tokens],
        "tokens 3 s after": after_three_seconds[tokens],
    }  # fmt: skip
    for name in (
        "pagedserve_num_requests_running",
        "pagedserve_num_requests_waiting",
        "pagedserve_kv_cache_blocks_used",
    ):
        assert after_one_second[name] == 0, (name, report)
    assert after_three_seconds[tokens] == after_one_second[tokens], report


def test_headers_trickled_in_are_cut_off(served):
    _, http_port = served
    sock = socket.create_connection(("127.0.0.1", http_port))
    trickle = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: " + b"a" * 200
    closed_after = seconds_until_closed(sock, (bytes([byte]) for byte in trickle))  # 25 s in all
    sock.close()
    assert closed_after is not None, "the server kept a trickling client's connection"
    assert closed_after <= READ_TIMEOUT + 1.0, closed_after


def seconds_until_closed(sock: socket.socket, pieces: Iterable[bytes]) -> float | None:
    """Send the pieces one each 0.1 s until the server closes the connection: how long
    that took, or None if it stayed open through all of them."""
    started = time.monotonic()
    for piece in pieces:
        try:
            if _closed(sock):
                return time.monotonic() - started
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - started
        time.sleep(0.1)
    return None


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _closed(sock: socket.socket) -> bool:
    """The server closed its end (what it sent before is left unread)."""
    try:
        return _readable(sock) and sock.recv(1, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def test_a_body_trickled_in_gets_408(served):
    _, http_port = served
    sock = socket.create_connection(("127.0.0.1", http_port))
    sock.settimeout(READ_TIMEOUT * 5)
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"authorization: Bearer {API_KEY}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body[:1])
    started = time.monotonic()
    answer = b""
    for byte in body[1:]:
        if _readable(sock):
            answer = sock.recv(65536)
            break
        sock.sendall(bytes([byte]))
        time.sleep(0.2)
    took = time.monotonic() - started
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert took <= READ_TIMEOUT + 1.0, took


def test_a_stream_longer_than_the_drain_ends_with_an_error_then_done(tmp_path):
    model = write_tiny_model(tmp_path, "llama", max_position_embeddings=8192)
    http_port = free_port()
    with running_server(model, "--http-port", str(http_port), "--drain-seconds", "1") as server:
        body = {"prompt": [5, 9], "max_tokens": 8000, "ignore_eos": True, "stream": True}
        url = f"http://127.0.0.1:{http_port}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=60) as response:
            events = (line for line in response.iter_lines() if line.startswith("data: "))
            next(events)  # streaming
            server.proc.send_signal(signal.SIGTERM)
            rest = list(events)
        assert server.proc.wait(30) == 0, server.stderr()
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"], error
    assert "Exception in ASGI application" not in server.stderr(), server.stderr()[-2000:]
