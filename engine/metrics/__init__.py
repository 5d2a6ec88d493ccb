"""Engine metrics: definitions shared with the Prometheus exporter, the offline recorder,
and the snapshot types `LLM.get_metrics()` returns."""

from engine.metrics.reader import Counter, Gauge, Histogram, Metric
from engine.metrics.stats import StatsRecorder

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "StatsRecorder"]
