"""An engine's load figures: what EngineCore.load() returns, what a core apart from its front end
sends with its steps, what a replica reports for routing (least 4 * waiting + running) and
what the metrics render (docs/metrics.md). Counters are cumulative since the engine started.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass


def summed_counters(counters: Sequence[dict]) -> dict:
    """Counters of several cores or ranks (each moved its own share), added key by key."""
    total: dict = {}
    for c in counters:
        for key, value in c.items():
            total[key] = total.get(key, 0) + value
    return total


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Speculative decoding's counters (vLLM's vllm:spec_decode_* metrics)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: tuple[int, ...] = ()

    def __add__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        a, b = self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos
        width = max(len(a), len(b))
        per_pos = tuple((a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(width))
        return SpecDecodeCounts(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                                self.num_accepted_tokens + other.num_accepted_tokens, per_pos)


@dataclass(frozen=True)
class CoreFigures:
    """One data-parallel core's own figures (pdserve:dp_* metrics, labelled engine=rank)."""

    rank: int
    waiting: int = 0
    running: int = 0
    requests: int = 0  # routed to this core since it started
    dummy_steps: int = 0  # forward passes on no tokens (expert parallel)
    wave: int = 0


@dataclass(frozen=True)
class LoRAFigures:
    """Adapters by name (engine.lora.sched.LoRAUsage): vllm:lora_requests_info's labels, and
    `held`, the adapters a router prefers this engine for."""

    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    held: tuple[str, ...] = ()
    max_lora: int = 0

    def __add__(self, other: LoRAFigures) -> LoRAFigures:
        def union(a, b):
            return tuple(sorted(set(a) | set(b)))

        return LoRAFigures(union(self.running, other.running), union(self.waiting, other.waiting),
                           union(self.held, other.held), self.max_lora + other.max_lora)


@dataclass(frozen=True)
class EngineLoad:
    waiting: int = 0
    running: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0
    # Prompt tokens looked up by the KV connector (P/D, host tier) and found there (loaded).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_steps: int = 0  # steps that ran a forward pass
    num_scheduled_tokens: int = 0  # tokens those steps ran
    encoder_cache_queries: int = 0
    encoder_cache_hits: int = 0
    encoder_seconds: float = 0.0
    spec_decode: SpecDecodeCounts | None = None  # None: the engine does not speculate
    data_parallel: tuple[CoreFigures, ...] = ()  # per core; empty without data parallelism
    lora: LoRAFigures | None = None  # None: enable_lora is off
    # What multiplies on CPU: the native kernels' ISA level ("avx512", "avx2", ...; "references"
    # without them), so an operator sees which build a replica runs. None: a GPU engine.
    cpu_kernels: str | None = None

    @property
    def kv_usage(self) -> float:
        """Share of KV blocks in use, 1 meaning all."""
        return (self.total_blocks - self.free_blocks) / self.total_blocks if self.total_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def score(self) -> int:
        """The router's load score: a waiting request weighs four running ones."""
        return 4 * self.waiting + self.running

    @staticmethod
    def summed(loads: Sequence[EngineLoad]) -> EngineLoad:
        """Several cores' figures as one engine's: counts and counters added, the ratios
        recomputed from the sums, per-core figures concatenated."""
        numbers = {f.name: sum(getattr(load, f.name) for load in loads)
                   for f in dataclasses.fields(EngineLoad) if f.name not in _NOT_SUMMED}
        specs = [load.spec_decode for load in loads if load.spec_decode is not None]
        spec = None
        for s in specs:
            spec = s if spec is None else spec + s
        cores = tuple(core for load in loads for core in load.data_parallel)
        loras = [load.lora for load in loads if load.lora is not None]
        lora = None
        for f in loras:
            lora = f if lora is None else lora + f
        # Cores of one engine run on one machine: one level, the first core's.
        cpu = next((load.cpu_kernels for load in loads if load.cpu_kernels is not None), None)
        return EngineLoad(**numbers, spec_decode=spec, data_parallel=cores, lora=lora, cpu_kernels=cpu)

    def figures(self) -> dict:
        """Flat figures keyed as engine.metrics.names' tables are (the metric renderers' input)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_SUMMED}
        out["kv_usage"] = self.kv_usage
        out["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        if self.spec_decode is not None:
            s = self.spec_decode
            out.update(spec_decode_num_drafts=s.num_drafts, spec_decode_num_draft_tokens=s.num_draft_tokens,
                       spec_decode_num_accepted_tokens=s.num_accepted_tokens,
                       spec_decode_num_accepted_tokens_per_pos=list(s.num_accepted_tokens_per_pos))
        if self.data_parallel:
            out["data_parallel"] = [dataclasses.asdict(core) for core in self.data_parallel]
        if self.lora is not None:
            out["lora"] = dataclasses.asdict(self.lora)
        return out


_NOT_SUMMED = ("spec_decode", "data_parallel", "lora", "cpu_kernels")
