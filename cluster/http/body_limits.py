"""Bounds on a request body, enforced before the app reads it (docs/serving.md#limits).

Size: a body declared larger than `max_bytes` (Content-Length) is answered 413 at once, before
any byte of it is read; a chunked body is cut off with a 413 as soon as the bytes received pass
the bound. Time: the whole body must arrive within `timeout_s` of the request's start, else
408, so a client that trickles its body (or stops sending half way) cannot hold a request slot
and a connection for ever. Either answer closes the connection (`Connection: close`): the rest
of that body was never read, so the connection cannot carry another request. Every other
answer leaves a keep-alive connection usable, the body having been read whole.

Plain ASGI, not BaseHTTPMiddleware (which sits between a streamed response and the client
and can hide a disconnect from the route).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI
from starlette.exceptions import HTTPException

from cluster.http.errors import OpenAIError
from engine.errors import ParameterError, check_int

# Why 32 MiB: the largest bodies a client legitimately sends are images as base64 data URLs
# (limit_mm_per_prompt, 4 by default, of a few MiB each, grow by 4/3 in base64) and long
# prompts (a 128k-token context is ~0.5 MiB of text, ~1 MiB as token ids). 32 MiB holds four
# 6 MiB photos with room to spare, while it bounds what one request makes the ingress hold
# (the body, then its parsed JSON, several times larger). uvicorn, which vLLM and Serve run,
# sets no bound of its own.
MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
# Why 60 s: a 32 MiB body then needs ~0.5 MiB/s (4.5 Mbit/s); a chat body of a few KiB gets a
# minute for what takes milliseconds. Slower is a stalled or hostile client.
REQUEST_BODY_TIMEOUT_S = 60.0
_CLOSE = {"Connection": "close"}


@dataclass(frozen=True)
class BodyLimits:
    max_bytes: int = MAX_REQUEST_BODY_BYTES
    timeout_s: float = REQUEST_BODY_TIMEOUT_S

    def __post_init__(self) -> None:
        check_int("max_request_body_bytes", self.max_bytes)
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 3600:
            raise ParameterError("request_body_timeout_s",
                                 f"request_body_timeout_s must be in (0, 3600], got {self.timeout_s!r}")

    def too_large(self, size: int, declared: bool) -> BodyRejected:
        what = f"is {size} bytes (its Content-Length)" if declared else f"is over {self.max_bytes} bytes"
        return BodyRejected(413, f"the request body {what}; at most {self.max_bytes} bytes are accepted "
                                 "(--max-request-body-bytes)")

    def too_slow(self) -> BodyRejected:
        return BodyRejected(408, f"the request body did not arrive within {self.timeout_s:g} s of the "
                                 "request's start")


class BodyRejected(HTTPException):
    """An HTTPException, so FastAPI's body reading lets it through (it turns any other error
    there into a 400) and the app's handler answers it in OpenAI's shape, closing the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status, message, headers=dict(_CLOSE))


def declared_length(scope) -> int | None:
    """The Content-Length header's value; None without one (a chunked body). The HTTP server
    has already refused a malformed one."""
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class _Body:
    """`receive` for the app: counts the body's bytes and bounds the time it takes to arrive.
    Once the body is complete it passes every message through unbounded (a streaming response
    listens on it for the client's disconnect)."""

    def __init__(self, receive, limits: BodyLimits) -> None:
        self._receive, self.limits = receive, limits
        self.deadline = asyncio.get_running_loop().time() + limits.timeout_s
        self.received = 0
        self.complete = False

    async def receive(self):
        if self.complete:
            return await self._receive()
        left = self.deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(left, 0.0))
        except asyncio.TimeoutError:
            raise self.limits.too_slow() from None
        if message["type"] != "http.request":  # the client left: nothing more to bound
            self.complete = True
            return message
        self.received += len(message.get("body", b""))
        if self.received > self.limits.max_bytes:
            raise self.limits.too_large(self.received, declared=False)
        self.complete = not message.get("more_body", False)
        return message


class _BodyLimitMiddleware:
    def __init__(self, app, current: Callable[[], BodyLimits | None]) -> None:
        self.app, self.current = app, current

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.current() or BodyLimits()
        size = declared_length(scope)
        if size is not None and size > limits.max_bytes:
            err = limits.too_large(size, declared=True)
            await OpenAIError(err.status_code, err.detail, headers=err.headers).response()(scope, receive, send)
            return
        await self.app(scope, _Body(receive, limits).receive, send)


def install_body_limits(app: FastAPI, current: Callable[[], BodyLimits | None]) -> None:
    """`current()` returns the limits in force (set when the ingress replica starts; None:
    the defaults). Added last, so it runs first: before the API key check and any route."""
    app.add_middleware(_BodyLimitMiddleware, current=current)
