"""Ray actors wrapping one engine each: prefill, decode, or both (colocated).

The names below load on first use, so importing a light module of this package (roles,
report) does not import the engine with them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "EngineWorker": "actors.worker",
    "PDRequestError": "kvstore.pd",
    "colocated_generate": "actors.orchestrate",
    "create_worker": "actors.worker",
    "pd_generate": "actors.orchestrate",
}
__all__ = [
    "EngineWorker",
    "PDRequestError",
    "colocated_generate",
    "create_worker",
    "pd_generate",
]

if TYPE_CHECKING:
    from actors.orchestrate import colocated_generate, pd_generate
    from actors.worker import EngineWorker, create_worker
    from kvstore.pd import PDRequestError


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
