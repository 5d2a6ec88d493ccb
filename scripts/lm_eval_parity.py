"""lm-evaluation-harness against a pdserve server, checked against lm-eval's own `hf` backend
on the same weights.

lm-eval runs the task set this repo ships (scripts/lm_eval_tasks: a multiple-choice task scored
by loglikelihood, a generate_until task with stop strings) twice: with `local-completions`, the
way a vLLM server is evaluated (token-id prompts in batches to /v1/completions, `echo` +
`logprobs` for the loglikelihoods, the server's /tokenize, /detokenize and /tokenizer_info as
`tokenizer_backend=remote`), and with `hf` (transformers in fp32 in this process; a GGUF file
through transformers' GGUF reader). Every choice's loglikelihood must agree within
--tolerance and every generation must be identical; the task metrics are printed side by side.
Exit status 1 otherwise.

Everything runs offline: the tasks read their JSONL files, the metrics are lm-eval's built-in
ones (acc, acc_norm, exact_match), and the hub is never asked.

    python scripts/lm_eval_parity.py --url http://127.0.0.1:8000     # a running server
    python scripts/lm_eval_parity.py --serve [--mode colocated] [--model PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks")
TASKS = ("pdserve_mc", "pdserve_gen")
TOLERANCE = 2e-3
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def served_model(url: str) -> dict:
    """The server's one model entry from GET /v1/models: `id`, `root` (its path), `max_model_len`."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]


def served_model_args(url: str, model: dict, num_concurrent: int = 1) -> dict:
    """`local-completions` as lm-eval's docs use it for vLLM: token-id prompts, the server's
    own tokenizer over HTTP, the server's context length. One try per request: a refusal is a
    finding here, not something to retry past."""
    return {"model": model["id"], "base_url": f"{url}/v1/completions", "tokenizer_backend": "remote",
            "tokenized_requests": True, "max_length": model["max_model_len"],
            "num_concurrent": num_concurrent, "max_retries": 1}


def hf_model_args(model_path: str, device: str = "cpu") -> dict:
    """lm-eval's `hf` backend on the same checkpoint in fp32 (a GGUF file by its directory and
    `gguf_file=`, as transformers loads it)."""
    from engine.models.gguf_file import hf_pretrained_args

    path, kwargs = hf_pretrained_args(model_path)
    return {"pretrained": path, "dtype": "float32", "device": device, **kwargs}


def evaluate(model: str, model_args: dict, tasks=TASKS, batch_size: int = 1) -> dict:
    """lm_eval.simple_evaluate over the shipped tasks only, with every request's response
    (`log_samples`)."""
    for key, value in OFFLINE.items():
        os.environ.setdefault(key, value)
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=list(tasks), batch_size=batch_size,
        task_manager=TaskManager(include_path=TASKS_DIR, include_defaults=False),
        log_samples=True, verbosity="WARNING")


@dataclasses.dataclass(frozen=True)
class Parity:
    """Served vs reference, request by request. `loglikelihoods` and `generations` hold
    ((task, doc_id, index), served, reference); `missing` the requests one side lacks."""

    loglikelihoods: list[tuple[tuple, float, float]]
    generations: list[tuple[tuple, str, str]]
    missing: list[tuple]
    metrics: dict[str, dict[str, tuple[float, float]]]

    @property
    def max_abs_diff(self) -> float:
        """Largest |served - reference| over every choice; inf if a value is not finite."""
        return max((_diff(s, r) for _, s, r in self.loglikelihoods), default=0.0)

    @property
    def generation_mismatches(self) -> list[tuple[tuple, str, str]]:
        return [g for g in self.generations if g[1] != g[2]]

    def ok(self, tolerance: float = TOLERANCE) -> bool:
        return (not self.missing and bool(self.loglikelihoods) and bool(self.generations)
                and self.max_abs_diff <= tolerance and not self.generation_mismatches)


def _diff(a: float, b: float) -> float:
    d = abs(a - b)
    return d if math.isfinite(d) else math.inf


def _responses(results: dict) -> dict[tuple, tuple[str, float | str, tuple]]:
    """(task, doc_id, request index) -> (output type, loglikelihood or generated text, request),
    from the unfiltered responses lm-eval logged: a multiple-choice doc has one request per
    choice. The request is (context, continuation), or a generation's context alone (the
    backends may add their EOS to the logged stop strings)."""
    out = {}
    for task, samples in results["samples"].items():
        output_type = results["configs"][task]["output_type"]
        for sample in samples:
            for i, (resp, args) in enumerate(zip(sample["resps"], sample["arguments"])):
                if output_type == "generate_until":
                    out[(task, sample["doc_id"], i)] = (output_type, resp[0], (args[0],))
                else:
                    out[(task, sample["doc_id"], i)] = (output_type, float(resp[0][0]), tuple(args))
    return out


def _metrics(results: dict) -> dict[str, dict[str, float]]:
    return {task: {k: v for k, v in values.items() if "," in k and "_stderr" not in k}
            for task, values in results["results"].items()}


def compare(served: dict, reference: dict) -> Parity:
    """Match the two runs' logged requests (same task, document, request and arguments) and
    pair their loglikelihoods, generations and metrics."""
    a, b = _responses(served), _responses(reference)
    missing = sorted(set(a) ^ set(b))
    lls, gens = [], []
    for key in sorted(set(a) & set(b)):
        (kind, s, s_args), (_, r, r_args) = a[key], b[key]
        if s_args != r_args:  # not the same request: count it as missing on both sides
            missing.append(key)
        elif kind == "generate_until":
            gens.append((key, s, r))
        else:
            lls.append((key, s, r))
    ref_metrics = _metrics(reference)
    metrics = {task: {m: (v, ref_metrics.get(task, {}).get(m, math.nan)) for m, v in values.items()}
               for task, values in _metrics(served).items()}
    return Parity(lls, gens, missing, metrics)


def report(parity: Parity, tolerance: float = TOLERANCE) -> str:
    lines = [f"{'task':<14} {'metric':<20} {'served':>9} {'hf':>9}"]
    for task, values in sorted(parity.metrics.items()):
        for metric, (s, r) in sorted(values.items()):
            lines.append(f"{task:<14} {metric:<20} {s:>9.4f} {r:>9.4f}")
    if parity.loglikelihoods:
        worst = max(parity.loglikelihoods, key=lambda x: _diff(x[1], x[2]))
        lines.append(f"loglikelihoods: {len(parity.loglikelihoods)} choices, max |served - hf| = "
                     f"{parity.max_abs_diff:.3g} (tolerance {tolerance:g}) at {worst[0]}: "
                     f"{worst[1]:.6f} vs {worst[2]:.6f}")
    bad = parity.generation_mismatches
    lines.append(f"generations: {len(parity.generations) - len(bad)}/{len(parity.generations)} identical")
    lines += [f"  {key}: {s!r}" if s == r else f"  {key}: served {s!r} != hf {r!r}"
              for key, s, r in parity.generations]
    if parity.missing:
        lines.append(f"requests only one side has (or with different arguments): {parity.missing}")
    lines.append("PASS" if parity.ok(tolerance) else "FAIL")
    return "\n".join(lines)


def run(url: str, hf_model: str | None, args) -> Parity:
    model = served_model(url)
    served = evaluate("local-completions", served_model_args(url, model, args.num_concurrent),
                      batch_size=args.batch_size)
    reference = evaluate("hf", hf_model_args(hf_model or model["root"], args.device))
    return compare(served, reference)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--serve", action="store_true", help="start `pdserve serve` on a free port for the run")
    p.add_argument("--model", default=None,
                   help="weights: for --serve the model to serve (default: pdserve's default model); "
                        "for hf (default: the server's model path from /v1/models)")
    p.add_argument("--mode", default="pd", choices=["pd", "colocated"], help="with --serve")
    p.add_argument("--batch-size", type=int, default=4, help="prompts per /v1/completions request")
    p.add_argument("--num-concurrent", type=int, default=1, help="requests lm-eval keeps in flight")
    p.add_argument("--device", default="cpu", help="torch device of the hf backend")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="max |loglikelihood difference|")
    args = p.parse_args(argv)
    if args.url:
        parity = run(args.url.rstrip("/"), args.model, args)
    else:
        from scripts.serve_bench.server import ServerProcess, free_port, server_command

        port = free_port()
        log = os.path.join(tempfile.mkdtemp(prefix="lm-eval-parity-"), "serve.log")
        server = ServerProcess(server_command(args.mode, port, args.model, None, None, ["--host", "127.0.0.1"]), log)
        try:
            server.wait_ready(f"http://127.0.0.1:{port}", deadline_s=600)
            parity = run(f"http://127.0.0.1:{port}", args.model, args)
        finally:
            server.stop()
    print(report(parity, args.tolerance))
    return 0 if parity.ok(args.tolerance) else 1


if __name__ == "__main__":
    sys.exit(main())
