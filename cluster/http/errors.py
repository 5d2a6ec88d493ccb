"""OpenAI-shaped HTTP errors: the exception the ingress raises, and the FastAPI handlers that
turn it (and FastAPI's own schema errors) into `{"error": {message, type, param, code}}`."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.http import openai_format as fmt
from cluster.http.openai_models import ErrorResponse
from cluster.replica.errors import ReplicaError
from engine.errors import EngineDeadError, ParameterError

RETRY_AFTER_S = 1
logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> Response:
        return fmt.json_response(ErrorResponse.of(self.message, self.type, self.param, self.code or self.status),
                                 self.status, self.headers)


def overloaded(message: str) -> OpenAIError:
    """503: what should serve the request is failing or not there (yet)."""
    return OpenAIError(503, message, "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


def queue_full(message: str) -> OpenAIError:
    """429: a bounded queue is full. Nothing failed; the client should come back later, as
    OpenAI's rate limits tell it (its clients retry a 429 after Retry-After)."""
    return OpenAIError(429, message, "rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(RETRY_AFTER_S)})


@contextmanager
def rejecting(body) -> Iterator[None]:
    """Inside, a ParameterError (from any layer) becomes a 400 whose `param` is the request
    field it came from (`body.param(field)`): the one path from validation to the client."""
    try:
        yield
    except ParameterError as e:
        raise OpenAIError(400, str(e), param=body.param(e.field)) from e


def replica_error(e: Exception) -> OpenAIError:
    """What the client gets when running a validated request failed."""
    if isinstance(e, OpenAIError):  # the request's own fault, found while it ran
        return e
    if isinstance(e, BackPressureError):
        return queue_full(f"engine replicas are at their queue limit; retry later ({e})")
    if isinstance(e, (ReplicaError, EngineDeadError)):  # not the request's fault: it may be retried
        return overloaded(f"request failed on a replica: {e}")
    return internal_error(e)


def internal_error(e: BaseException) -> OpenAIError:
    """500: a fault of the server. The body says so with an id to quote; what failed goes to
    the log under that id, not to the client (exception text can hold paths, addresses or
    another request's data)."""
    error_id = f"err-{uuid.uuid4().hex[:12]}"
    logger.error("internal error %s", error_id, exc_info=(type(e), e, e.__traceback__))
    return OpenAIError(500, f"internal error (id {error_id}: the server's log has its cause)",
                       "internal_server_error")


# Routes that answer errors in Anthropic's shape (cluster.http.anthropic_messages).
ANTHROPIC_ROUTES = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error"}


def anthropic_error_body(err: OpenAIError) -> dict:
    """Anthropic's error shape, which its SDK reads."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(err.status, "api_error"), "message": err.message}}


def _answer(request: Request, err: OpenAIError) -> Response:
    """The error in the shape of the API the route speaks."""
    path, root = request.scope.get("path", ""), request.scope.get("root_path") or ""
    if root not in ("", "/") and path.startswith(root):
        path = path[len(root):]
    if path.startswith(ANTHROPIC_ROUTES):
        return JSONResponse(anthropic_error_body(err), err.status, headers=err.headers)
    return err.response()


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> Response:
        return _answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        """FastAPI's 422 becomes OpenAI's 400, naming the offending field."""
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        # The param is the top-level field; the message keeps the path (which for unions also
        # names the type tried, e.g. prompt.str).
        param = loc[0] if loc else None
        if err.get("type") == "json_invalid":
            message, param = f"malformed JSON body: {err.get('msg', '')}", None
        elif err.get("type") == "missing" and len(loc) == 1:
            message = f"missing required field '{param}'"
        else:
            message = f"invalid value for '{'.'.join(loc)}': {err.get('msg', 'invalid')}"
        return _answer(request, OpenAIError(400, message, param=param))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        """Anything unforeseen is still an OpenAI-shaped 500, never a bare text page."""
        return _answer(request, internal_error(exc))

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, exc: RecursionError) -> Response:
        """Only a request's own nesting (JSON arrays and objects in arrays and objects, often
        ~1000 deep) takes the ingress this deep: the client's fault, not the server's."""
        return _answer(request, OpenAIError(400, "the request nests too deeply to process (JSON arrays or "
                                            "objects inside each other)"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = _unparsable_body(exc.__cause__) or str(exc.detail)
        return _answer(request, OpenAIError(exc.status_code, message, type_, headers=exc.headers))


def _unparsable_body(cause: BaseException | None) -> str | None:
    """Why FastAPI could not parse a body it answers with a bare "There was an error parsing
    the body" (it keeps the reason as the cause): said plainly, or None for other errors."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8 JSON: {cause}"
    if isinstance(cause, RecursionError):
        return "the request body's JSON nests too deeply (arrays or objects inside each other)"
    return None
