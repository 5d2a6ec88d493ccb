"""How soon an engine replica ends the request of an ingress replica that died
(docs/pd.md#a-caller-that-dies).

Starts its own local Ray and a colocated app whose engine replica sits behind the ingress (no
direct streaming), with Serve's calls between deployments over gRPC (`--calls grpc`, the
default of `pdserve serve`) or as Ray actor calls (`--calls actor`). Times one whole greedy
request, then streams the same request, SIGKILLs the ingress replica's process (its pid from
the Ingress deployment's `processes()`, never by name) once the stream has begun, and reports
how long after the kill the engine replica was idle with every KV block free.

    python scripts/caller_death.py --calls actor
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", choices=("grpc", "actor"), default="grpc")
    p.add_argument("--max-tokens", type=int, default=600)
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--num-cpus", type=int, default=2)
    args = p.parse_args()

    from cluster.launch.serve_env import THROUGHPUT
    from scripts.serve_bench.server import free_port, local_ray

    local_ray(args.num_cpus, {THROUGHPUT: "1" if args.calls == "grpc" else "0"})
    try:
        return _measure(args, free_port())
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()  # the Ray this script started, and every process of it


def _measure(args, port: int) -> int:
    import requests
    from ray import serve

    from cluster.launch.app import build_app
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs
    from engine.models.default_model import default_model

    serve.start(http_options={"host": "127.0.0.1", "port": port})
    engine = EngineArgs(model=args.model or default_model(), max_model_len=args.max_tokens + 64)
    cfg = AppConfig(engine_args=engine, mode="colocated", direct_streaming=False, replica_num_cpus=0,
                    app_name="caller-death", served_model_name="m")
    serve.run(build_app(cfg), name=cfg.app_name, route_prefix="/")  # blocks until every replica runs
    url = f"http://127.0.0.1:{port}"
    ingress, colocated = (serve.get_deployment_handle(d, cfg.app_name) for d in ("Ingress", "Colocated"))
    print("calls between deployments:", ingress.inter_deployment_calls.remote().result())
    body = {"model": "m", "prompt": "Once upon a time", "max_tokens": args.max_tokens, "ignore_eos": True,
            "temperature": 0}
    start = time.monotonic()
    requests.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()
    print(f"a whole request: {time.monotonic() - start:.1f} s")
    chunks: list[float] = []

    def read() -> None:
        try:
            with requests.post(f"{url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data: {"):
                        chunks.append(time.monotonic())
        except requests.RequestException:
            pass  # the ingress was killed: its connection with it

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 120
    while len(chunks) < 10:  # the stream has begun (polled, bounded)
        if time.monotonic() > deadline:
            raise RuntimeError("the stream did not begin within 120 s")
        time.sleep(0.05)
    os.kill(ingress.processes.remote().result()["replica"], signal.SIGKILL)
    killed = time.monotonic()
    print(f"ingress killed {killed - chunks[0]:.1f} s after the stream's first chunk")
    while time.monotonic() - killed < 600:
        load = colocated.report.remote().result().engine
        if load.running == 0 and load.waiting == 0 and load.free_blocks == load.total_blocks:
            print(f"engine replica idle, every block free, {time.monotonic() - killed:.2f} s after the kill")
            return 0
        time.sleep(0.1)  # its figures are polled, bounded
    print("engine replica still busy 600 s after the kill")
    return 1


if __name__ == "__main__":
    sys.exit(main())
