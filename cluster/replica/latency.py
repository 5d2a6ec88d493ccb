"""Sliding-window latency percentiles a replica reports (the autoscaler's TTFT/ITL signals)."""

from __future__ import annotations

import time
from collections import deque


class LatencyWindow:
    """Samples of the last `window_s` seconds (at most `max_samples`, oldest dropped first)."""

    def __init__(self, window_s: float = 10.0, max_samples: int = 4096) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, value: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, value))

    def percentile(self, q: float, now: float | None = None) -> float | None:
        """The q-quantile (0..1, nearest rank) of the samples in the window; None if empty."""
        now = time.monotonic() if now is None else now
        while self._samples and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        if not self._samples:
            return None
        values = sorted(v for _, v in self._samples)
        return values[min(len(values) - 1, max(0, int(q * len(values) + 0.999999) - 1))]
