"""What the app builder (cluster.launch.app) hands each ingress replica: typed, frozen, and
plain enough for Serve to ship in the deployment's arguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.http.body_limits import BodyLimits
from cluster.http.lora import LoRAModule
from cluster.http.migration import DEFAULT_MIGRATION_LIMIT
from cluster.http.request_limits import RequestLimits
from cluster.http.structured_config import StructuredOutputsConfig
from cluster.pd.placement import LocalPrefillRule, PrefillFallback
from engine.args import EngineArgs


@dataclass(frozen=True)
class DirectSettings:
    """Direct streaming: the engine this ingress replica runs itself (cluster.replica.server)."""

    server_kwargs: dict  # cluster.replica.server.EngineServer's keyword arguments
    report_period_s: float  # how often it reports its figures to the Coordinator


@dataclass(frozen=True)
class IngressSettings:
    mode: str  # "pd" or "colocated"
    engine_args: EngineArgs  # the engine the requests are validated for
    served_model_name: str
    app_name: str
    max_pending_requests: int = 1024  # admitted at once; beyond it: 429 + Retry-After
    body_limits: BodyLimits = field(default_factory=BodyLimits)  # size and arrival time of a body
    request_limits: RequestLimits = field(default_factory=RequestLimits)  # the lists a body carries
    load_failure_policy: str = "fail"
    # When the app was built: the same on every ingress replica (`/v1/models` answers alike).
    created: int = 0
    local_prefill: LocalPrefillRule = field(default_factory=LocalPrefillRule)
    prefill_fallback: PrefillFallback = field(default_factory=PrefillFallback)  # decode-only fallback
    migration_limit: int = DEFAULT_MIGRATION_LIMIT  # migrations of a request whose engine failed (0: none)
    # SHA-256 digests only: the keys themselves never enter the Serve config or its logs.
    api_key_digests: tuple[str, ...] = ()
    metrics_without_key: bool = False  # /metrics open even with keys set
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (vLLM's flag)
    direct: DirectSettings | None = None
    # Tool calling: "auto" tool choice allowed, and the parser that finds the calls.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None  # cluster.http.reasoning
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # LoRA (engine_args.enable_lora): adapters served from the start, and whether
    # /v1/load_lora_adapter and /v1/unload_lora_adapter may change them (cluster.http.lora).
    lora_modules: tuple[LoRAModule, ...] = ()
    lora_runtime_updates: bool = False
