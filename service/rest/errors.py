"""The REST door's errors in OpenAI's envelope, {"error": {"message", "type", "param",
"code"}}, each status from service/errors.py's table: 400 validation, 401 API key, 404
unknown model, 408 a body not sent in time, 409 a request id already running, 413 body over
max_message_bytes, 429 queue full (Retry-After), 503 loading, draining or shutting down,
500 engine fault."""

from __future__ import annotations

import math
from typing import Any

from fastapi.responses import JSONResponse

from service.errors import (
    INTERNAL,
    RETRY_AFTER_SECONDS,
    UNAVAILABLE,
    RequestFailed,
    Status,
    field_of,
    status_of,
)


class ApiError(Exception):
    """An error answered in OpenAI's envelope, with its status from the table."""

    def __init__(
        self,
        status: Status,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.status.openai_type,
                "param": self.param,
                "code": self.status.openai_code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status.http, headers=self.headers)


def api_error(exc: Exception) -> ApiError:
    """The REST face of what preparing, submitting or running a call can raise."""
    if isinstance(exc, ApiError):
        return exc
    status = status_of(exc)
    headers = None
    if status.retry:  # HTTP's Retry-After counts whole seconds
        headers = {"Retry-After": str(math.ceil(RETRY_AFTER_SECONDS))}
    message = str(exc)
    if status is INTERNAL and not isinstance(exc, RequestFailed):
        message = f"{type(exc).__name__}: {exc}"
    return ApiError(status, message, field_of(exc), headers)


def closing_error() -> ApiError:
    return ApiError(UNAVAILABLE, "server is shutting down; retry elsewhere")
