"""The `pdserve` Serve application's configuration: `AppConfig`, one frozen dataclass of the
app's own fields beside its EngineArgs, validated when made (each refusal names its field,
before Ray starts), and what it resolves per role (engine arguments, resources, placement).
cluster.launch.app builds the deployments from it; the flags are documented once, in
docs/serving.md#flags.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from actors.ray_executor import replica_bundles
from cluster.control.autoscale import build_config
from cluster.control.capacity import auto_replica_cpus
from cluster.control.coordinator import SCALE_TIMEOUT_S
from cluster.http.body_limits import MAX_REQUEST_BODY_BYTES, REQUEST_BODY_TIMEOUT_S, BodyLimits
from cluster.http.lora import LoRAModule
from cluster.http.migration import DEFAULT_MIGRATION_LIMIT
from cluster.http.request_limits import RequestLimits
from cluster.launch.app_checks import (
    check_bounds,
    check_core_process,
    check_direct,
    check_tool_flags,
    direct_by_default,
    direct_role,
)
from cluster.pd.placement import MAX_PREFILL_QUEUE_SIZE, PREFILL_TIMEOUT_S, PrefillFallback
from cluster.replica.host import cluster_engine_args
from cluster.roles import Role
from engine.args import EngineArgs
from engine.errors import ParameterError, check_choice, check_int
from engine.kv_cache.kv_routing import DEFAULT_OVERLAP_WEIGHT
from engine.kv_connector import LOAD_FAILURE_POLICIES
from engine.models.arch import load_arch
from engine.models.default_model import require_model_dir, served_name
from kvstore.reshard import check_pd_sizes

MODES = ("pd", "colocated")
# Least time between two streamed messages of an engine replica to an ingress (Ray Serve
# LLM's stream_batching_interval_ms has the same default). Measured on 2 CPU cores at
# concurrency 8: 50 ms carried 1.9-3.4 tokens per SSE chunk and cut the CPU outside the
# engines by a quarter to almost half, TTFT unchanged (the first message is never held);
# 10 ms never coalesced there (docs/benchmarks.md#stream-interval).
STREAM_INTERVAL_MS = 50.0
# Prompts per prefill replica before a P/D prompt may prefill on its decode replica. Measured
# on 2 CPU cores at concurrency 8 over four rounds: mean TTFT p95 9.0 s against 15.8 s with
# strict disaggregation and 9.4 s colocated, throughput within noise, median ITL 1-41% higher
# (docs/benchmarks.md#http-against-offline-with-guidellm); 1 moved more prompts for no better p95. Not measured
# on GPUs.
LOCAL_PREFILL_QUEUE = 2


@dataclass(frozen=True)
class AppConfig:
    engine_args: EngineArgs  # the same engine on every replica; the ingress validates with it
    mode: str = "pd"
    prefill_replicas: int = 1
    decode_replicas: int = 1
    colocated_replicas: int = 1
    served_model_name: str | None = None
    app_name: str = "pdserve"
    # The old name of engine_args.kv_load_failure_policy (vLLM's name), still taken: given, it
    # sets the engine argument; None: the engine argument's. Either way both read the same.
    load_failure_policy: str | None = None
    # Ingress replicas (vLLM's --api-server-count): each tokenizes, validates and streams its
    # share of the HTTP requests in a process of its own; /metrics shows their sum.
    api_server_count: int = 1
    max_pending_requests: int = 1024  # per ingress replica; beyond it: 429 + Retry-After
    # Request bodies (cluster.http.body_limits): a larger one is a 413 before it is read, one
    # that takes longer to arrive a 408.
    max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES
    request_body_timeout_s: float = REQUEST_BODY_TIMEOUT_S
    max_ongoing_requests: int = 1024  # per engine replica (Serve's own cap)
    # The lists and sizes one request body may carry (cluster.http.request_limits): past one, a
    # 400 naming the field before any per-item work.
    max_tools: int = RequestLimits.max_tools
    max_stop_strings: int = RequestLimits.max_stop_strings
    max_bad_words: int = RequestLimits.max_bad_words
    max_guided_choices: int = RequestLimits.max_guided_choices
    max_guided_bytes: int = RequestLimits.max_guided_bytes
    max_image_pixels: int = RequestLimits.max_image_pixels
    # /metrics without the API key (for a Prometheus that cannot send one); /health always is.
    metrics_without_key: bool = False
    # Serve an app without keys on a non-loopback HTTP host (cluster.launch.open_doors).
    allow_unauthenticated_admin: bool = False
    # vLLM's: usage.prompt_tokens_details.cached_tokens in chat and completions answers.
    enable_prompt_tokens_details: bool = False
    graceful_shutdown_timeout_s: float = 60.0
    # How often a stopping replica looks whether its in-flight requests are done (Serve's
    # option of that name; it waits one period before its first look).
    graceful_shutdown_wait_loop_s: float = 2.0
    # Serve's health-check period for engine replicas: a replica whose engine died is replaced
    # after three failed checks in a row.
    health_check_period_s: float = 5.0
    # > 0: a request's outputs after its first come at most this often, each carrying the
    # steps since the last (Ray Serve LLM's stream_batching_interval_ms): a direct-streaming
    # ingress reads its own engine so, and routed engine replicas send their per-step messages so.
    stream_interval_ms: float = STREAM_INTERVAL_MS
    # How the engine deployments' router picks a replica (cluster.replica.router.ROUTER_MODES;
    # None: "prefix-affinity" when prefix_affinity, its older switch, else "least-loaded").
    # "kv" turns on the KV events of the engines it routes to (docs/kv_cache.md#kv-aware-routing).
    router_mode: str | None = None
    prefix_affinity: bool = False
    kv_overlap_score_weight: float = DEFAULT_OVERLAP_WEIGHT
    # Conditional disaggregation (cluster.pd.placement): once the prefill replicas hold this
    # many of an ingress's prompts each, its next prompt may prefill on its decode replica
    # (the shorter queue); 0: always on a prefill replica.
    local_prefill_queue: int = LOCAL_PREFILL_QUEUE
    # P/D prompts of at most this many tokens prefill on their decode replica (0: none).
    max_local_prefill_length: int = 0
    # Decode-only fallback (cluster.pd.placement.PrefillFallback, docs/pd.md#decode-only-fallback):
    # a prompt no prefill replica can take soon prefills on its decode replica, or with
    # enforce_disagg (Dynamo's name) is refused with a 503.
    enforce_disagg: bool = False
    prefill_timeout_s: float = PREFILL_TIMEOUT_S  # the least time a prefill call gets (0: no bound)
    max_prefill_queue_size: int = MAX_PREFILL_QUEUE_SIZE  # prompts per prefill replica (0: no bound)
    migration_limit: int = DEFAULT_MIGRATION_LIMIT  # Dynamo's: a request's engine fails, it goes on elsewhere
    routing_stats_period_s: float = 0.5
    # CPUs Ray reserves per engine replica, which are also its torch threads (Ray sets
    # OMP_NUM_THREADS to them). None: 1 with GPUs; on CPU the cluster's CPUs shared among the
    # engine replicas (cluster.control.capacity.auto_replica_cpus), resolved when the app is built.
    replica_num_cpus: float | None = None
    # Torch threads of each engine replica when they should differ from its CPUs (None: the
    # same). More threads than CPUs lets replicas sharing a node use each other's idle cores.
    replica_num_threads: int | None = None
    replica_num_gpus: float | None = None  # None: see num_gpus
    # Tensor-parallel size of each P/D role (None: engine_args.tensor_parallel_size). They may
    # differ: decode ranks re-shard the prefill ranks' KV by head (kvstore.reshard).
    prefill_tensor_parallel_size: int | None = None
    decode_tensor_parallel_size: int | None = None
    # Data-parallel engine cores of each P/D role's replica (None: engine_args.data_parallel_size).
    # Each core schedules its own requests, so the two may differ.
    prefill_data_parallel_size: int | None = None
    decode_data_parallel_size: int | None = None
    max_replicas: int = 8  # per role: the ceiling of POST /scale (and of autoscaling by default)
    # Bearer keys guarding /v1/*, /scale, /status (cluster.http.auth); PDSERVE_API_KEY adds more.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    # The cluster's autoscaler may add nodes: a scale target that does not fit the free
    # resources now is accepted (and /status shows what it waits for) instead of a 409.
    cluster_autoscaling: bool = False
    scale_timeout_s: float = SCALE_TIMEOUT_S  # a target not reached by then is reported stuck
    autoscale: dict | None = None  # cluster.control.autoscale.AutoscaleConfig fields; {"enabled": True} turns it on
    # The ingress's one line per HTTP request in Serve's replica log (like uvicorn's access log
    # in vLLM, on by default). The internal calls between deployments are never logged.
    disable_access_log: bool = False
    # Each ingress replica runs its own engine (its core in a child process) instead of calling
    # an engine deployment, so a streamed token takes no hop between replicas (Ray Serve LLM's
    # direct streaming; vLLM's API server + engine core): the colocated engine, or in P/D the
    # decode engine (prefills still go to the Prefill deployment); `colocated_replicas` or
    # `decode_replicas` counts them (cluster.replica.server). None: on unless something needs an
    # engine deployment behind the ingress (api_server_count > 1, prefix_affinity in colocated
    # mode, tensor or data parallel of that role); True insists (and refuses those), False not.
    direct_streaming: bool | None = None
    # Tool calling (vLLM's --enable-auto-tool-choice / --tool-call-parser): "auto" tool choice
    # turns the model's text into tool_calls with this parser (cluster.http.tool_parsers).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # vLLM's: <think> text as reasoning_content (cluster.http.reasoning)
    # vLLM's --structured-outputs-config, JSON text or a dict (cluster.http.structured_config)
    structured_outputs_config: str | dict | None = None
    # vLLM's --lora-modules ("name=path" or JSON; needs enable_lora) and run-time LoRA routes
    lora_modules: tuple[str, ...] = ()
    enable_lora_runtime_updating: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.engine_args, EngineArgs):
            raise ParameterError("engine_args", f"engine_args must be an EngineArgs, got "
                                 f"{type(self.engine_args).__name__}")
        check_choice("mode", self.mode, MODES)
        if self.load_failure_policy is not None:
            check_choice("load_failure_policy", self.load_failure_policy, LOAD_FAILURE_POLICIES)
            # NOTE: normalised once here, so the servers, the ingress and the engines read one value.
            object.__setattr__(self, "engine_args", dataclasses.replace(
                self.engine_args, kv_load_failure_policy=self.load_failure_policy))
        object.__setattr__(self, "load_failure_policy", self.engine_args.kv_load_failure_policy)
        for name in ("prefill_replicas", "decode_replicas", "colocated_replicas", "api_server_count",
                     "max_pending_requests", "max_ongoing_requests", "max_replicas"):
            check_int(name, getattr(self, name))
        check_int("local_prefill_queue", self.local_prefill_queue, minimum=0)
        check_int("max_local_prefill_length", self.max_local_prefill_length, minimum=0)
        require_model_dir(self.engine_args.model)
        self.engine_args.create_engine_config()  # every engine field, checked before Ray starts
        check_tool_flags(self.enable_auto_tool_choice, self.tool_call_parser)
        if self.lora_modules and not self.engine_args.enable_lora:
            raise ParameterError("lora_modules", "lora_modules needs enable_lora (--enable-lora)")
        self.lora_module_list()  # each entry parses
        self.body_limits()  # checks both bounds
        self.request_limits()  # checks each bound
        self.prefill_fallback()  # checks its bounds
        if isinstance(self.api_keys, str) or not all(isinstance(k, str) and k for k in self.api_keys):
            raise ParameterError("api_keys", "api_keys must be a list of non-empty strings")
        check_bounds(self)
        for role, n in self.targets().items():
            if n > self.max_replicas:
                raise ParameterError(f"{role}_replicas",
                                     f"{role}_replicas must be <= max_replicas ({self.max_replicas})")
        build_config(self.autoscale, self.max_replica_map())  # validates, as the Coordinator will build it
        for name in ("prefill_tensor_parallel_size", "decode_tensor_parallel_size", "prefill_data_parallel_size",
                     "decode_data_parallel_size"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        if self.direct_streaming not in (None, True, False):
            raise ParameterError("direct_streaming", f"direct_streaming must be true, false or null (auto), "
                                 f"got {self.direct_streaming!r}")
        if self.direct:  # refusals only when asked for; the core process's config always
            check_direct(self.mode, self.api_server_count, self.routed,
                         self.role_engine_args(self.direct_role))
        if self.engine_args.engine_core_process:
            check_core_process([self.role_engine_args(role) for role in self.targets()])
        if self.mode == "pd":
            # Decode ranks re-shard the prefill ranks' KV by head (kvstore.reshard): any sizes may pair.
            arch = load_arch(self.model)
            check_pd_sizes(arch.num_heads, arch.num_kv_heads, {
                "prefill_tensor_parallel_size": self.tensor_parallel_size(Role.PREFILL),
                "decode_tensor_parallel_size": self.tensor_parallel_size(Role.DECODE)})

    def lora_module_list(self) -> tuple[LoRAModule, ...]:
        if isinstance(self.lora_modules, str):
            raise ParameterError("lora_modules", "lora_modules must be a list of name=path entries")
        return tuple(LoRAModule.parse(m) for m in self.lora_modules)

    def request_limits(self) -> RequestLimits:
        return RequestLimits(self.max_tools, self.max_stop_strings, self.max_bad_words, self.max_guided_choices,
                             self.max_guided_bytes, self.max_image_pixels)

    def body_limits(self) -> BodyLimits:
        return BodyLimits(self.max_request_body_bytes, self.request_body_timeout_s)

    def prefill_fallback(self) -> PrefillFallback:
        return PrefillFallback(self.enforce_disagg, self.prefill_timeout_s, self.max_prefill_queue_size)

    @property
    def direct(self) -> bool:
        """Whether the ingress replicas run the engines of `direct_role` themselves (cluster.replica.server)."""
        if self.direct_streaming is not None:
            return self.direct_streaming
        return direct_by_default(self.mode, self.api_server_count, self.routed,
                                 self._parallel_args(self.direct_role))

    @property
    def resolved_router_mode(self) -> str:
        return self.router_mode or ("prefix-affinity" if self.prefix_affinity else "least-loaded")

    @property
    def routed(self) -> bool:
        """Whether colocated requests need pdserve's router (any mode but least-loaded, which
        the HTTP proxy's spreading matches)."""
        return self.resolved_router_mode != "least-loaded"

    def router_kwargs(self) -> dict:
        return {"router_mode": self.resolved_router_mode, "kv_overlap_score_weight": self.kv_overlap_score_weight}

    @property
    def direct_role(self) -> Role:
        return direct_role(self.mode)

    @classmethod
    def from_flat(cls, args: dict) -> AppConfig:
        """An AppConfig from one flat mapping of AppConfig and EngineArgs fields (a Serve
        config's `args:`). Unknown keys are an error listing the allowed ones."""
        app_keys = {f.name for f in dataclasses.fields(cls)} - {"engine_args"}
        engine_keys = set(EngineArgs.field_names())
        unknown = sorted(set(args) - app_keys - engine_keys)
        if unknown:
            raise ValueError(f"unknown app arguments {unknown}; allowed: {sorted(app_keys | engine_keys)}")
        engine_args = EngineArgs(**{k: v for k, v in args.items() if k in engine_keys})
        return cls(engine_args=engine_args, **{k: v for k, v in args.items() if k in app_keys})

    @property
    def model(self) -> str:
        return self.engine_args.model

    def targets(self) -> dict[Role, int]:
        """Each role's replica count at start-up."""
        if self.mode == "pd":
            return {Role.PREFILL: self.prefill_replicas, Role.DECODE: self.decode_replicas}
        return {Role.COLOCATED: self.colocated_replicas}

    def max_replica_map(self) -> dict[str, int]:
        return {r: self.max_replicas for r in self.targets()}

    @property
    def model_name(self) -> str:
        return served_name(self.model, self.served_model_name)

    def tensor_parallel_size(self, role: Role) -> int:
        own = {Role.PREFILL: self.prefill_tensor_parallel_size, Role.DECODE: self.decode_tensor_parallel_size}.get(role)
        return own if own is not None else self.engine_args.tensor_parallel_size

    def data_parallel_size(self, role: Role) -> int:
        own = {Role.PREFILL: self.prefill_data_parallel_size, Role.DECODE: self.decode_data_parallel_size}.get(role)
        return own if own is not None else self.engine_args.data_parallel_size

    def _parallel_args(self, role: Role) -> EngineArgs:
        """The engine args with `role`'s own tensor and data parallel sizes."""
        return dataclasses.replace(self.engine_args, tensor_parallel_size=self.tensor_parallel_size(role),
                                   data_parallel_size=self.data_parallel_size(role))

    def role_engine_args(self, role: Role) -> EngineArgs:
        """The engine of `role`'s replicas; its ranks (tp > 1) and data-parallel cores (dp > 1)
        are Ray actors unless the config names another backend."""
        args = cluster_engine_args(self._parallel_args(role))
        if self.resolved_router_mode == "kv" and role in (Role.PREFILL, Role.COLOCATED):
            # The router places these roles' requests by the prefix blocks their engines tell of.
            args = dataclasses.replace(args, kv_events_config={"enable_kv_cache_events": True})
        if self.direct and role == self.direct_role:
            # The ingress's event loop serves HTTP: its engine must not hold the GIL while it
            # steps (measured: an engine thread in the ingress cost throughput, docs/benchmarks.md#engine-core-process).
            args = dataclasses.replace(args, engine_core_process=True)
        return args

    def replica_cpus(self) -> float:
        """CPUs each engine replica reserves (its ranks' and cores' threads included)."""
        if self.replica_num_cpus is not None:
            return self.replica_num_cpus
        if self._engines_on_gpus():
            return 1.0  # the engine's own host thread; the GPU does the work
        raise RuntimeError("replica_num_cpus is sized from the cluster on CPU: use AppConfig.sized_for first")

    def sized_for(self, node_cpus: list[float]) -> AppConfig:
        """This config with `replica_num_cpus` decided for a cluster of these nodes' CPUs
        (unchanged when it was given, or on GPUs). An app that scales itself shares the CPUs
        among its largest replica counts, so scaling up finds room."""
        if self.replica_num_cpus is not None or self._engines_on_gpus():
            return self
        autoscaling = build_config(self.autoscale, self.max_replica_map()).enabled
        replicas = sum((self.max_replica_map() if autoscaling else self.targets()).values())
        return dataclasses.replace(self, replica_num_cpus=auto_replica_cpus(node_cpus, replicas))

    def _engines_on_gpus(self) -> bool:
        # A GPU reservation given explicitly counts too: a CPU-only head node (where this runs)
        # may deploy replicas onto GPU workers.
        return self.uses_gpus() or (self.replica_num_gpus or 0.0) > 0

    def uses_gpus(self) -> bool:
        if self.engine_args.device != "auto":
            return self.engine_args.device == "cuda"
        import torch

        return torch.cuda.is_available()

    def num_gpus(self, role: Role | None = None) -> float:
        """GPUs the replica actor itself reserves: one on a GPU machine; one per rank with the
        "mp" executor (its ranks are child processes sharing its reservation); none with the
        "ray" executor (each rank actor holds its own, in the replica's placement group)."""
        if self.replica_num_gpus is not None:
            return self.replica_num_gpus
        if not self.uses_gpus():
            return 0.0
        args = self.role_engine_args(role or next(iter(self.targets())))
        if args.data_parallel_size > 1:
            return 0.0  # its cores (or their rank actors) hold the GPUs, in the replica's group
        if args.tensor_parallel_size == 1:
            return 1.0
        return 0.0 if args.distributed_executor_backend == "ray" else float(args.tensor_parallel_size)

    def placement_bundles(self, role: Role) -> list[dict[str, float]] | None:
        """Serve's placement_group_bundles for a replica of `role` whose ranks or cores are Ray
        actors: data_parallel_size x tensor_parallel_size bundles, the replica actor in bundle 0
        with rank 0 of core 0 (core d's rank r goes to bundle d * tp + r); None otherwise."""
        args = self.role_engine_args(role)
        tp, dp = args.tensor_parallel_size, args.data_parallel_size
        if dp == 1 and (tp == 1 or args.distributed_executor_backend != "ray"):
            return None
        return replica_bundles("cuda" if self.uses_gpus() else "cpu", dp * tp,
                               {"CPU": self.replica_cpus(), "GPU": self.num_gpus(role)})

    def engine_actor_options(self, role: Role) -> dict:
        """Ray actor options of `role`'s replicas: their CPUs, GPUs, and environment (threads
        when `replica_num_threads` is given). CPU engines get OMP_WAIT_POLICY=PASSIVE
        (unless the environment names a policy): by default OpenMP's idle threads spin
        between parallel regions, taking the cores the ingress, the proxy and the other
        role's engine need on the same node (docs/serving.md#threads-of-cpu-engine-replicas). It
        must be in the process's environment before torch loads OpenMP, hence runtime_env;
        rank and core actors the replica starts inherit it."""
        options = {"num_cpus": self.replica_cpus(), "num_gpus": self.num_gpus(role)}
        env = {}
        if not self._engines_on_gpus():
            env["OMP_WAIT_POLICY"] = os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
        if self.replica_num_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.replica_num_threads)  # Ray keeps a value already set
        if env:
            options["runtime_env"] = {"env_vars": env}
        return options

    def role_resources(self, role: Role) -> dict[str, float]:
        """What one replica of `role` reserves in all, its ranks' bundles included."""
        bundles = self.placement_bundles(role) or [{"CPU": self.replica_cpus(), "GPU": self.num_gpus(role)}]
        return {name: sum(b.get(name, 0.0) for b in bundles) for name in ("CPU", "GPU")}

    def replica_resources(self) -> dict[str, float]:
        """What the largest replica of any role reserves in all, its ranks' bundles included
        (the Coordinator's capacity checks before scaling)."""
        totals = [self.role_resources(role) for role in self.targets()]
        return {name: max(t[name] for t in totals) for name in ("CPU", "GPU")}


