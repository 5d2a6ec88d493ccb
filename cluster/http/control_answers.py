"""The Coordinator's typed answers (cluster.control.results) as HTTP responses: the one place
where a scale's result becomes a status code and a body in OpenAI's error shape."""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from cluster.control.results import ScaleResult, Status
from cluster.http import openai_format as fmt
from cluster.http.openai_models import ErrorResponse


class ScaleAccepted(BaseModel):
    """`POST /scale`'s 202: the replica counts the Coordinator now scales to."""

    target: dict[str, int]
    scaling: bool = True


def scale_response(result: ScaleResult) -> Response:
    """202 with the target, or the refusal's status with `{"error": {...}}` (a target that does
    not fit adds the resources `needed` and `free` beside the message)."""
    if result.accepted:
        return fmt.json_response(ScaleAccepted(target=result.target), 202)
    return fmt.json_response(ErrorResponse.of(result.message, result.error_type, result.param, result.status,
                                              **result.details), result.status)


def status_response(status: Status) -> JSONResponse:
    return JSONResponse(status.as_json())
