"""API keys: `Authorization: Bearer KEY` on /v1/*, the tokenizer routes, /scale and /status (as
vLLM's --api-key guards /v1; the tokenizer routes serve the same model, so they need the same
key); /health and /metrics stay open for load balancers and Prometheus.

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
GUARDED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info", "/scale", "/status")


def keys_from(flags: Iterable[str] | None, environ: dict | None = None) -> tuple[str, ...]:
    """The configured keys: the flags' and the environment variable's, blanks dropped."""
    env = (environ if environ is not None else os.environ).get(ENV_VAR, "")
    keys = [k.strip() for k in [*(flags or []), *env.split(",")]]
    return tuple(dict.fromkeys(k for k in keys if k))


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeyCheck:
    def __init__(self, digests: Iterable[str]) -> None:
        self.digests = tuple(digests)

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


def guarded(path: str) -> bool:
    return path.startswith(GUARDED_PREFIXES)


class _ApiKeyMiddleware:
    """Plain ASGI (not BaseHTTPMiddleware, which sits between a streamed response and the
    client and can hide a disconnect from the route): checks the header, else passes through."""

    def __init__(self, app, current: Callable[[], ApiKeyCheck | None]) -> None:
        self.app, self.current = app, current

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and guarded(scope["path"]):
            check = self.current()
            header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if check is not None and not check.allows(header):
                body = ErrorResponse.of("Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                                        "invalid_request_error", None, "invalid_api_key")
                response = fmt.json_response(body, 401, {"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def install_api_key_check(app: FastAPI, current: Callable[[], ApiKeyCheck | None]) -> None:
    """`current()` returns the ApiKeyCheck in force (set when the ingress replica starts)."""
    app.add_middleware(_ApiKeyMiddleware, current=current)
