"""The error of a request that failed on its replica, not through any fault of its own."""

from __future__ import annotations


class ReplicaError(RuntimeError):
    """Running a validated request failed on an engine replica: the replica died or became
    unreachable, its engine failed, or the prompt's KV could not be exported or loaded. The
    client gets a 503 with Retry-After (cluster.http.errors), never tokens computed from wrong
    or partial KV. `replica_died`: the replica may have released nothing it held for the
    request (a P/D flow then releases the transfer itself)."""

    def __init__(self, message: str, replica_died: bool = False) -> None:
        super().__init__(message)
        self.replica_died = replica_died
