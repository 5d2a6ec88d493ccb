"""Named plugins a seam builds from (docs/architecture.md#seams): an engine argument names one
(`distributed_executor_backend`, `data_parallel_backend`), and code outside the engine adds
its own when imported (actors' Ray executor and Ray data-parallel cores), since the engine
never imports Ray."""

from __future__ import annotations

from typing import Generic, TypeVar

from engine.errors import ParameterError

T = TypeVar("T")


class Registry(Generic[T]):
    """name -> factory for the engine argument `field`. `hint` ends the error for a name not
    registered (where a missing plugin comes from)."""

    def __init__(self, field: str, hint: str = "", factories: dict[str, T] | None = None) -> None:
        self.field, self.hint = field, hint
        # Public so that a test can swap one entry with monkeypatch.setitem.
        self.factories: dict[str, T] = dict(factories or {})

    def register(self, name: str, factory: T) -> None:
        """Make `field=name` build `factory` (a later registration of the name replaces it)."""
        self.factories[name] = factory

    def get(self, name: str) -> T:
        """The factory registered as `name`; ParameterError naming the field and the names
        registered in this process otherwise."""
        if name not in self.factories:
            hint = f"; {self.hint}" if self.hint else ""
            raise ParameterError(self.field, f"{self.field}={name!r} is not available in this process "
                                             f"(available: {sorted(self.factories)}){hint}")
        return self.factories[name]
