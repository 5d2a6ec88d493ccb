"""`pdserve serve`: deploy the app on local Ray (or the cluster in RAY_ADDRESS) and keep it up
until SIGINT/SIGTERM/SIGHUP, then take it down within --shutdown-timeout-s: in-flight requests
finish first, then whatever is left of what it started is killed (cluster/launch/shutdown.py)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback
from typing import NoReturn

from cluster.http.request_limits import RequestLimits
from cluster.http.tool_parsers import TOOL_PARSERS
from cluster.replica.router import ROUTER_MODES
from engine.args import EngineArgs
from engine.kv_cache.kv_routing import DEFAULT_OVERLAP_WEIGHT
from engine.kv_connector import LOAD_FAILURE_POLICIES

# Blocked in the Ray node that `pdserve serve` starts (see run_serve).
NODE_BLOCKED_SIGNALS = {signal.SIGTERM, signal.SIGHUP}


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (P/D or colocated)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mode", default="pd", choices=["pd", "colocated"])
    p.add_argument("--prefill-replicas", type=int, default=1)
    p.add_argument("--decode-replicas", type=int, default=1)
    p.add_argument("--replicas", type=int, default=1, help="engine replicas in colocated mode")
    p.add_argument("--served-model-name", default=None,
                   help="default: SmolLM2-135M-Instruct for the default model, else the model "
                        "directory's name or the .gguf file's name without .gguf")
    # The flag's old name; --kv-load-failure-policy (an engine argument, below) is vLLM's.
    p.add_argument("--load-failure-policy", dest="kv_load_failure_policy", default=argparse.SUPPRESS,
                   choices=LOAD_FAILURE_POLICIES, help="the same as --kv-load-failure-policy")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="ingress replicas: processes that tokenize, validate and stream HTTP requests")
    p.add_argument("--max-pending-requests", type=int, default=1024,
                   help="requests in flight per ingress before answering 429")
    p.add_argument("--max-request-body-bytes", type=int, default=None, metavar="BYTES",
                   help="larger request bodies are refused with 413 before they are read (default: "
                        "AppConfig.max_request_body_bytes, 32 MiB)")
    p.add_argument("--stream-interval-ms", type=float, default=None,
                   help="least time between two streamed outputs of a request after its first, so one SSE "
                        "chunk carries the tokens of several engine steps (0: every step; default: "
                        "AppConfig.stream_interval_ms)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on every route but /health "
                        "(repeatable; PDSERVE_API_KEY, comma-separated, adds more)")
    p.add_argument("--allow-unauthenticated-admin", action="store_true",
                   help="serve without --api-key on a --host other machines can reach (anyone there may then "
                        "call POST /scale); refused otherwise")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in chat and completions answers: the "
                        "prompt tokens found in the prefix cache (the Responses API always says)")
    p.add_argument("--metrics-without-key", action="store_true",
                   help="with --api-key: leave /metrics open (for a Prometheus that sends no key)")
    limits = p.add_argument_group("request limits", "the lists and sizes one request may carry; past one: "
                                  "400 naming the field (docs/serving.md#limits)")
    for name, what in (("max_tools", "tools per request (OpenAI's 128)"), ("max_stop_strings", "stop strings per request"),
                       ("max_bad_words", "bad_words per request"),
                       ("max_guided_choices", "guided_choice (structured_outputs.choice) entries per request"),
                       ("max_guided_bytes", "bytes of a guided JSON schema, regex or grammar"),
                       ("max_image_pixels", "pixels of one image, refused from its header before it is decoded")):
        # The defaults are RequestLimits' (AppConfig's fields take theirs from it too).
        limits.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(RequestLimits, name), help=what)
    p.add_argument("--router-mode", default=None, choices=ROUTER_MODES,
                   help="how a prefill (P/D) or colocated replica is chosen: least-loaded (default), kv (the "
                        "replica that caches most of the prompt, from its KV events, load counted), "
                        "prefix-affinity (the first 32 tokens' home replica), round-robin")
    p.add_argument("--prefix-affinity", action="store_true", help="the same as --router-mode prefix-affinity")
    p.add_argument("--kv-overlap-score-weight", type=float, default=DEFAULT_OVERLAP_WEIGHT,
                   help="--router-mode kv: weight of the blocks a replica would prefill against its load "
                        "(4 per waiting request, 1 per running one)")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=None,
                   help='allow tool_choice "auto": the model decides, --tool-call-parser finds its calls '
                        "(default: off; on, with the hermes parser, for the default model when neither "
                        "flag is given)")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="a reasoning model's <think> text as reasoning_content: deepseek_r1 (the template "
                        "opens <think>), qwen3 (the model writes it, or not with enable_thinking false)")
    p.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help='how JSON schemas are read, as vLLM\'s flag: {"backend": "guidance"} lets an object '
                        "schema without additionalProperties take other keys (default: auto, strict as "
                        "xgrammar); disable_additional_properties makes guidance strict again")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model family's tool-call format: hermes (Qwen2.5/Qwen3/Hermes), llama3_json, mistral")
    p.add_argument("--lora-modules", nargs="+", default=(), metavar="NAME=PATH",
                   help="LoRA adapters served by name (with --enable-lora): name=path or vLLM's JSON form")
    p.add_argument("--enable-lora-runtime-updating", action="store_true",
                   help="allow /v1/load_lora_adapter and /v1/unload_lora_adapter (or set "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)")
    p.add_argument("--direct-streaming", action=argparse.BooleanOptionalAction, default=None,
                   help="each colocated (P/D: decode) replica serves HTTP itself with its engine core in a "
                        "child process (no hop between an ingress and an engine replica; it counts as one of "
                        "--replicas / --decode-replicas). Default: on unless --api-server-count > 1, "
                        "--prefix-affinity in colocated mode, tensor or data parallel need an engine deployment "
                        "behind the ingress")
    p.add_argument("--disable-access-log", action="store_true",
                   help="no line per HTTP request in the ingress's Serve log (vLLM: --disable-uvicorn-access-log)")
    p.add_argument("--local-prefill-queue", type=int, default=None, metavar="N",
                   help="P/D: once the prefill replicas hold N prompts each, the next prompt may prefill on "
                        "its decode replica, whichever queue is shorter (0: never; default: "
                        "AppConfig.local_prefill_queue)")
    p.add_argument("--max-local-prefill-length", type=int, default=0, metavar="TOKENS",
                   help="P/D: prompts of at most this many tokens prefill on their decode replica (0: none)")
    p.add_argument("--enforce-disagg", action="store_true",
                   help="P/D: a prompt no prefill replica can take soon is refused with 503 + Retry-After "
                        "instead of prefilled on its decode replica (decode-only fallback)")
    p.add_argument("--prefill-timeout-s", type=float, default=None, metavar="S",
                   help="P/D: the least time a prefill call gets before its prompt falls back to its decode "
                        "replica; longer prompts or queues get more (0: no bound; default: "
                        "AppConfig.prefill_timeout_s, 10)")
    p.add_argument("--max-prefill-queue-size", type=int, default=None, metavar="N",
                   help="P/D: with N prompts per prefill replica in flight, the next falls back to its decode "
                        "replica (0: no bound; default: AppConfig.max_prefill_queue_size, 32)")
    p.add_argument("--migration-limit", type=int, default=None, metavar="N",
                   help="a request whose engine replica dies or hangs goes on on another one, at most N times "
                        "(0: it fails with 503; default: AppConfig.migration_limit, 3)")
    p.add_argument("--replica-cpus", type=float, default=None,
                   help="CPUs Ray reserves per engine replica, also its torch threads (default: 1 with GPUs; on "
                        "CPU the cluster's CPUs shared among the engine replicas, at most one node's)")
    p.add_argument("--replica-threads", type=int, default=None,
                   help="torch threads of each engine replica (default: its CPUs); more than its CPUs lets "
                        "replicas on one node use each other's idle cores")
    p.add_argument("--replica-gpus", type=float, default=None,
                   help="GPUs the engine replica actor itself reserves (default on a CUDA machine: 1; with "
                        "tensor parallel over Ray actors 0, each rank actor reserves its own GPU)")
    p.add_argument("--prefill-tensor-parallel-size", type=int, default=None,
                   help="ranks of each prefill replica (default: --tensor-parallel-size); may differ from the "
                        "decode's")
    p.add_argument("--decode-tensor-parallel-size", type=int, default=None,
                   help="ranks of each decode replica (default: --tensor-parallel-size)")
    p.add_argument("--prefill-data-parallel-size", type=int, default=None,
                   help="engine cores of each prefill replica (default: --data-parallel-size)")
    p.add_argument("--decode-data-parallel-size", type=int, default=None,
                   help="engine cores of each decode replica (default: --data-parallel-size)")
    p.add_argument("--app-name", default="pdserve")
    p.add_argument("--max-replicas", type=int, default=8, help="per-role ceiling of scaling")
    p.add_argument("--autoscale", action="store_true", help="scale prefill/decode on TTFT/ITL targets")
    p.add_argument("--ttft-p90-target-ms", type=float, default=1000.0)
    p.add_argument("--itl-p90-target-ms", type=float, default=100.0)
    p.add_argument("--look-back-period-s", type=float, default=10.0,
                   help="seconds of latency samples behind the autoscaler's TTFT/ITL p90 (Serve's look_back_period_s)")
    p.add_argument("--shutdown-timeout-s", type=float, default=30.0,
                   help="from SIGINT/SIGTERM until every process this server started is gone; in-flight "
                        "requests may finish until min(5, timeout/4) s before it, the rest is killed")
    EngineArgs.add_cli_args(p)  # --model (default: SmolLM2-135M-Instruct) and every engine flag
    p.set_defaults(fn=run_serve)

    sc = sub.add_parser("scale", help="set the replica counts of a running app (POST /scale)")
    sc.add_argument("--url", default="http://127.0.0.1:8000")
    sc.add_argument("--prefill", type=int, default=None)
    sc.add_argument("--decode", type=int, default=None)
    sc.add_argument("--colocated", type=int, default=None)
    sc.set_defaults(fn=run_scale)

    st = sub.add_parser("status", help="replicas per role, load, store and scaling state (GET /status)")
    st.add_argument("--url", default="http://127.0.0.1:8000")
    st.set_defaults(fn=run_status)


def _http(method: str, url: str, body: dict | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    from cluster.http.auth import keys_from

    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    keys = keys_from(None)  # PDSERVE_API_KEY, as the server reads it
    if keys:
        headers["Authorization"] = f"Bearer {keys[0]}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except urllib.error.URLError as e:
        raise ValueError(f"cannot reach {url}: {e.reason}") from e


def run_scale(args: argparse.Namespace) -> int:
    body = {role: n for role in ("prefill", "decode", "colocated") if (n := getattr(args, role)) is not None}
    if not body:
        raise ValueError("give at least one of --prefill, --decode, --colocated")
    code, payload = _http("POST", f"{args.url.rstrip('/')}/scale", body)
    print(json.dumps(payload, indent=2))
    return 0 if code == 202 else 1


def run_status(args: argparse.Namespace) -> int:
    code, payload = _http("GET", f"{args.url.rstrip('/')}/status")
    print(json.dumps(payload, indent=2))
    return 0 if code == 200 else 1


def _config(args: argparse.Namespace):
    from cluster.http.auth import keys_from
    from cluster.launch.app_config import AppConfig
    from cluster.launch.open_doors import check_open_admin
    from engine.models.default_model import DEFAULT_MODEL_TOOL_PARSER, default_model

    extra = {} if args.stream_interval_ms is None else {"stream_interval_ms": args.stream_interval_ms}
    auto_tools, parser = args.enable_auto_tool_choice, args.tool_call_parser
    if args.model is None and auto_tools is None and parser is None:
        # The default model writes hermes-style calls: agents (whose second turn sends
        # tool_choice "auto") work with no flag. Any --model follows vLLM's flags.
        auto_tools, parser = True, DEFAULT_MODEL_TOOL_PARSER
    extra["api_keys"] = keys_from(args.api_key)
    # Before Ray starts: the host is the flag's (build_app checks Serve's again).
    check_open_admin(bool(extra["api_keys"]), args.allow_unauthenticated_admin, args.host)
    if args.local_prefill_queue is not None:
        extra["local_prefill_queue"] = args.local_prefill_queue
    if args.max_request_body_bytes is not None:
        extra["max_request_body_bytes"] = args.max_request_body_bytes
    for name in ("prefill_timeout_s", "max_prefill_queue_size", "migration_limit"):
        if getattr(args, name) is not None:
            extra[name] = getattr(args, name)
    return AppConfig(
        **extra,
        engine_args=EngineArgs.from_cli_args(args, model=args.model or default_model()),
        mode=args.mode, prefill_replicas=args.prefill_replicas, decode_replicas=args.decode_replicas,
        colocated_replicas=args.replicas, served_model_name=args.served_model_name, app_name=args.app_name,
        max_pending_requests=args.max_pending_requests,
        max_tools=args.max_tools, max_stop_strings=args.max_stop_strings, max_bad_words=args.max_bad_words,
        max_guided_choices=args.max_guided_choices, max_guided_bytes=args.max_guided_bytes,
        max_image_pixels=args.max_image_pixels,
        metrics_without_key=args.metrics_without_key,
        allow_unauthenticated_admin=args.allow_unauthenticated_admin,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        api_server_count=args.api_server_count,
        prefix_affinity=args.prefix_affinity, router_mode=args.router_mode,
        kv_overlap_score_weight=args.kv_overlap_score_weight, disable_access_log=args.disable_access_log,
        direct_streaming=args.direct_streaming,
        enable_auto_tool_choice=bool(auto_tools), tool_call_parser=parser, reasoning_parser=args.reasoning_parser,
        structured_outputs_config=args.structured_outputs_config,
        lora_modules=tuple(args.lora_modules), enable_lora_runtime_updating=args.enable_lora_runtime_updating,
        max_local_prefill_length=args.max_local_prefill_length,
        enforce_disagg=args.enforce_disagg,
        replica_num_cpus=args.replica_cpus,
        replica_num_threads=args.replica_threads,
        replica_num_gpus=args.replica_gpus, max_replicas=args.max_replicas,
        prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
        decode_tensor_parallel_size=args.decode_tensor_parallel_size,
        prefill_data_parallel_size=args.prefill_data_parallel_size,
        decode_data_parallel_size=args.decode_data_parallel_size,
        autoscale={"enabled": args.autoscale, "ttft_p90_target_s": args.ttft_p90_target_ms / 1000,
                   "itl_p90_target_s": args.itl_p90_target_ms / 1000,
                   "look_back_period_s": args.look_back_period_s},
    )


def warm_tokenizer_cache(model: str) -> None:
    """Convert a GGUF file's tokenizer once, here, before the replicas start: they (and the
    ingress) on this node then read it from the cache instead of each converting it at the
    same time. A Hugging Face directory needs nothing."""
    from engine.models.gguf_file import find_gguf

    gguf = find_gguf(model)
    if gguf is not None:
        from engine.models.gguf_tokenizer import load_gguf_tokenizer

        load_gguf_tokenizer(gguf)


def run_serve(args: argparse.Namespace) -> NoReturn:
    from cluster.launch.http_proxy import configure_http_proxy
    from cluster.launch.serve_env import configure_serve_env

    # Before Ray is imported: Serve reads these switches from the environment at import/start.
    proxy = "as the cluster was started"
    if not os.environ.get("RAY_ADDRESS"):
        proxy = configure_http_proxy(host=args.host)
        configure_serve_env()
    import ray
    from ray import serve

    from cluster.control.capacity import (
        initial_resources,
        node_cpus,
        startup_refusal,
        total_resources,
    )
    from cluster.launch.app import build_app
    from cluster.launch.shutdown import BoundedShutdown, StopServing, become_subreaper
    from kvstore.store_actor import remove_app_store

    cfg = _config(args)  # bad flags fail here, before Ray starts
    warm_tokenizer_cache(cfg.model)
    address = os.environ.get("RAY_ADDRESS")
    stopper = BoundedShutdown(args.shutdown_timeout_s, owns_processes=not address, http_port=args.port)
    if not address:
        become_subreaper()

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def drain() -> None:
        # Serve stops routing to the app and waits for its in-flight requests (the stopper's
        # deadline bounds that wait, whatever graceful_shutdown_timeout_s says).
        if ray.is_initialized():
            serve.delete(cfg.app_name)
            remove_app_store(cfg.app_name)

    def teardown() -> None:
        if address:
            ray.shutdown()  # attached to a cluster: disconnect, nothing else is ours to stop
            return
        if ray.is_initialized():
            serve.shutdown()
        # Not ray.shutdown(): it SIGTERMs each node daemon and waits 1 s for it, and they
        # block SIGTERM (NODE_BLOCKED_SIGNALS). Serve is down, the node holds nothing worth a
        # graceful exit, and the stopper SIGKILLs this process tree next.

    try:
        stopper.install()
        if address:
            from cluster.launch.ray_connect import connect

            connect(log_to_driver=False)  # bounded; token auth picked up; one-line failures
        else:  # "local": a Ray of our own, even when `ray start` left a cluster to attach to
            # Ray's node daemons inherit this thread's signal mask, and so do the workers its
            # raylet starts: with SIGTERM and SIGHUP blocked there, a signal sent to the whole
            # group (`kill -- -PGID`) reaches only this driver, which drains the app as for a
            # SIGTERM to it alone (cluster.launch.shutdown). HAProxy sets its own mask.
            masked = signal.pthread_sigmask(signal.SIG_BLOCK, NODE_BLOCKED_SIGNALS)
            try:
                ray.init(address="local", namespace="pdserve", include_dashboard=False, log_to_driver=False)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, masked)
        stopper.install()  # ray.init replaced the SIGTERM handler
        stopper.watch_ray_node()
        serve.start(http_options={"host": args.host, "port": args.port})
        cfg = cfg.sized_for(node_cpus())
        if not address:
            # Our own Ray gains no nodes: replicas that do not fit would leave serve.run waiting
            # for ever (an attached cluster may autoscale; its /status explains what waits).
            targets = cfg.targets()
            needed = initial_resources(targets, {role: cfg.role_resources(role) for role in targets})
            refusal = startup_refusal(needed, total_resources(), cfg.mode)
            if refusal is not None:
                raise ValueError(refusal)
        serve.run(build_app(cfg), name=cfg.app_name, route_prefix="/", blocking=False,
                  external_scaler_enabled=True)
        url = f"http://{args.host}:{args.port}"
        chat = json.dumps({"model": cfg.model_name, "max_tokens": 64, "messages": [
            {"role": "user", "content": "What is the capital of France?"}]})
        cpus = cfg.replica_cpus()
        sizing = f"{cpus:g} CPU{'' if cpus == 1 else 's'} per engine replica"
        if cfg.replica_num_threads is not None:
            sizing += f", {cfg.replica_num_threads} torch threads"
        mode = f"{cfg.mode}, direct streaming" if cfg.direct else cfg.mode
        print(f"\npdserve is up ({mode}, model '{cfg.model_name}', HTTP proxy: {proxy}, {sizing}) at {url}\n"
              f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              f"       -d '{chat}'\n"
              f"Ctrl-C stops it.", flush=True)
        stopper.wait()
    except StopServing:
        log(f"{stopper.signal_name}: shutting down within {args.shutdown_timeout_s:g} s "
            f"(in-flight requests finish first) ...")
    except ValueError as e:  # e.g. Ray unreachable or refusing the token: one line, no traceback
        log(f"error: {e}")
        stopper.stop(drain, teardown, log, failed=True)
    except BaseException:
        log(traceback.format_exc())
        stopper.stop(drain, teardown, log, failed=True)
    stopper.stop(drain, teardown, log)
