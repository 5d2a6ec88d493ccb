"""The LoRA adapters an app serves, by name: from `--lora-modules` at start, and loaded or
unloaded at run time through vLLM's routes (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`) when `--enable-lora-runtime-updating` (or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING=true) allows it.

A request's `model` picks an adapter; the ingress resolves it here to a LoRARequest, which its
EngineRequest carries to every engine (`lora_request`). Each name gets its own
lora_int_id; loading a name again after an unload gives a new id, so no engine can confuse
the new adapter's weights with the old one's (the old copy ages out of its caches, LRU).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from pydantic import BaseModel

from cluster.http.errors import OpenAIError
from cluster.http.openai_models import ModelCard
from engine.errors import ParameterError
from engine.lora.request import LoRARequest

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# How stale an ingress replica's view of other replicas' run-time changes may get before a
# request starts a refresh in the background (an unknown name refreshes at once).
FOLLOW_PERIOD_S = 2.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form
    {"name": ..., "path": ..., "base_model_name": ...}."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        text = text.strip()
        if text.startswith("{"):
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ParameterError("lora_modules", f"lora_modules: {text!r} is not JSON: {e}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("path"), str):
                raise ParameterError("lora_modules", 'lora_modules: a JSON entry needs "name" and "path" strings, '
                                     f"got {text!r}")
            return cls(obj["name"], obj["path"], obj.get("base_model_name"))
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ParameterError("lora_modules", f"lora_modules entries are name=path (or JSON), got {text!r}")
        return cls(name, path)


class LoRARegistry:
    """Adapters by name, each checked (`check`: the input processor's adapter check, so a bad
    adapter is refused where it is named) before anyone may use it; the requests using each,
    so an unload waits for them (bounded) or is refused with a 409."""

    def __init__(self, base_name: str, check: Callable[[LoRARequest], None], runtime_updates: bool = False,
                 unload_wait_s: float = 30.0) -> None:
        self.base_name = base_name
        self.check = check
        self.runtime_updates = runtime_updates
        self.unload_wait_s = unload_wait_s
        self._adapters: dict[str, tuple[LoRARequest, int]] = {}  # name -> (request, created)
        self._in_use: dict[str, int] = {}
        self._next_id = 1
        self._idle = asyncio.Event()

    def add(self, name: str, path: str) -> LoRARequest:
        """Check and register an adapter; ParameterError (a 400) when it is bad or the name taken."""
        if not isinstance(name, str) or not name:
            raise ParameterError("lora_name", f"lora_name must be a non-empty string, got {name!r}")
        if not isinstance(path, str) or not path:
            raise ParameterError("lora_path", f"lora_path must be a PEFT adapter directory, got {path!r}")
        if name == self.base_name or name in self._adapters:
            raise ParameterError("lora_name", f"The lora adapter '{name}' has already been loaded"
                                 if name in self._adapters else f"lora_name '{name}' is the base model's name")
        request = LoRARequest(name, self._next_id, path)
        self.check(request)
        self._next_id += 1
        self._adapters[name] = (request, int(time.time()))
        return request

    def resolve(self, model: str) -> LoRARequest | None:
        """A request's `model`: None for the base model, its adapter, else a 404."""
        if model == self.base_name:
            return None
        entry = self._adapters.get(model)
        if entry is None:
            names = ", ".join(f"`{n}`" for n in [self.base_name, *self._adapters])
            raise OpenAIError(404, f"The model `{model}` does not exist. Available: {names}.", "not_found_error",
                              param="model", code="model_not_found")
        return entry[0]

    @contextmanager
    def using(self, lora: LoRARequest | None):
        """Counts a request that runs with `lora` for as long as the block runs."""
        if lora is None:
            yield
            return
        name = lora.lora_name
        self._in_use[name] = self._in_use.get(name, 0) + 1
        try:
            yield
        finally:
            self._in_use[name] -= 1
            if not self._in_use[name]:
                del self._in_use[name]
                self._idle.set()

    async def unload(self, name: str) -> None:
        """Remove an adapter: 404 when unknown; while requests use it, wait for them up to
        `unload_wait_s`, then 409. New requests naming it are refused (404) from the start."""
        if name not in self._adapters:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "not_found_error",
                              param="lora_name", code="model_not_found")
        entry = self._adapters.pop(name)
        deadline = time.monotonic() + self.unload_wait_s
        while self._in_use.get(name):
            left = deadline - time.monotonic()
            if left <= 0:
                self._adapters[name] = entry  # still served: the unload did not happen
                raise OpenAIError(409, f"The lora adapter '{name}' is in use by {self._in_use[name]} requests "
                                  f"after waiting {self.unload_wait_s:g} s; retry later", "conflict_error",
                                  param="lora_name")
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout=left)
            except asyncio.TimeoutError:
                pass

    def knows(self, name: str) -> bool:
        return name == self.base_name or name in self._adapters

    def follow(self, table: dict[str, str | None]) -> None:
        """Apply run-time changes made on other ingress replicas (the Coordinator's table:
        name -> path, None once unloaded). Requests already running keep their adapter."""
        for name, path in table.items():
            entry = self._adapters.get(name)
            if entry is not None and entry[0].lora_path == path:
                continue
            self._adapters.pop(name, None)
            if path is not None:
                try:
                    self.add(name, path)
                except ParameterError as e:  # checked where it was loaded; the files changed since
                    logger.warning("LoRA adapter %r from another ingress replica not loaded: %s", name, e)

    def models(self, created: int, max_model_len: int | None) -> list[ModelCard]:
        """/v1/models entries of the adapters (vLLM's: `root` the path, `parent` the base)."""
        return [ModelCard(id=r.lora_name, created=created_at, root=r.lora_path, parent=self.base_name,
                          max_model_len=max_model_len) for r, created_at in self._adapters.values()]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str
    lora_path: str

    def param(self, field: str) -> str:
        """The body field a ParameterError names (cluster.http.errors.rejecting)."""
        return field


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter body (lora_int_id is accepted and ignored: names are the key)."""

    lora_name: str
    lora_int_id: int | None = None


def runtime_updates_allowed(flag: bool) -> bool:
    """The flag, or vLLM's environment variable (true/1), in the ingress's process."""
    return flag or os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


def lora_registry(base_name: str, modules: tuple[LoRAModule, ...], processor, enable_lora: bool,
                  runtime_updates: bool) -> LoRARegistry | None:
    """The ingress's registry (None without enable_lora: `model` then names only the base),
    with every --lora-modules adapter checked at start, so a bad one stops the app there."""
    if not enable_lora:
        return None
    registry = LoRARegistry(base_name, processor.lora_check, runtime_updates_allowed(runtime_updates))
    for module in modules:
        registry.add(module.name, module.path)
    return registry


class LoRAFollower:
    """Keeps an ingress replica's registry in step with adapters loaded or unloaded on the
    others: `fetch()` reads the Coordinator's table. A request naming an adapter this replica
    does not know waits for one bounded refresh (a 404 after it is real); otherwise a refresh
    older than FOLLOW_PERIOD_S starts in the background and never delays a request."""

    def __init__(self, registry: LoRARegistry, fetch: Callable[[], object], period_s: float = FOLLOW_PERIOD_S) -> None:
        self.registry = registry
        self.fetch = fetch
        self.period_s = period_s
        self._at = -math.inf
        self._running: asyncio.Task | None = None

    async def before(self, model: str | None) -> None:
        if model is not None and not self.registry.knows(model):
            await self._refresh()
        elif time.monotonic() - self._at >= self.period_s and (self._running is None or self._running.done()):
            self._running = asyncio.ensure_future(self._refresh())

    async def _refresh(self) -> None:
        self._at = time.monotonic()
        try:
            self.registry.follow(await self.fetch())
        except Exception as e:  # the Coordinator restarting: this replica keeps its own view
            logger.warning("LoRA adapters of other ingress replicas not refreshed: %r", e)
