"""The rules every front door (gRPC, REST) applies around a generation, in one place so
the doors agree: whether a warm engine takes work (loading and draining refuse it), whether
a request names the model served here, whether a caller holds the API key, how a call is
converted (service/convert.py) and queued, what a request id may be, which format the
model writes tool calls in, which calls are in flight for a drain to wait on, and what
log_requests writes."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Iterator, Sequence

from engine.errors import ValidationError
from engine.serving.async_engine import AsyncEngine
from engine.serving.request_stream import RequestStream
from engine.text.prompts import PromptEncoder
from engine.text.tool_use import detect_format
from service.convert import EngineInputs, engine_inputs, named_as_sent
from service.errors import ServiceUnavailable, UnknownModel
from service.kv_events import KvEventHub
from service.metrics import ServerMetrics
from service.request import GenerationRequest

# Prompts and outputs, at INFO, only with log_requests; nothing else logs request content.
request_log = logging.getLogger("service.requests")

# The largest request (and unary response) either door takes: gRPC's message limit.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

# A caller's request id is repeated in every message of its stream and quoted in errors and
# logs: bounded, and visible ASCII (no newline to forge a log line with).
MAX_REQUEST_ID_CHARS = 128

# The most of a caller's string an error message quotes.
MAX_QUOTED_CHARS = 64


def authorized(values: Sequence[str], api_key: str | None) -> bool:
    """Whether the Authorization values a caller sent (every one, in order) carry the key:
    exactly one, `Bearer <key>`. Always true when no key is set."""
    if api_key is None:
        return True
    if len(values) != 1:  # two would leave each door to pick one: neither does
        return False
    scheme, _, token = values[0].partition(" ")
    # Constant-time, so the answer's timing does not leak how much of a guess was right.
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    )


def unauthenticated_message(values: Sequence[str]) -> str:
    """Why authorized() refused these values, in the words of both doors."""
    if len(values) > 1:
        return f"authorization: exactly one value is allowed, got {len(values)}"
    return "authorization: missing or wrong API key (Bearer <key>)"


def check_request_id(request_id: str) -> None:
    """ValidationError unless request_id is 1 to MAX_REQUEST_ID_CHARS visible ASCII
    characters (! to ~). The message never quotes the id."""
    if not request_id:
        raise ValidationError("request_id", "must not be empty")
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValidationError(
            "request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}"
        )
    for i, char in enumerate(request_id):
        if not "!" <= char <= "~":
            raise ValidationError(
                "request_id", f"character {i} is U+{ord(char):04X}; use visible ASCII (! to ~)"
            )


def quoted(text: str) -> str:
    """A caller's string for an error message: repr'd, and cut short past MAX_QUOTED_CHARS,
    so that no message grows with what a caller sent."""
    if len(text) <= MAX_QUOTED_CHARS:
        return repr(text)
    return f"{text[:MAX_QUOTED_CHARS]!r}... ({len(text)} characters)"


class FrontDoor:
    """The serving state both doors read. Until a warm engine is attached (and again once
    draining) no door takes work, so a client retries elsewhere instead of waiting on a
    cold pod."""

    def __init__(
        self,
        log_requests: bool = False,
        tool_parser: str = "auto",
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        kv_events_endpoint: str | None = None,  # ServerConfig.kv_events_endpoint
    ) -> None:
        self.engine: AsyncEngine | None = None
        self.model_name = ""
        self.metrics = ServerMetrics(lambda: self.engine.stats if self.engine else None)
        self.draining = False
        self.fault: str | None = None  # the watchdog's: why the engine is stuck or dead
        self.log_requests = log_requests  # ServerConfig.log_requests
        self.tool_parser_setting = tool_parser  # ServerConfig.tool_parser
        self.max_message_bytes = max_message_bytes  # the largest request or answer
        # The engine's KV events, to whoever follows them; a ZMQ socket is taken here, so
        # a port in use fails the start.
        self.kv_events = KvEventHub(kv_events_endpoint)
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def attach(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name
        engine.kv_event_sink = self.kv_events.publish

    def ready_engine(self) -> AsyncEngine:
        """The engine, if it takes new work; ServiceUnavailable while loading or draining.
        Both doors ask here, so they refuse work at the same moments."""
        if self.draining:
            raise ServiceUnavailable("server is draining; retry elsewhere")
        if self.engine is None:
            raise ServiceUnavailable("model is still loading; retry later")
        return self.engine

    def check_model(self, name: str) -> None:
        """UnknownModel unless `name` is empty or the model served here."""
        if name and name != self.model_name:
            raise UnknownModel(
                f"model: {quoted(name)} is not served here (this server serves {self.model_name!r})"
            )

    def prompts(self, engine: AsyncEngine) -> PromptEncoder:
        """The prompt encoder of both doors, held to what the engine reports of itself."""
        return PromptEncoder.for_engine(engine.tokenizer, engine.info)

    def tool_parser(self, engine: AsyncEngine) -> str:
        """The format the served model writes tool calls in."""
        if self.tool_parser_setting != "auto":
            return self.tool_parser_setting
        return detect_format(engine.tokenizer.chat_template)

    def convert(self, engine: AsyncEngine, request: GenerationRequest) -> EngineInputs:
        """The engine's inputs for a call to the model served here (service/convert.py)."""
        self.check_model(request.model)
        return engine_inputs(request, self.prompts(engine), self.tool_parser(engine))

    async def submit(
        self,
        engine: AsyncEngine,
        request: GenerationRequest,
        inputs: EngineInputs,
        call_id: str,
        request_ids: list[str],
        door: str,
    ) -> list[RequestStream]:
        """One engine request per prompt, under request_ids, all queued at once; if one is
        refused, or the caller leaves while they queue, every one of them is cancelled.
        call_id: the call's id in the request log; door: where the call came in, for the
        engine's stats."""
        submits = [
            asyncio.ensure_future(
                engine.submit(request_id, prompt, inputs.params, request.priority, door)
            )
            for request_id, prompt in zip(request_ids, inputs.prompts, strict=True)
        ]
        try:
            with named_as_sent(request.field_names):
                streams = await asyncio.gather(*submits)
        except BaseException:
            for submit in submits:
                submit.cancel()  # one still waiting for admission takes its request back
            for outcome in await asyncio.gather(*submits, return_exceptions=True):
                if isinstance(outcome, RequestStream):
                    outcome.cancel()
            raise
        self.log_prompts(call_id, inputs.prompts)
        return streams

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation is in flight; False if the timeout came first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    @contextlib.contextmanager
    def in_flight_call(self) -> Iterator[None]:
        """Count a generation in flight, so a drain waits for it."""
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    def log_prompts(self, request_id: str, prompts: list[list[int]]) -> None:
        """The prompts of a request just queued, if log_requests; at any level, never else."""
        if self.log_requests and self.engine is not None:
            texts = [self.engine.tokenizer.decode(p) for p in prompts]
            request_log.info("%s: prompt %r", request_id, texts if len(texts) > 1 else texts[0])

    def log_outputs(self, request_id: str, outputs: list[str]) -> None:
        """The outputs of a request that ended (by any door), if log_requests."""
        if self.log_requests:
            request_log.info("%s: output %r", request_id, outputs)
