"""The ingress's real FastAPI app (cluster.http.ingress.app: its routes, middleware and error
handlers) served by uvicorn on a free 127.0.0.1 port in a thread, with an `Ingress` whose
engines are a stand-in: no Ray, no Serve, no model weights. Requests are parsed, tokenized
and validated exactly as in a replica (the tokenizer and InputProcessor of a real model
directory); a valid one gets a short made-up answer. For the HTTP-level tests (bodies, limits,
keep-alive, fuzzing) that need a real HTTP server but not an engine."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from types import SimpleNamespace

from tests.cluster.helpers import free_port, wait_for


class EchoEngines:
    """An EngineClient that answers any request at once: `max_tokens` (at most 3) tokens taken
    from the prompt, with logprobs and prompt logprobs shaped as the engine's when asked."""

    async def generate(self, request):
        from engine.outputs import CompletionOutput, Logprob, RequestOutput

        params, request_id = request.sampling_params, request.request_id
        ids = request.prompt_token_ids or [0]
        n = max(1, min(params.max_tokens or 1, 3))
        prompt_lps = None
        if params.prompt_logprobs is not None:
            prompt_lps = [None] + [{t: Logprob(-1.0, 1, None)} for t in ids[1:]]
        for k in range(n):
            tid, last = ids[k % len(ids)], k == n - 1
            lps = None if params.logprobs is None else [{tid: -0.5}]
            so_far = [ids[j % len(ids)] for j in range(k + 1)]
            yield RequestOutput(
                request_id, request.prompt, ids,
                [CompletionOutput(0, "x" * (k + 1), so_far, finish_reason="length" if last else None,
                                  logprobs=None if lps is None else lps * (k + 1))],
                finished=last, delta_text="x", delta_token_ids=[tid], delta_logprobs=lps,
                prompt_logprobs=prompt_lps)
            await asyncio.sleep(0)


class FakeCoordinator:
    """The Coordinator calls the ingress's routes make, answered at once."""

    def __getattr__(self, method):
        from cluster.control.results import ScaleResult, Status
        from cluster.roles import Role

        async def call(*args):
            live = [SimpleNamespace(role=Role.COLOCATED)]
            status = Status("colocated", {"colocated": []}, {}, False, {"colocated": 1}, False, None, None)
            return {"replicas": live, "scrape": ([], {}), "status": status,
                    "scale": ScaleResult.accept({"colocated": 1})}.get(method, {})

        class Method:
            def remote(self, *args):
                return call(*args)

        return Method()


@dataclass
class Served:
    url: str
    port: int
    ingress: object
    server: object
    thread: threading.Thread
    own_replica_context: object

    def stop(self) -> None:
        from ray import serve

        from cluster.http import ingress as ingress_module

        self.server.should_exit = True
        self.thread.join(timeout=30)
        serve.get_replica_context = self.own_replica_context
        ingress_module._body_limits = None


def make_ingress(model_dir: str, *, max_pending_requests: int = 64, name: str = "m", body_limits=None,
                 engines=None, max_model_len: int = 256):
    """An Ingress over `model_dir`'s tokenizer with EchoEngines (or `engines`, an EngineClient
    such as a real AsyncLLM of the same model and max_model_len), built without Serve;
    `body_limits` (a BodyLimits, default its defaults) are put in force as a replica's are."""
    from cluster.http import ingress as ingress_module
    from cluster.http import openai_format as fmt
    from cluster.http.ingress import Ingress
    from cluster.http.metrics import AppMetrics
    from cluster.http.runner import RequestRunner
    from cluster.http.served_model import ServedModel
    from engine.args import EngineArgs
    from engine.llm_engine import load_processor

    engine_args = EngineArgs(model=model_dir, max_model_len=max_model_len)
    tokenizer, processor = load_processor(engine_args.create_engine_config())
    ing = object.__new__(Ingress)
    ing.mode, ing.max_pending, ing._pending, ing._pusher = "colocated", max_pending_requests, {}, object()
    ing.served = ServedModel(name, model_dir, tokenizer, processor, fmt.TokenText(tokenizer))
    ing.metrics, ing.coordinator = AppMetrics(name, "colocated"), FakeCoordinator()
    ing.runner = RequestRunner(engines if engines is not None else EchoEngines(), ing.metrics)
    ing.created, ing.ingress_id, ing.direct = 0, "ingress-test", None
    ing.coordinator_call_s = 5.0
    ing.lora_follower = None  # no LoRA adapters (cluster.http.lora)
    ing._share_coordinator_calls()
    ingress_module._body_limits = body_limits
    return ing


def serve_ingress(ingress) -> Served:
    """Serve cluster.http.ingress.app with `ingress` as every route's `self` (uvicorn with
    httptools, as Serve's direct ingress runs it). Serve hands a route its deployment instance
    through `serve.get_replica_context().servable_object`; on the server's thread that is
    `ingress`, everywhere else Serve's own answer."""
    import uvicorn
    from ray import serve

    from cluster.http.ingress import app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", access_log=False,
                                           log_level="warning", http="httptools"))
    server.install_signal_handlers = lambda: None
    thread = threading.Thread(target=server.run, daemon=True)
    own = serve.get_replica_context
    context = SimpleNamespace(servable_object=ingress)
    serve.get_replica_context = lambda: context if threading.current_thread() is thread else own()
    thread.start()
    wait_for(lambda: server.started, "the test's uvicorn to start", 30)
    return Served(f"http://127.0.0.1:{port}", port, ingress, server, thread, own)

