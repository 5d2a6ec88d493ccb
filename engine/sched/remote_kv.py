"""The scheduler's half of a KV connector: remote-KV bookkeeping, split out of the Scheduler.

Why its own module: all of this exists only when a connector is configured (P/D). It has its
own state (blocks held while their KV is exported, loads the worker side reported done) and
its own life cycle, driven by the worker side's KVConnectorOutput rather than by scheduling
policy. The Scheduler keeps the policy (what runs, what waits, what is preempted) and calls
these hooks at fixed points: admission, finish, and the start of each update.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.kv_cache import KVCacheManager
from engine.kv_connector import KVConnectorBase
from engine.kv_transfer_params import KVTransferParams
from engine.request import Request, RequestStatus
from engine.sched.output import EngineCoreOutput, KVConnectorOutput


class RemoteKVTracker:
    """`requests` is the scheduler's live id -> Request map (shared, never copied), so a
    report about a request that already finished finds nothing and is ignored."""

    def __init__(self, connector: KVConnectorBase, kv_cache_manager: KVCacheManager,
                 requests: dict[str, Request]) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        self._requests = requests
        # Finished requests whose blocks the connector holds until their KV is exported.
        self.sending: set[str] = set()
        # Requests whose remote KV load has completed (reported by the worker side).
        self.finished_recving: set[str] = set()
        # Prompt tokens of admitted requests, and of those the connector matched (cumulative,
        # vLLM's external prefix cache counters).
        self.queries = self.hits = 0

    # ---- admission ----------------------------------------------------------------------
    def num_external_tokens(self, request: Request, num_local: int) -> tuple[int, bool]:
        """(prompt tokens past the local prefix hit whose KV comes from outside, whether that
        load is asynchronous)."""
        return self.connector.get_num_new_matched_tokens(request, num_local)

    def allocated(self, request: Request, num_external: int) -> None:
        """Blocks were allocated for `request`; its last `num_external` computed tokens are
        to be filled from outside."""
        if request.num_cached_tokens < 0:  # its first admission: counted once
            self.queries += request.num_tokens
            self.hits += num_external
        self.connector.update_state_after_alloc(
            request, self.kv_cache_manager.get_group_block_ids(request.request_id), num_external)

    def load_finished(self, request: Request) -> bool:
        """A request waiting for remote KV becomes schedulable once its load completed."""
        if request.request_id not in self.finished_recving:
            return False
        self.finished_recving.discard(request.request_id)
        # The loaded blocks now hold valid KV: register them for prefix caching.
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        request.status = RequestStatus.WAITING
        return True

    # ---- finish -------------------------------------------------------------------------
    def release(self, request: Request) -> KVTransferParams | None:
        """A request finished: free its blocks now, or hold them until the worker side has
        exported their KV. Returns the params its final output carries."""
        delay_free, kv_params = self.connector.request_finished(
            request, self.kv_cache_manager.get_group_block_ids(request.request_id))
        if delay_free:
            # NOTE: freed when the worker side reports the export in finished_sending.
            self.sending.add(request.request_id)
        else:
            self.kv_cache_manager.free(request)
        return kv_params

    # ---- the worker side's report -------------------------------------------------------
    def apply(self, kv_output: KVConnectorOutput,
              fail_request: Callable[[str], None]) -> list[EngineCoreOutput]:
        """Free the blocks of exported requests, make loaded ones schedulable, and fail (via
        `fail_request`) or recompute the ones whose load failed. Returns the error outputs to
        emit."""
        for request_id in kv_output.finished_sending:
            if request_id in self.sending:
                self.sending.discard(request_id)
                self.kv_cache_manager.free_by_id(request_id)
        self.finished_recving |= kv_output.finished_recving
        # First: the connector learns these loads are over (and released) before a failed one
        # finishes its request below, which would otherwise release its transfer a second time.
        self.connector.update_connector_output(kv_output)
        errors = []
        for request_id, reason in kv_output.failed_recving.items():
            recompute = self.connector.load_failure_policy(request_id) == "recompute"
            if self._load_failed(request_id, recompute, fail_request):
                errors.append(EngineCoreOutput(request_id, [], finish_reason="error", stop_reason=reason))
        return errors

    def _load_failed(self, request_id: str, recompute: bool, fail_request: Callable[[str], None]) -> bool:
        """A request's external KV could not be loaded. With `recompute` it forgets the
        remote KV and will compute its whole prompt here; otherwise it finishes with an
        error. Returns whether the request was finished."""
        request = self._requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return False
        if not recompute:
            fail_request(request_id)
            return True
        # NOTE: the connector remembers the failed load and matches no external tokens for
        # this request again; its params stay (they still say what its prompt continues).
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        return False
