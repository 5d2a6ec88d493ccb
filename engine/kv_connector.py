"""The KV connector interface the engine calls (seed 002, "Disaggregated P/D").

The engine never knows where KV comes from or goes to: the scheduler asks the connector how
many prompt tokens have their KV elsewhere and tells it which blocks were allocated; the
worker side moves the bytes. Implementations live in `kvstore/`; the base class does
nothing, which is a colocated engine.
"""

from __future__ import annotations

from engine.request import Request

# kv_transfer_params key: this request's output continues on another engine when it ends at
# its length limit (a P/D prefill), so text held back mid-character is not flushed here.
TEXT_CONTINUES = "text_continues"


class KVConnectorBase:
    # Set by the engine's driver loop: called (from any thread) when external KV arrives, so
    # a loop that is blocked because every request waits for KV wakes up.
    on_load_done = None

    # ---- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the local prefix hit whose KV can be loaded from outside, and
        whether that load is asynchronous (then the request waits in WAITING_FOR_REMOTE_KVS
        until the worker side reports it finished)."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks were allocated for a request being admitted (with `num_external_tokens`
        to be filled from outside)."""

    def build_connector_meta(self) -> object | None:
        """What the worker side needs this step (loads to start, saves to make)."""
        return None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """A request finished. Returns (delay_free, kv_transfer_params): with delay_free the
        connector owns the blocks until it frees them itself (e.g. while they are being sent)."""
        return False, None

    # ---- worker side --------------------------------------------------------------------
    def start_load_kv(self, metadata: object, kv_caches: list) -> None:
        """Begin loading external KV into the paged cache for this step's requests."""

    def wait_for_save(self) -> None:
        """Block until this step's KV exports are safely handed off."""
