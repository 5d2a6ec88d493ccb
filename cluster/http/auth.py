"""API keys: `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) on every route but
/health (load balancers probe it without one), and /metrics too unless --metrics-without-key. Deny by default: a route added
later, the OpenAPI pages and a path that matches no route all need the key, so no route is
open by being forgotten. The path checked is the one the app routes on: under a Serve
`route_prefix` other than `/` the request's path starts with the prefix (Starlette routes on
the path less `root_path`), and it is taken off before the check.

Keys are configured with `--api-key` (repeatable) or PDSERVE_API_KEY (comma-separated). The
ingress only ever holds their SHA-256 digests — the plaintext is not in the Serve config, its
logs or /status — and compares digests in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable

from fastapi import FastAPI

from cluster.http import openai_format as fmt
from cluster.http.openai_models import ErrorResponse

ENV_VAR = "PDSERVE_API_KEY"
OPEN_PATHS = ("/health",)


def keys_from(flags: Iterable[str] | None, environ: dict | None = None) -> tuple[str, ...]:
    """The configured keys: the flags' and the environment variable's, blanks dropped."""
    env = (environ if environ is not None else os.environ).get(ENV_VAR, "")
    keys = [k.strip() for k in [*(flags or []), *env.split(",")]]
    return tuple(dict.fromkeys(k for k in keys if k))


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeyCheck:
    def __init__(self, digests: Iterable[str], metrics_without_key: bool = False) -> None:
        self.digests = tuple(digests)
        self.open_paths = OPEN_PATHS + (("/metrics",) if metrics_without_key else ())

    @property
    def enabled(self) -> bool:
        return bool(self.digests)

    def allows(self, authorization: str | None) -> bool:
        if not self.enabled:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        presented = digest(token.strip())
        # Every digest is compared (no early exit), each in constant time.
        return sum(hmac.compare_digest(presented, d) for d in self.digests) > 0


def route_path(scope) -> str:
    """The path the app routes on: the request's, less the Serve route prefix (`root_path`)."""
    path, root = scope["path"], scope.get("root_path") or ""
    if root and root != "/" and path.startswith(root):
        path = path[len(root):] or "/"
    return path


class _ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which sits between a streamed response and the
    client and can hide a disconnect from the route): checks the header, else passes through."""

    def __init__(self, app, current: Callable[[], ApiKeyCheck | None]) -> None:
        self.app, self.current = app, current

    async def __call__(self, scope, receive, send) -> None:
        check = self.current() if scope["type"] == "http" else None
        if check is not None and check.enabled and route_path(scope) not in check.open_paths:
            headers = dict(scope.get("headers") or [])
            header = headers.get(b"authorization", b"").decode("latin-1")
            if not header and b"x-api-key" in headers:  # Anthropic's SDK sends its key so
                header = "Bearer " + headers[b"x-api-key"].decode("latin-1")
            if not check.allows(header):
                body = ErrorResponse.of("Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                        "invalid_request_error", None, "invalid_api_key")
                response = fmt.json_response(body, 401, {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_api_key_check(app: FastAPI, current: Callable[[], ApiKeyCheck | None]) -> None:
    """`current()` returns the ApiKeyCheck in force (set when the ingress replica starts)."""
    app.add_middleware(_ApiKeyMiddleware, current=current)
