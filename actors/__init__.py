"""Ray actors wrapping one engine each: prefill, decode, or both (colocated).

The names below load on first use, so importing a light module of this package (roles,
report) does not import the engine with them."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "EngineWorker": "actors.worker",
    "create_worker": "actors.worker",
}
__all__ = [
    "EngineWorker",
    "create_worker",
]

if TYPE_CHECKING:
    from actors.worker import EngineWorker, create_worker


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
