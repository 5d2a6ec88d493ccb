"""Which prefill / decode replica gets a request (least load, 4*waiting + running, as vLLM's DP load balancer scores it).

The load figures come from the replicas themselves (`record_routing_stats`, collected by Serve
every `request_routing_stats_period_s` and handed to every router). Between two reports a
router only knows what it sent itself, so each request it routed to a replica since that
replica's last report counts as one more waiting request there; without that correction a
burst would pile onto whichever replica looked idlest at the last report.

Router modes (`--router-mode`, docs/kv_cache.md#kv-aware-routing): "least-loaded" (the
default, above); "kv": precise KV-aware routing, each replica's cached prefix blocks known from
its KV events (a compact list of block-hash keys in its routing stats, rebuilt into this
router's PrefixIndex whenever the replica's event count moved), cost = overlap weight * blocks
to prefill + load (engine.kv_cache.kv_routing); "prefix-affinity" (below); "round-robin".

Prefix affinity (optional) sends prompts that start with the same tokens to the same replica,
where their prefix blocks are already cached, as long as that replica is not much busier than
the least loaded one (`affinity_slack`, in load units).

LoRA affinity (always on) does the same for a request that names an adapter: a replica that
holds it (its engine ran it lately, so its weights are in that engine's host cache or slots)
goes first unless it is busier by more than the slack, as Serve's model multiplexing prefers
replicas that have the model loaded; when none holds it, its rendezvous home does, so one
adapter's requests gather on one replica instead of loading everywhere.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from cluster.replica import router_stats
from engine.engine_request import EngineRequest
from engine.kv_cache.events import MEDIA, KVSnapshot
from engine.kv_cache.kv_routing import DEFAULT_OVERLAP_WEIGHT, prompt_block_hashes
from engine.kv_cache.kv_routing import rank as kv_rank
from engine.kv_cache.prefix_index import PrefixIndex, unpack

WAITING_WEIGHT = 4
ROUTER_MODES = ("least-loaded", "kv", "prefix-affinity", "round-robin")
# How long a router counts a prompt's blocks as held by the replica it sent the prompt to,
# before that replica's own report says so: its reports come every routing-stats period
# (0.5 s by default) after it computed them, and a chat's next turn often comes sooner.
PREDICTION_TTL_S = 10.0


@dataclass(frozen=True)
class Candidate:
    key: str  # the replica's unique id
    running: int
    waiting: int
    sent_since_report: int = 0
    loras: frozenset[str] = frozenset()  # adapters the replica holds

    @property
    def load(self) -> int:
        return WAITING_WEIGHT * (self.waiting + self.sent_since_report) + self.running


def affinity_key(prompt_token_ids: list[int] | None, prefix_tokens: int) -> str | None:
    """The key of a prompt's first `prefix_tokens` tokens; None when the prompt is shorter
    (nothing worth keeping together)."""
    if not prompt_token_ids or len(prompt_token_ids) < prefix_tokens:
        return None
    head = ",".join(map(str, prompt_token_ids[:prefix_tokens]))
    return hashlib.sha1(head.encode()).hexdigest()


def _rendezvous(key: str, replica_key: str) -> int:
    return int.from_bytes(hashlib.sha1(f"{key}|{replica_key}".encode()).digest()[:8], "big")


def rank(candidates: list[Candidate], affinity: str | None = None, affinity_slack: int = 8,
         rng: random.Random | None = None, lora: str | None = None) -> list[str]:
    """Replica keys, most preferred first: least load first (ties by key, or in random order
    with `rng`, so that idle replicas share light traffic); with an affinity key, its home
    replica (highest rendezvous hash, which stays put when other replicas come and go) moves
    to the front unless its load exceeds the least load by more than `affinity_slack`. With
    a LoRA adapter's name, the home is the least loaded replica holding it (else the name's
    rendezvous home), under the same slack; the adapter outranks a prefix."""
    if rng is None:
        ordered = sorted(candidates, key=lambda c: (c.load, c.key))
    else:
        ordered = sorted(candidates, key=lambda c: (c.load, rng.random()))
    if not ordered or (affinity is None and lora is None):
        return [c.key for c in ordered]
    if lora is not None:
        holders = [c for c in ordered if lora in c.loras]
        home = holders[0] if holders else max(ordered, key=lambda c: _rendezvous("lora:" + lora, c.key))
    else:
        home = max(ordered, key=lambda c: _rendezvous(affinity, c.key))
    if home.load <= ordered[0].load + affinity_slack:
        ordered.remove(home)
        ordered.insert(0, home)
    return [c.key for c in ordered]


class LeastLoadRouter(FIFOMixin, RequestRouter):
    """Serve request router for the engine deployments (configured in cluster.launch.app).

    FIFO: without it Serve matches a chosen replica to the pending request by its internal
    request id, which all calls made while serving one HTTP request share (a batched
    completion's prompts): the second one then waited for minutes (found by the tests). The
    price: while requests queue in the router, the replica chosen for one request's prefix
    may serve the oldest pending one instead, so prefix affinity is best-effort under load."""

    def initialize_state(self, prefix_affinity: bool = False, affinity_prefix_tokens: int = 32,
                         affinity_slack: int = 8, router_mode: str | None = None,
                         kv_overlap_score_weight: float = DEFAULT_OVERLAP_WEIGHT, **kwargs) -> None:
        # `prefix_affinity` is the older name of router_mode="prefix-affinity".
        self._mode = router_mode or ("prefix-affinity" if prefix_affinity else "least-loaded")
        if self._mode not in ROUTER_MODES:
            raise ValueError(f"router_mode must be one of {', '.join(ROUTER_MODES)}, got {self._mode!r}")
        self._affinity_prefix_tokens = affinity_prefix_tokens
        self._affinity_slack = affinity_slack
        self._kv_weight = kv_overlap_score_weight
        # replica key -> (report sequence number it applies to, requests sent since)
        self._sent: dict[str, tuple[object, int]] = {}
        self._rng = random.Random()
        self._kv_index = PrefixIndex()
        self._routing: dict[str, list[bytes]] = {}  # request id -> its block hashes, until routed
        self._turn = 0  # round robin

    def _candidate(self, replica: RunningReplica) -> Candidate:
        stats = replica.routing_stats or {}
        key = replica.replica_id.unique_id
        seq, sent = self._sent.get(key, (None, 0))
        if seq != stats.get("seq"):
            sent = 0  # the replica reported since: its figures include what we sent before
        return Candidate(key, int(stats.get("running", 0)), int(stats.get("waiting", 0)), sent,
                         frozenset(stats.get("loras", ())))

    def _follow_kv(self, replicas: list[RunningReplica]) -> int | None:
        """Bring the index up to what each replica last reported; its block size (None: no
        replica reports its KV yet)."""
        block_size = None
        for replica in replicas:
            key, kv = replica.replica_id.unique_id, (replica.routing_stats or {}).get("kv")
            if kv is None:
                self._kv_index.drop(key)
                continue
            block_size = kv["block_size"]
            if self._kv_index.seq(key) != kv["seq"]:
                self._kv_index.replace(key, KVSnapshot(kv["seq"], {m: unpack(kv.get(m, b"")) for m in MEDIA}))
        live = {r.replica_id.unique_id for r in replicas}
        for key in self._kv_index.sources():
            if key not in live:
                self._kv_index.drop(key)  # a replica gone: its entries expire with it
        return block_size

    def _kv_order(self, request: EngineRequest, replicas: list[RunningReplica],
                  candidates: list[Candidate]) -> tuple[list[str], str] | None:
        block_size = self._follow_kv(replicas)
        if block_size is None or request.prompt_token_ids is None:
            return None
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        hashes = prompt_block_hashes(request.prompt_token_ids, block_size, request.cache_salt, lora,
                                     getattr(request, "mm_features", None))
        if not hashes:
            return None
        choice = kv_rank([(c.key, c.load) for c in candidates], lambda k: self._kv_index.match(k, hashes),
                         len(hashes), self._kv_weight, self._rng)
        if len(self._routing) > 4096:  # requests whose routing never completed
            self._routing.clear()
        self._routing[request.request_id] = hashes
        return choice.order, choice.reason

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        name = self._deployment_id.name if getattr(self, "_deployment_id", None) is not None else ""
        target = (pending_request.kwargs or {}).get("replica") if pending_request is not None else None
        if target is not None:
            # A call for one replica (a subscription or an abort). If it is gone, any replica
            # takes the call and refuses it, so the caller learns at once (never waits).
            return [[by_key[target]]] if target in by_key else [candidate_replicas[:1]]
        avoid = (pending_request.kwargs or {}).get("avoid") if pending_request is not None else None
        if avoid:
            # Replicas whose engine failed under the caller's requests (a migrated request must
            # not land there again): passed over while any other is a candidate.
            kept = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
            candidate_replicas = kept or candidate_replicas
            by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        affinity = lora = None
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        candidates = [self._candidate(r) for r in candidate_replicas]
        order = reason = None
        if isinstance(request, EngineRequest):  # a submit or a prefill
            lora = request.lora_request.lora_name if request.lora_request is not None else None
            if self._mode == "prefix-affinity":
                affinity = affinity_key(request.prompt_token_ids, self._affinity_prefix_tokens)
            elif self._mode == "kv" and lora is None:  # an adapter's home outranks a prefix
                order, reason = self._kv_order(request, candidate_replicas, candidates) or (None, None)
            elif self._mode == "round-robin":
                keys = sorted(by_key)
                self._turn += 1
                order, reason = keys[self._turn % len(keys):] + keys[:self._turn % len(keys)], "round_robin"
        if order is None:
            order = rank(candidates, affinity, self._affinity_slack, self._rng, lora)
            reason = "lora" if lora else "prefix_affinity" if affinity else "load"
        if request is not None:
            router_stats.DECISIONS[(name, reason)] += 1
        # One replica per rank: Serve tries them in this order, skipping full ones.
        return [[by_key[k]] for k in order]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        if pending_request is not None and (pending_request.kwargs or {}).get("replica") is not None:
            return  # a subscription or an abort adds no work
        key = replica_id.unique_id
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        hashes = self._routing.pop(request.request_id, None) if isinstance(request, EngineRequest) else None
        if hashes:
            self._kv_index.predict(key, hashes, PREDICTION_TTL_S)
        replica = self._replicas.get(replica_id)
        seq = (replica.routing_stats or {}).get("seq") if replica is not None else None
        prev_seq, sent = self._sent.get(key, (None, 0))
        self._sent[key] = (seq, (sent if prev_seq == seq else 0) + 1)
