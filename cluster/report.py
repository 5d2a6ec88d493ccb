"""What an engine replica (or worker actor) reports about itself: its engine's load and what
the serving layer measured around it. The Serve router, the Coordinator's board, autoscaling
and /metrics read it (docs/metrics.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.roles import Role
from engine.load import EngineLoad


@dataclass(frozen=True)
class ReplicaReport:
    replica: str  # its id: "<role>-<unique id>"
    role: Role
    engine: EngineLoad
    # Prompt KV held for a prefill's reply, or received in one and not yet loaded
    # (kvstore.handoff): 0 when idle, else work in flight or a leak.
    kv_handoffs: int = 0
    kv_transfer: dict[str, float] = field(default_factory=dict)  # the KV connector's counters
    ttft_p90_s: float | None = None  # the replica's own latency windows (autoscaling's signals)
    itl_p90_s: float | None = None
    # Prefix blocks its engine holds per medium ("device", "host", "shared"), when its KV
    # events are on (--router-mode kv); empty otherwise.
    kv_cached_blocks: dict[str, int] = field(default_factory=dict)
    seq: int = 0  # the replica's report number: a board keeps the latest
    time: float = 0.0  # wall clock when it was taken

    def routing_stats(self) -> dict:
        """What Serve's request router reads (cluster.replica.router): the queues, the report
        number (a router forgets what it sent since the last report) and the LoRA adapters the
        engine holds (routed to first, as Serve's model multiplexing does)."""
        lora = self.engine.lora
        return {"waiting": self.engine.waiting, "running": self.engine.running, "seq": self.seq,
                "loras": list(lora.held) if lora is not None else []}
