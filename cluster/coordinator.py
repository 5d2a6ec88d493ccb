"""The Coordinator deployment: the cluster-wide board of replica load figures.

Engine replicas report their figures with every routing-stats round (cluster.replica); the
board keeps the latest report of each live replica and forgets replicas that stopped
reporting (scaled down or dead). The ingress reads it for `/metrics` and `/status`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# A replica that has not reported for this long is gone (reports come every ~0.5 s).
STALE_AFTER_S = 10.0


@dataclass
class Board:
    stale_after_s: float = STALE_AFTER_S
    _reports: dict[str, tuple[float, dict]] = field(default_factory=dict)

    def report(self, figures: dict, now: float | None = None) -> None:
        self._reports[figures["replica"]] = (time.monotonic() if now is None else now, figures)

    def live(self, now: float | None = None) -> list[dict]:
        now = time.monotonic() if now is None else now
        for key in [k for k, (t, _) in self._reports.items() if now - t > self.stale_after_s]:
            del self._reports[key]
        return [figures for _, figures in sorted(self._reports.values(), key=lambda r: r[1]["replica"])]

    def summary(self, now: float | None = None) -> dict:
        roles: dict[str, dict] = {}
        for f in self.live(now):
            r = roles.setdefault(f["role"], {"replicas": 0, "waiting": 0, "running": 0, "kv_usage_max": 0.0})
            r["replicas"] += 1
            r["waiting"] += f["waiting"]
            r["running"] += f["running"]
            r["kv_usage_max"] = max(r["kv_usage_max"], f["kv_usage"])
        return roles


class Coordinator:
    """Serve deployment body (one replica)."""

    def __init__(self, mode: str = "pd") -> None:
        self.mode = mode
        self.board = Board()

    def report(self, figures: dict) -> None:
        self.board.report(figures)

    def replicas(self) -> list[dict]:
        return self.board.live()

    def status(self) -> dict:
        return {"mode": self.mode, "roles": self.board.summary(), "replicas": self.board.live()}
