"""The host offload tier as a KV connector (engine.kv_connector's contract; vLLM's
OffloadingConnector idea, `--kv-offloading-size`): an engine keeps prefix blocks in host
memory after its own pool evicted them, and a later prompt that misses the pool but hits the
host loads them instead of computing them again.

Store (write-through): in every step, the scheduler side picks the full blocks whose KV that
step's forward pass makes final and that the host does not hold yet, and the worker side
copies them out after the pass, while their request still holds them. A step copies at most
`store_blocks_per_step` blocks (STORE_BYTES_PER_STEP worth), so a long prefill never adds more
than a bounded copy to its step; the rest follow in the request's next steps.

Load: a prompt's blocks past the local prefix hit that the host holds, consecutive, whole,
never its last token (at least one token is computed, for the logits), are reported as
external tokens with an asynchronous load: the request waits one step in
WAITING_FOR_REMOTE_KVS, the worker side checks every block (engine.kv_offload.host_pool) and
only then copies them all into the request's blocks, before that step's forward pass. The
scheduler then registers them in the prefix cache like computed ones
(engine.sched.remote_kv.load_finished). A refused block fails the request's load, which is
then recomputed (this connector's failure policy is always "recompute": a tier that is full or
broken never fails a request).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache.events import HOST
from engine.kv_connector import GroupBlockIds, KVConnectorBase, KVConnectorMetadata, KVConnectorRole
from engine.kv_offload.host_index import HostIndex
from engine.kv_offload.host_pool import HostPool, PagedBlocks, RefusedBlock
from engine.kv_transfer_params import KVTransferParams
from engine.request import Request
from engine.sched.output import KVConnectorOutput, SchedulerOutput

# Copy-out budget of one step. On a 2-core CPU a block of the 135M default model (0.7 MiB)
# costs about 0.5 ms to copy and checksum, so 64 MiB add ~45 ms to the step that completes a
# long prompt (itself seconds long); on CUDA it is a D2H copy of the same size.
STORE_BYTES_PER_STEP = 64 * 2**20
EVICT = -1  # the block id of an eviction in OffloadMetadata.ops


@dataclass(frozen=True)
class LoadSpec:
    request_id: str
    blocks: tuple[tuple[bytes, int], ...]  # (block hash, block id to fill), in prompt order


@dataclass
class OffloadMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    # (block hash, block id to copy out) or (block hash, EVICT), in the order decided: a block
    # may be stored and evicted again within one step.
    ops: list[tuple[bytes, int]] = field(default_factory=list)


@dataclass
class _Tracked:
    """A request whose blocks are stored as they become final."""

    request: Request
    block_ids: list[int]  # the main group's, as allocated so far
    next_block: int = 0  # blocks before it are stored (or were already held)


class OffloadConnector(KVConnectorBase):
    """One side of an engine's host tier of `capacity_bytes` (`capacity_blocks` blocks of
    this engine's layout)."""

    kv_load_failure_policy = "recompute"

    def __init__(self, role: KVConnectorRole, block_size: int, capacity_blocks: int, capacity_bytes: int,
                 store_blocks_per_step: int) -> None:
        super().__init__(role)
        self.block_size = block_size
        self.store_blocks_per_step = store_blocks_per_step
        # scheduler side
        self.index = self._make_index(capacity_blocks) if role == KVConnectorRole.SCHEDULER else None
        self._meta = OffloadMetadata()
        self._tracked: dict[str, _Tracked] = {}
        self._matches: dict[str, int] = {}  # request id -> first block of its host hit
        self._loading: dict[str, list[bytes]] = {}  # loads handed to the worker side
        self._refused: set[str] = set()  # requests whose load was refused: they compute
        # worker side
        self.pool = self._make_pool(capacity_bytes) if role == KVConnectorRole.WORKER else None
        self._paged: PagedBlocks | None = None
        self._finished = KVConnectorOutput()
        self.stats = {"host_stores": 0, "host_loads": 0, "host_hit_tokens": 0, "host_refused": 0,
                      "host_evictions": 0, "host_bytes_out": 0, "host_bytes_in": 0}

    # A tier elsewhere (kvstore.shared_tier) keeps this scheduler side's decisions and brings
    # its own index and worker side.
    def _make_index(self, capacity_blocks: int) -> HostIndex:
        return HostIndex(capacity_blocks, self.block_size)

    def _make_pool(self, capacity_bytes: int) -> HostPool | None:
        return HostPool(capacity_bytes)

    # ---- scheduler side -----------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        rid, bs = request.request_id, self.block_size
        self._matches.pop(rid, None)
        if rid in self._refused or num_computed_tokens % bs or (
                request.sampling_params.prompt_logprobs is not None and not request.output_token_ids):
            return 0, False  # prompt logprobs need every position computed, as for local hits
        start = num_computed_tokens // bs
        # NOTE: never the block holding the last token: the model must run on at least one.
        stop = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        n = self.index.prefix_hits(request.block_hashes, start, stop) if stop > start else 0
        if n == 0:
            return 0, False
        self._matches[rid] = start
        return n * bs, True

    def update_state_after_alloc(self, request: Request, block_ids: GroupBlockIds, num_external_tokens: int) -> None:
        rid = request.request_id
        # Admitted (again, after a load or a preemption): its blocks from the first on.
        self._tracked[rid] = _Tracked(request, list(block_ids[0]))
        start = self._matches.pop(rid, None)
        if num_external_tokens <= 0 or start is None:
            return
        stop = start + num_external_tokens // self.block_size
        hashes = request.block_hashes[start:stop]
        self.index.touch(hashes)
        self._meta.loads.append(LoadSpec(rid, tuple(zip(hashes, block_ids[0][start:stop]))))
        self._loading[rid] = hashes

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> OffloadMetadata:
        """Stores for the blocks this step makes final, within the step's budget."""
        for rid in scheduler_output.preempted_req_ids:
            self._tracked.pop(rid, None)  # its blocks are gone; re-admission tracks it again
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if rid in self._tracked:
                self._tracked[rid].block_ids.extend(new_ids)
        budget = self.store_blocks_per_step
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(rid)
            if tracked is None or budget == 0:
                continue
            request = tracked.request
            # num_computed_tokens is still the count before this step. Drafts verified in this
            # step may be rejected, so their positions are not final yet.
            final = request.num_computed_tokens + n - len(request.spec_token_ids)
            num_full = min(final // self.block_size, len(tracked.block_ids), len(request.block_hashes))
            budget = self._store(tracked, num_full, budget)
        meta, self._meta = self._meta, OffloadMetadata()
        return meta

    def _store(self, tracked: _Tracked, num_full: int, budget: int) -> int:
        hashes = tracked.request.block_hashes
        i = tracked.next_block
        while i < num_full:
            block_hash = hashes[i]
            if block_hash not in self.index:
                if budget == 0:
                    break
                budget -= 1
                for gone in self.index.add(block_hash, hashes[i - 1] if i else None):
                    self._meta.ops.append((gone, EVICT))
                self._meta.ops.append((block_hash, tracked.block_ids[i]))
            i += 1
        tracked.next_block = i
        return budget

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_recving:
            self._loading.pop(rid, None)
        for rid in output.failed_recving:
            hashes = self._loading.pop(rid, None)
            if hashes is None:
                continue  # another connector's load
            # Which of its blocks was refused is the worker's to know; dropping all of them
            # keeps the index and every rank's pool the same, at the price of a few good ones.
            self._refused.add(rid)
            for gone in self.index.remove(hashes):
                self._meta.ops.append((gone, EVICT))

    def request_finished(self, request: Request, block_ids: GroupBlockIds) -> tuple[bool, KVTransferParams | None]:
        """Its final blocks were copied out in the step that computed them: nothing to hold."""
        rid = request.request_id
        for state in (self._tracked, self._matches, self._loading):
            state.pop(rid, None)
        self._refused.discard(rid)
        return False, None

    def take_kv_events(self) -> list:
        return self.index.take_events() if self.index is not None else []

    def kv_held(self) -> dict[str, tuple[bytes, ...]]:
        return {HOST: self.index.hashes()} if self.index is not None else {}

    # ---- worker side --------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: list, layer_groups: list[int] | None = None) -> None:
        if layer_groups and any(layer_groups):
            raise ValueError("the host KV tier holds one KV cache group; this model has sliding-window layers")
        self._paged = PagedBlocks(kv_caches, self.block_size)

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        """Loads complete within the step that starts them, which reports them: nothing ever
        waits on this connector between steps."""

    def start_load_kv(self, metadata: OffloadMetadata | None) -> None:
        """Write the blocks of this step's loads, each request's all or none."""
        if metadata is None:
            return
        paged = self._paged
        for spec in metadata.loads:
            try:
                blocks = [self.pool.get(h, paged.block_shape, paged.dtype) for h, _ in spec.blocks]
            except RefusedBlock as e:
                self._finished.failed_recving[spec.request_id] = f"host KV refused: {e}"
                self.stats["host_refused"] += 1
                continue
            for (_, block_id), data in zip(spec.blocks, blocks):
                paged.copy_in(block_id, data)
            self._finished.finished_recving.add(spec.request_id)
            self.stats["host_loads"] += len(blocks)
            self.stats["host_hit_tokens"] += len(blocks) * self.block_size
            self.stats["host_bytes_in"] += len(blocks) * paged.block_bytes

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole blocks written before the forward pass starts."""

    def save_kv_layer(self, layer_name: str, kv_layer: object, attn_metadata: object) -> None:
        """Blocks are copied out whole after the forward pass, not layer by layer."""

    def wait_for_save(self, metadata: OffloadMetadata | None) -> None:
        """Evict and copy out, in the order the scheduler side decided (after this step's
        loads, so a block loaded now is never evicted before it is read). The step's copies are
        all started before the one wait for them, so host memory may exceed the tier's size
        by one step's budget for that moment."""
        if metadata is None or not metadata.ops:
            return
        paged = self._paged
        copies = [paged.copy_out(block_id) if block_id != EVICT else None for _, block_id in metadata.ops]
        paged.synchronize()  # the checksums below read the copied bytes
        for (block_hash, block_id), data in zip(metadata.ops, copies):
            if block_id == EVICT:
                self.stats["host_evictions"] += block_hash in self.pool
                self.pool.drop(block_hash)
                continue
            self.pool.put(block_hash, data)
            self.stats["host_stores"] += 1
            self.stats["host_bytes_out"] += paged.block_bytes

    def get_finished(self) -> KVConnectorOutput:
        finished, self._finished = self._finished, KVConnectorOutput()
        return finished

    def transfer_stats(self) -> dict[str, int | float]:
        pool = self.pool
        return {**self.stats, "host_bytes_held": pool.bytes_held if pool else 0,
                "host_blocks_held": len(pool) if pool else 0,
                "host_self_evictions": pool.self_evictions if pool else 0}
