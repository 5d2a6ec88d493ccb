"""P/D between unequal tensor-parallel sizes, over HTTP: the Serve app with a prefill of one
size and a decode of another, each way, on local Ray (CPU: gloo).

    python scripts/pd_unequal_tp.py                      # small preset (made on first use), 2->1 and 1->2
    python scripts/pd_unequal_tp.py --model DIR --sizes 2:1 1:2 --prompts 16 --max-tokens 16

For each pair it deploys the app (`prefill_tensor_parallel_size`, `decode_tensor_parallel_size`),
sends the prompts as greedy completions, and checks each answer against Hugging Face
transformers' greedy text, and the app's /metrics: KV loads (one per decode rank per prompt),
load failures and refused transfers (both 0: no prompt was recomputed or refused), and that the
KV store holds no transfer afterwards. PASS or FAIL, and a JSON report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NAME = "unequal-tp"
PROMPT_WORDS = ("The river ran quietly past the old mill where", "A good engineer measures before",
                "Once upon a time there was a small village by the sea", "The recipe calls for two cups of",
                "In the morning the market opens and", "She wrote the letter slowly, choosing",
                "The train left the station at", "Under the bridge the water was")


def _prompts(n: int) -> list[str]:
    return [f"{PROMPT_WORDS[i % len(PROMPT_WORDS)]} {i}" for i in range(n)]


def _hf_texts(model: str, prompts: list[str], max_tokens: int) -> list[str]:
    """Transformers' greedy continuation of each prompt, alone (no padding), to EOS or max_tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    texts = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([tok(p)["input_ids"]])
            out = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids))
            texts.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return texts


def _metric(url: str, name: str) -> float:
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _counters(url: str) -> dict[str, float]:
    return {k: _metric(url, f"pdserve:kv_transfer_{k}_total") for k in ("loads", "load_failures", "refused")}


def _live_transfers(app: str, bound_s: float = 30.0) -> int:
    """The app's KV store's live transfers once every release has reached it (bounded: a
    decode's release is fire-and-forget)."""
    import ray

    from kvstore.store_actor import find_app_store

    store = find_app_store(app)
    deadline = time.monotonic() + bound_s
    while (live := ray.get(store.stats.remote())["live_transfers"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return live


def _wait_health(url: str, bound_s: float = 900.0) -> None:
    import requests

    deadline = time.monotonic() + bound_s
    while True:
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url}/health not 200 within {bound_s:g} s")
        time.sleep(1.0)  # replicas starting: polled, bounded


def run_pair(url: str, model: str, prefill_tp: int, decode_tp: int, prompts: list[str], max_tokens: int,
             expected: list[str]) -> dict:
    import openai
    from ray import serve

    from cluster.launch.app import build_app
    from cluster.launch.app_config import AppConfig
    from engine import EngineArgs

    app = f"tp{prefill_tp}to{decode_tp}"
    cfg = AppConfig(engine_args=EngineArgs(model=model, max_model_len=512, num_kv_blocks=128), mode="pd",
                    served_model_name=NAME, app_name=app, replica_num_cpus=0,
                    prefill_tensor_parallel_size=prefill_tp, decode_tensor_parallel_size=decode_tp)
    serve.run(build_app(cfg), name=app, route_prefix="/", blocking=False, external_scaler_enabled=True)
    try:
        _wait_health(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        before = _counters(url)
        start = time.perf_counter()
        texts = [client.completions.create(model=NAME, prompt=p, max_tokens=max_tokens, temperature=0).choices[0].text
                 for p in prompts]
        seconds = time.perf_counter() - start
        # Replica figures reach /metrics with the routing-stats rounds: read them until they
        # count every load, bounded.
        want = decode_tp * len(prompts)
        deadline = time.monotonic() + 60
        while (moved := {k: v - before[k] for k, v in _counters(url).items()})["loads"] < want \
                and time.monotonic() < deadline:
            time.sleep(1.0)
        live = _live_transfers(app)
    finally:
        serve.delete(app)
    equal = sum(t == e for t, e in zip(texts, expected))
    return {"prefill_tp": prefill_tp, "decode_tp": decode_tp, "prompts": len(prompts), "equal_to_hf": equal,
            "kv_loads": moved["loads"], "kv_loads_expected": want, "load_failures": moved["load_failures"],
            "refused": moved["refused"], "live_transfers_after": live, "seconds": round(seconds, 2),
            "ok": equal == len(prompts) and moved["loads"] == want and moved["load_failures"] == 0
            and moved["refused"] == 0 and live == 0,
            "mismatches": [{"prompt": p, "got": t, "hf": e} for p, t, e in zip(prompts, texts, expected) if t != e]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model dir (default: the small preset, made on first use)")
    p.add_argument("--sizes", nargs="+", default=["2:1", "1:2"], help="prefill:decode tensor-parallel sizes")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "pd_unequal_tp.json"))
    args = p.parse_args()
    model = args.model
    if model is None:
        from engine.models.make_model import make_model

        model = os.path.join(tempfile.gettempdir(), "pdserve-small-llama")
        if not os.path.isfile(os.path.join(model, "config.json")):
            make_model(model, "small", "llama")
    prompts = _prompts(args.prompts)
    expected = _hf_texts(model, prompts, args.max_tokens)

    from scripts.serve_bench.server import free_port, local_ray

    local_ray(args.num_cpus)
    import ray  # after local_ray: Ray and Serve read the environment it set when imported
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        pairs = [tuple(int(x) for x in s.split(":")) for s in args.sizes]
        report = [run_pair(f"http://127.0.0.1:{port}", model, pt, dt, prompts, args.max_tokens, expected)
                  for pt, dt in pairs]
    finally:
        serve.shutdown()
        ray.shutdown()  # the Ray this script started, and every process of it
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    for r in report:
        print(json.dumps({k: v for k, v in r.items() if k != "mismatches"}))
    ok = all(r["ok"] for r in report)
    print(("PASS" if ok else "FAIL") + f": report in {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
