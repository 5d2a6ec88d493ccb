"""Structured outputs (docs/structured-outputs.md; a seam, docs/architecture.md#seams): constraints compiled to token bitmasks.

The front end validates a request's `StructuredOutputsParams` (`validate`); the engine's
`StructuredOutputManager` compiles it off the engine thread and fills each step's bitmask;
the sampler masks the logits with it before any other processing.
"""

from collections import OrderedDict

from engine.structured_output.backend import StructuredOutputBackend, StructuredOutputGrammar
from engine.structured_output.llguidance_backend import GuidanceBackend
from engine.structured_output.manager import StructuredOutputManager
from engine.structured_output.params import StructuredOutputsParams
from engine.structured_output.request import StructuredOutputRequest

BACKENDS: dict[str, type[StructuredOutputBackend]] = {"guidance": GuidanceBackend}
DEFAULT_BACKEND = "guidance"
# Specs already found valid: the ingress and the engine both check every request, and clients
# send the same schema again and again.
_VALID: OrderedDict[tuple, None] = OrderedDict()
_MAX_VALID = 1024


def validate(params: StructuredOutputsParams, backend: str = DEFAULT_BACKEND) -> None:
    """Raise ParameterError (field `structured_outputs`) if `params` would not compile."""
    key = (backend, params.cache_key)
    if key in _VALID:
        return
    BACKENDS[backend].validate(params)
    _VALID[key] = None
    while len(_VALID) > _MAX_VALID:
        _VALID.popitem(last=False)


__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "GuidanceBackend",
    "StructuredOutputBackend",
    "StructuredOutputGrammar",
    "StructuredOutputManager",
    "StructuredOutputRequest",
    "StructuredOutputsParams",
    "validate",
]
