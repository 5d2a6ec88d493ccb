"""The KV-connector contract (docs/architecture.md#kv-transfer; the shape of vLLM's
KVConnectorBase_V1).

The engine never knows where KV comes from or goes to. A connector has two sides, each an
instance of the same class made for one `KVConnectorRole`:

- the scheduler side (in the EngineCore, next to the Scheduler) decides: how many prompt
  tokens have their KV elsewhere, which blocks they go into, what to export when a request
  finishes. Once per step it packs its decisions into a `KVConnectorMetadata`.
- the worker side (next to the model runner, one per rank) acts on that metadata: starts
  loads, writes loaded KV into the paged cache, saves exports, and reports what finished in
  a `KVConnectorOutput`, which travels back in the ModelRunnerOutput.

The two sides share nothing but those two typed messages, so the worker side can live in
another process. Nothing a connector does may block the engine thread on a remote call.
P/D state of a request travels in its `KVTransferParams` (frozen; never mutated once set).
Implementations live in `kvstore/`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from engine.kv_transfer_params import KVTransferParams
from engine.request import Request
from engine.sched.output import KVConnectorOutput, SchedulerOutput

# vLLM's kv_load_failure_policy. What happens to a request whose prompt KV is lost, late
# (past the transport's timeout) or refused as malformed (kvstore.kv_io): "recompute" computes
# the prompt on the decode side, "fail" ends the request with an error (never tokens from
# wrong or partial KV either way).
LOAD_FAILURE_POLICIES = ("recompute", "fail")
# pdserve's default, where vLLM's is "fail": recomputing loses no request, and here it is exact
# (the decode engine computes the prompt as a colocated one would; the same path prefills
# prompts locally under conditional disaggregation), at the price of one prompt's compute on
# the decode replica. Refusals and failed loads are counted on /metrics, so a recompute is
# never silent (docs/pd.md#load-failure-policy).
DEFAULT_LOAD_FAILURE_POLICY = "recompute"


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


# A request's block ids, one list per KV cache group (engine.kv_cache.hybrid): the main
# group's first; a hybrid model's sliding-window group second, the null block where blocks
# fell out of the window.
GroupBlockIds = tuple[list[int], ...]


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step. Subclasses add their
    fields; the base carries nothing (a step with no connector work)."""


class KVConnectorBase(ABC):
    """The contract. Every method is abstract: an implementation states what each hook does
    for it (a no-op is a decision, documented where it is made)."""

    # "fail": a request whose KV cannot be loaded finishes with an error (never runs on
    # partial KV); "recompute": it computes its whole prompt locally instead. A connector that
    # says nothing fails, as vLLM's do; the P/D connector takes the engine argument
    # (DEFAULT_LOAD_FAILURE_POLICY unless given).
    kv_load_failure_policy: str = "fail"

    def __init__(self, role: KVConnectorRole) -> None:
        self.role = role

    # ---- scheduler side -----------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Prompt tokens beyond the local prefix hit (`num_computed_tokens`) whose KV can be
        loaded from outside, and whether that load is asynchronous (then the request waits in
        WAITING_FOR_REMOTE_KVS until the worker side reports it in `finished_recving`)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: GroupBlockIds, num_external_tokens: int) -> None:
        """Blocks were allocated for a request being admitted, the last
        `num_external_tokens` of its computed tokens to be filled from outside."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's instructions for the worker side, given what this step schedules (e.g.
        save the KV of a prompt whose last chunk runs now); resets the scheduler side's
        per-step state. Called once per schedule()."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The scheduler has applied the worker side's report of this step (freed exported
        blocks, made loaded requests schedulable, failed or recomputed failed loads)."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: GroupBlockIds) -> tuple[bool, KVTransferParams | None]:
        """A request finished (any reason). Returns (delay_free_blocks, kv_transfer_params):
        with delay_free_blocks the blocks stay allocated until the worker side reports the
        request in `finished_sending`; the params go out with the request's final output."""

    def load_failure_policy(self, request_id: str) -> str:
        """The failure policy of `request_id`'s load (a composite connector answers with the
        policy of the connector that loads it)."""
        return self.kv_load_failure_policy

    # ---- worker side --------------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_caches: list, layer_groups: list[int] | None = None) -> None:
        """The paged KV cache of this worker ([(K, V)] per layer), once it is allocated, and
        the KV cache group of each layer (None: all in group 0)."""

    @abstractmethod
    def set_wakeup(self, callback: Callable[[], None]) -> None:
        """`callback` (callable from any thread) wakes an engine loop that blocked because
        every request waits for remote KV; called when an asynchronous load completes."""

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Before the forward pass: start the loads the metadata asks for, and write the KV
        of completed loads into the paged cache."""

    @abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until `layer_name`'s KV is loaded (layer-wise pipelined loading)."""

    @abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: object, attn_metadata: object) -> None:
        """Start saving one layer's KV during the forward pass (layer-wise pipelined saving)."""

    @abstractmethod
    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        """After the forward pass: hand off the KV this step computed that the metadata asks
        to save. Must not wait on a remote call."""

    @abstractmethod
    def get_finished(self) -> KVConnectorOutput:
        """Exports handed off, loads completed and loads failed since the last call."""

    def transfer_stats(self) -> dict[str, int | float]:
        """Cumulative counters of the worker side (exports, loads, bytes, ...), for metrics."""
        return {}

    def pending_exports(self) -> int:
        """Exports this worker still holds until the other side takes them."""
        return 0

    # ---- KV events (scheduler side) -----------------------------------------------------
    def take_kv_events(self) -> list:
        """Blocks this connector's own tiers stored or dropped since the last call
        (engine.kv_cache.events, with their medium); a connector without tiers has none."""
        return []

    def kv_held(self) -> dict[str, tuple[bytes, ...]]:
        """Everything its tiers hold now, per medium (for a KV snapshot)."""
        return {}


# Makes one side of a connector; the engine calls it once per side (and per worker rank).
KVConnectorFactory = Callable[[KVConnectorRole], "KVConnectorBase"]


def spawn_safe(factory: KVConnectorFactory) -> bool:
    """Whether `factory` may be pickled into a spawned engine core process and build its
    connector there (a relayed one, kvstore.transports.relay, says so with `spawn_safe = True`);
    one that calls the cluster from wherever it is built must stay in the replica's process."""
    return bool(getattr(factory, "spawn_safe", False))


def run_worker_step(connector: KVConnectorBase | None, metadata: KVConnectorMetadata | None,
                    execute: Callable[[], object]):
    """The worker side around one forward pass: start loads, run `execute`, save; returns
    (execute's result, the connector's KVConnectorOutput or None)."""
    if connector is None:
        return execute(), None
    connector.start_load_kv(metadata)
    result = execute()
    connector.wait_for_save(metadata)
    return result, connector.get_finished()
