"""Long-document QA (LMCache's long_doc_qa shape): time to first token of questions on long
documents when the engine's KV pool holds only about half of them, with the host KV tier
(`--kv-offloading-size`) and without it, side by side in one run.

After one untimed warm-up request per engine, round 1 asks one question on each of N documents of about L tokens (cold: every prompt is
computed). Round 2 asks them again in the same order. An LRU pool that holds half the
documents has evicted each one by the time it comes back, so without the tier round 2
computes every prompt again; with it, the prompts load from host memory. Both engines live in
this process and their requests alternate (one at a time, document by document), so a shared
machine slows both alike.

    python scripts/bench_long_doc_qa.py                       # 8 x 1500 tokens, the default model
    python scripts/bench_long_doc_qa.py --num-docs 4 --doc-tokens 600
    python scripts/bench_long_doc_qa.py --model /path/model --num-kv-blocks 200

The first line names the CPU and the ISA level of pdserve's kernels. Prints mean TTFT per
round and configuration, the round-2 / round-1 ratios, and the host tier's counters.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

QUESTION = "\n\nQuestion: what is the main point of the document above? Answer in one sentence.\nAnswer:"


def cpu_name() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def documents(tokenizer, num_docs: int, doc_tokens: int, seed: int) -> list[list[int]]:
    """Each document: words drawn at random from the tokenizer's own vocabulary, tokenized,
    cut to `doc_tokens`, then the question."""
    rng = random.Random(seed)
    vocab = [w for w, i in tokenizer.get_vocab().items() if w.isalpha() and len(w) > 2 and i > 100]
    question = tokenizer.encode(QUESTION, add_special_tokens=False)
    docs = []
    for _ in range(num_docs):
        ids: list[int] = []
        while len(ids) < doc_tokens:
            words = " ".join(rng.choice(vocab).lstrip("Ġ▁") for _ in range(256))
            ids += tokenizer.encode(words, add_special_tokens=False)
        docs.append(ids[:doc_tokens] + question)
    return docs


def ttft(engine, rid: str, prompt: list[int], params) -> float:
    """Seconds from queuing `prompt` to its first token; then runs it to its end. While the
    request only waits for KV a tier is fetching, this waits to be woken, as the server's engine
    loop does (LLMEngine.wait_while_waiting)."""
    start = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    first = None
    while True:
        outputs = engine.step()
        if not outputs:
            engine.wait_while_waiting()
        for out in outputs:
            if out.request_id != rid:
                continue
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter() - start
            if out.finished:
                return first


def add_document_args(p: argparse.ArgumentParser) -> None:
    """The model, documents and questions of a long-document run (this script's and
    bench_shared_tier.py's)."""
    p.add_argument("--model", default=None, help="model directory or .gguf file (default: the default model)")
    p.add_argument("--num-docs", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated per question")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)


def max_model_len(args) -> int:
    """Blocks enough for a document, its question and the answer."""
    prompt_len = args.doc_tokens + 40
    return -(-(prompt_len + args.max_tokens + 1) // args.block_size) * args.block_size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_document_args(p)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="the engine's KV pool in blocks (default: half the documents' tokens)")
    p.add_argument("--kv-offloading-size", type=float, default=1.0, help="the host tier's GiB (tier side)")
    args = p.parse_args()

    from engine import SamplingParams
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.models.default_model import default_model

    model = args.model or default_model()
    model_len = max_model_len(args)
    pool = args.num_kv_blocks or max(args.num_docs * (args.doc_tokens + 40) // 2 // args.block_size,
                                     model_len // args.block_size)
    common = dict(max_model_len=model_len, block_size=args.block_size, num_kv_blocks=pool)
    engines = {
        "off": LLMEngine(EngineArgs.from_kwargs(model, **common).create_engine_config()),
        "on": LLMEngine(EngineArgs.from_kwargs(model, kv_offloading_size=args.kv_offloading_size,
                                               **common).create_engine_config()),
    }
    warmup, *docs = documents(engines["off"].tokenizer, args.num_docs + 1, args.doc_tokens, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for engine in engines.values():
        # A first request pays one-time costs (first-touch memory, kernel shapes): not timed.
        # Its blocks leave the pool; the tier keeps them (a document nobody asks about again).
        ttft(engine, "warmup", warmup, params)
        engine.core.reset_prefix_cache()
    core = engines["on"].core
    print(f"CPU {cpu_name()}; pdserve's kernels: ISA level {core.cpu_kernels}; {os.cpu_count()} cores; "
          f"torch threads {__import__('torch').get_num_threads()}")
    print(f"model {os.path.basename(model.rstrip('/'))}; {args.num_docs} documents x {len(docs[0])} tokens; "
          f"KV pool {pool} blocks of {args.block_size} ({pool * args.block_size} tokens, "
          f"{pool * args.block_size / (args.num_docs * len(docs[0])):.0%} of the documents); "
          f"host tier {args.kv_offloading_size:g} GiB on the 'on' side")
    times = {(side, r): [] for side in engines for r in (1, 2)}
    computed = {}  # (side, round) -> prompt and output tokens the engine ran: noise-free
    for r in (1, 2):
        before = {side: engine.core.num_scheduled_tokens for side, engine in engines.items()}
        for i, doc in enumerate(docs):
            for side, engine in engines.items():  # alternated: both see the same machine
                times[side, r].append(ttft(engine, f"r{r}-d{i}", doc, params))
                print(f"round {r} document {i} tier {side}: TTFT {times[side, r][-1]:.3f} s", file=sys.stderr,
                      flush=True)
        for side, engine in engines.items():
            computed[side, r] = engine.core.num_scheduled_tokens - before[side]
    mean = {k: sum(v) / len(v) for k, v in times.items()}
    print("| tier | round 1 mean TTFT s | round 2 mean TTFT s | round 2 / round 1 | tokens computed, "
          "round 1 / round 2 |")
    print("| --- | --- | --- | --- | --- |")
    for side in engines:
        print(f"| {side} | {mean[side, 1]:.3f} | {mean[side, 2]:.3f} | {mean[side, 2] / mean[side, 1]:.2f} | "
              f"{computed[side, 1]} / {computed[side, 2]} |")
    stats, load = core.kv_transfer_stats(), core.load()
    print(f"host tier: {stats['host_stores']} blocks stored, {stats['host_loads']} loaded "
          f"({stats['host_hit_tokens']} tokens), {stats['host_refused']} refused, {stats['host_evictions']} "
          f"evicted, {stats['host_bytes_held'] / 2**20:.0f} MiB held; external prefix cache: "
          f"{load.external_prefix_cache_hits}/{load.external_prefix_cache_queries} tokens")
    for side, engine in engines.items():
        c = engine.core
        assert c.num_free_blocks() == c.num_kv_blocks, f"{side}: KV blocks still held after the run"
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
