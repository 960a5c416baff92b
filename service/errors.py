"""The one table of how an error is answered: its gRPC status, its HTTP status and OpenAI
error type, and whether it carries a retry hint. Both doors answer from it, and the
request metric counts every call by its gRPC code, whichever door it came by."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from engine.errors import DuplicateRequest, EngineError, EngineOverloaded, ValidationError
from engine.outputs import CandidateEvent
from engine.serving.async_engine import EngineStopped
from engine.serving.request_stream import StreamOverflow

RETRY_AFTER_SECONDS = 0.25  # the retry hint: gRPC's retry-after-ms; HTTP rounds up to 1 s


class ServiceUnavailable(EngineError):
    """No warm engine to take new work: still loading, or draining. Retry elsewhere."""


class UnknownModel(EngineError):
    """The request names a model this server does not serve."""


class Unauthenticated(EngineError):
    """The caller did not send the API key."""


class TooLarge(EngineError):
    """A request or its answer is over max_message_bytes."""


class ReadTimeout(EngineError):
    """A request's body did not arrive within its deadline."""


class RequestFailed(EngineError):
    """The engine failed a request it had taken: `field` names the part of the request at
    fault (a constraint whose grammar could not be followed); None: an engine fault."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field

    @classmethod
    def of(cls, event: CandidateEvent) -> RequestFailed:
        return cls(event.error or "engine error", event.error_field)


@dataclass(frozen=True)
class Status:
    """How each door answers one kind of error."""

    grpc: grpc.StatusCode
    http: int
    openai_type: str  # the OpenAI envelope's `type`
    openai_code: str | None = None  # and its `code`
    retry: bool = False  # the answer carries a retry hint


OK = Status(grpc.StatusCode.OK, 200, "")
INVALID = Status(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")
UNAUTHENTICATED = Status(
    grpc.StatusCode.UNAUTHENTICATED, 401, "authentication_error", "invalid_api_key"
)
NOT_FOUND = Status(grpc.StatusCode.NOT_FOUND, 404, "invalid_request_error", "model_not_found")
READ_TIMEOUT = Status(
    grpc.StatusCode.DEADLINE_EXCEEDED, 408, "invalid_request_error", "body_timeout"
)
DUPLICATE = Status(grpc.StatusCode.ALREADY_EXISTS, 409, "invalid_request_error", "duplicate_id")
TOO_LARGE = Status(
    grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "invalid_request_error", "body_too_large"
)
OVERLOADED = Status(
    grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", "queue_full", retry=True
)
FELL_BEHIND = Status(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")
UNAVAILABLE = Status(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", "unavailable")
INTERNAL = Status(grpc.StatusCode.INTERNAL, 500, "internal_error", "engine_error")
# The caller left: nobody reads the answer. 499, nginx's "client closed request", in logs.
CLIENT_LEFT = Status(grpc.StatusCode.CANCELLED, 499, "")
_STATUSES: dict[type[Exception], Status] = {
    # DuplicateRequest is a ValidationError; the most specific class is looked up first.
    DuplicateRequest: DUPLICATE,
    ValidationError: INVALID,
    Unauthenticated: UNAUTHENTICATED,
    UnknownModel: NOT_FOUND,
    ReadTimeout: READ_TIMEOUT,
    TooLarge: TOO_LARGE,
    EngineOverloaded: OVERLOADED,
    StreamOverflow: FELL_BEHIND,
    ServiceUnavailable: UNAVAILABLE,
    EngineStopped: UNAVAILABLE,
}


def status_of(exc: BaseException) -> Status:
    """How `exc` is answered; an error no row names is an internal one."""
    if isinstance(exc, RequestFailed):
        return INTERNAL if exc.field is None else INVALID
    for kind in type(exc).__mro__:
        if kind in _STATUSES:
            return _STATUSES[kind]
    return INTERNAL


def field_of(exc: BaseException) -> str | None:
    """The request field an error is about, if it names one."""
    if isinstance(exc, ValidationError):
        return exc.field
    if isinstance(exc, RequestFailed):
        return exc.field
    if isinstance(exc, UnknownModel):
        return "model"
    if isinstance(exc, TooLarge | ReadTimeout):
        return "body"
    return None
