"""Python clients for pagedserve over the generated stubs: async and sync, same surface.

Both retry RESOURCE_EXHAUSTED (queue full) and UNAVAILABLE (starting, draining) with
exponential backoff, waiting at least the server's `retry-after-ms` hint. A streaming
call is retried only before its first message arrives, so no output is ever repeated.
With an api_key, every call carries `authorization: Bearer <key>` metadata, which a server
started with --api-key requires. With `tls=True` or a `ca_file` the channel is TLS (the
server's certificate checked against ca_file, or the system's CAs); `cert_file` and
`key_file` present a client certificate to a server that requires one (mTLS).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from types import ModuleType

import grpc

from pagedserve.v1 import inference_pb2 as pb
from pagedserve.v1 import inference_pb2_grpc

RETRYABLE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4  # tries in all, the first included
    initial_backoff: float = 0.1  # seconds; doubles each retry, with jitter
    max_backoff: float = 2.0

    def delay(self, attempt: int, error: grpc.RpcError) -> float:
        backoff = min(self.max_backoff, self.initial_backoff * 2**attempt)
        backoff *= 0.5 + random.random() / 2
        for key, value in error.trailing_metadata() or ():
            if key == "retry-after-ms":
                backoff = max(backoff, int(value) / 1000)
        return backoff

    def should_retry(self, attempt: int, error: grpc.RpcError) -> bool:
        return attempt + 1 < self.attempts and error.code() in RETRYABLE


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {api_key}"),) if api_key else None


def channel_credentials(
    tls: bool = False,
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
) -> grpc.ChannelCredentials | None:
    """TLS credentials from PEM files, or None for a plaintext channel (no TLS asked for)."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("cert_file and key_file go together (a client certificate and its key)")
    if not (tls or ca_file or cert_file):
        return None

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as f:
            return f.read()

    return grpc.ssl_channel_credentials(read(ca_file), read(key_file), read(cert_file))


def open_channel(
    grpc_module,  # grpc.aio or grpc: the async or the blocking channel
    target: str,
    tls: bool,
    ca_file: str | None,
    cert_file: str | None,
    key_file: str | None,
):
    credentials = channel_credentials(tls, ca_file, cert_file, key_file)
    if credentials is None:
        return grpc_module.insecure_channel(target)
    return grpc_module.secure_channel(target, credentials)


class _Connection:
    """What both clients hold: a channel of _grpc (grpc.aio or grpc) to target, its stub,
    the retry policy and the calls' auth metadata."""

    _grpc: ModuleType  # set by each client

    def __init__(
        self,
        target: str,
        retry: RetryPolicy = RetryPolicy(),
        api_key: str | None = None,
        *,
        tls: bool = False,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
    ):
        self._channel = open_channel(self._grpc, target, tls, ca_file, cert_file, key_file)
        self._stub = inference_pb2_grpc.InferenceStub(self._channel)
        self._retry = retry
        self._metadata = auth_metadata(api_key)


class AsyncInferenceClient(_Connection):
    _grpc = grpc.aio

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncInferenceClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def generate(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> pb.GenerateResponse:
        for attempt in range(self._retry.attempts):
            try:
                return await self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
            except grpc.aio.AioRpcError as error:
                if not self._retry.should_retry(attempt, error):
                    raise
                await asyncio.sleep(self._retry.delay(attempt, error))
        raise AssertionError("unreachable")

    async def stream(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> AsyncIterator[pb.GenerateStreamResponse]:
        for attempt in range(self._retry.attempts):
            received = False
            try:
                async for message in self._stub.StreamGenerate(
                    request, timeout=timeout, metadata=self._metadata
                ):
                    received = True
                    yield message
                return
            except grpc.aio.AioRpcError as error:
                if received or not self._retry.should_retry(attempt, error):
                    raise
                await asyncio.sleep(self._retry.delay(attempt, error))

    async def cancel(self, request_id: str, timeout: float | None = None) -> bool:
        """Whether a live request of this caller's had the id (and is now cancelled)."""
        request = pb.CancelRequest(request_id=request_id)
        answer = await self._stub.Cancel(request, timeout=timeout, metadata=self._metadata)
        return answer.cancelled

    async def tokenize(
        self, text: str, add_special_tokens: bool = True, timeout: float | None = None
    ) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        answer = await self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata)
        return list(answer.token_ids)

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        request = pb.GetModelInfoRequest()
        return await self._stub.GetModelInfo(request, timeout=timeout, metadata=self._metadata)


class InferenceClient(_Connection):
    """The blocking twin of AsyncInferenceClient, for scripts and threads."""

    _grpc = grpc

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def generate(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> pb.GenerateResponse:
        for attempt in range(self._retry.attempts):
            try:
                return self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
            except grpc.RpcError as error:
                if not self._retry.should_retry(attempt, error):
                    raise
                time.sleep(self._retry.delay(attempt, error))
        raise AssertionError("unreachable")

    def stream(
        self, request: pb.GenerateRequest, timeout: float | None = None
    ) -> Iterator[pb.GenerateStreamResponse]:
        for attempt in range(self._retry.attempts):
            received = False
            try:
                for message in self._stub.StreamGenerate(
                    request, timeout=timeout, metadata=self._metadata
                ):
                    received = True
                    yield message
                return
            except grpc.RpcError as error:
                if received or not self._retry.should_retry(attempt, error):
                    raise
                time.sleep(self._retry.delay(attempt, error))

    def cancel(self, request_id: str, timeout: float | None = None) -> bool:
        """Whether a live request of this caller's had the id (and is now cancelled)."""
        request = pb.CancelRequest(request_id=request_id)
        return self._stub.Cancel(request, timeout=timeout, metadata=self._metadata).cancelled

    def tokenize(
        self, text: str, add_special_tokens: bool = True, timeout: float | None = None
    ) -> list[int]:
        request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        answer = self._stub.Tokenize(request, timeout=timeout, metadata=self._metadata)
        return list(answer.token_ids)

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        request = pb.GetModelInfoRequest()
        return self._stub.GetModelInfo(request, timeout=timeout, metadata=self._metadata)
