"""Ray actors wrapping one engine each: prefill, decode, or both (colocated)."""

from actors.orchestrate import PDRequestError, colocated_generate, pd_generate
from actors.worker import EngineWorker, create_worker

__all__ = ["EngineWorker", "PDRequestError", "colocated_generate", "create_worker", "pd_generate"]
