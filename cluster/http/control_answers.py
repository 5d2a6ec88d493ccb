"""The Coordinator's typed answers (cluster.control.results) as HTTP responses: the one place
where a scale's result becomes a status code and a body in OpenAI's error shape."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from cluster.control.results import ScaleResult, Status
from cluster.http import openai_format as fmt


def scale_response(result: ScaleResult) -> JSONResponse:
    """202 with the target, or the refusal's status with `{"error": {...}}` (a target that does
    not fit adds the resources `needed` and `free` beside the message)."""
    if result.accepted:
        return JSONResponse({"target": result.target, "scaling": True}, status_code=202)
    body = fmt.error_body(result.message, result.error_type, result.param, result.status)
    body["error"].update(result.details)
    return JSONResponse(body, status_code=result.status)


def status_response(status: Status) -> JSONResponse:
    return JSONResponse(status.as_json())
