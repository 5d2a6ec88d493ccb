"""The pieces of scripts/bench_serve.py: workload, SSE parsing, the load generator, per-request
records and their summary, the server subprocess of compare mode, and the report."""


class BenchError(RuntimeError):
    """A set-up problem (server unreachable, failed to start, bad flags) that ends the run."""
