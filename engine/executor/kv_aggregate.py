"""One KV-connector report for the whole tensor-parallel group.

Each rank's worker side loads and exports only its own heads, so a request's remote KV is in
place only when every rank has written its shard. Ranks finish at different steps; the
scheduler must hear about a request once, when the last rank is done, and never while any
rank may still write into its blocks (a failed load is reported only after every rank has
reported, so the blocks are no longer touched when the scheduler frees or recomputes them).
"""

from __future__ import annotations

from engine.sched.output import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, size: int) -> None:
        self.size = size
        # request id -> ranks that reported its load so far, and the first failure if any
        self._recv: dict[str, tuple[int, str | None]] = {}
        self._sent: dict[str, int] = {}

    def merge(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """This step's reports of every rank (None: nothing) -> what the scheduler may act
        on now, or None."""
        merged = KVConnectorOutput()
        for out in outputs:
            if out is None:
                continue
            for rid in out.finished_recving:
                self._count_recv(rid, None, merged)
            for rid, reason in out.failed_recving.items():
                self._count_recv(rid, reason, merged)
            for rid in out.finished_sending:
                n = self._sent.get(rid, 0) + 1
                if n == self.size:
                    self._sent.pop(rid, None)
                    merged.finished_sending.add(rid)
                else:
                    self._sent[rid] = n
        return None if merged.is_empty else merged

    def _count_recv(self, rid: str, reason: str | None, merged: KVConnectorOutput) -> None:
        n, failure = self._recv.get(rid, (0, None))
        n, failure = n + 1, failure or reason
        if n < self.size:
            self._recv[rid] = (n, failure)
            return
        self._recv.pop(rid, None)
        if failure is None:
            merged.finished_recving.add(rid)
        else:
            merged.failed_recving[rid] = failure

    def forget(self, request_ids) -> None:
        """Requests the scheduler finished: ranks that had not reported dropped their loads
        (the connector's abandon), so their partial counts will never complete."""
        for rid in request_ids:
            self._recv.pop(rid, None)
            self._sent.pop(rid, None)

    @property
    def pending(self) -> int:
        return len(self._recv) + len(self._sent)
