"""PoolingParams: what one pooling request asks (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ParameterError, check_int


@dataclass(frozen=True)
class PoolingParams:
    """`dimensions`: a Matryoshka model's embedding truncated to this many (then normalized);
    `normalize`: None takes the model's rule (engine.pooling.config.PoolingModel)."""

    dimensions: int | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None:
            check_int("dimensions", self.dimensions, 1)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ParameterError("normalize", f"normalize must be true or false, got {self.normalize!r}")
