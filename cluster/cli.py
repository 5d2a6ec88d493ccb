"""`pdserve` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys

DEFAULT_PRESET = "tiny"


def default_model_dir(preset: str = DEFAULT_PRESET) -> str:
    root = os.environ.get("PDSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "pdserve"))
    return os.path.join(root, "models", preset)


def ensure_default_model(preset: str = DEFAULT_PRESET) -> str:
    """The embedded default model, made on first use (no hub is needed)."""
    path = default_model_dir(preset)
    if not os.path.isfile(os.path.join(path, "config.json")):
        from engine.models.make_model import make_model

        print(f"making the default '{preset}' model in {path} ...", file=sys.stderr)
        make_model(path, preset)
    return path


def _cmd_make_model(args) -> int:
    from engine.models.make_model import make_model

    make_model(args.dir, args.preset, args.family, seed=args.seed)
    print(f"wrote {args.preset} {args.family} model to {args.dir}")
    return 0


def _engine_kwargs(args) -> dict:
    kw = dict(dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed)
    if args.num_kv_blocks is not None:
        kw["num_kv_blocks"] = args.num_kv_blocks
    return kw


def _cmd_generate(args) -> int:
    from engine import LLM, SamplingParams

    model = args.model or ensure_default_model()
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.sampling_seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
        stop=args.stop or None,
    )
    llm = LLM(model, **_engine_kwargs(args))
    outs = llm.generate(args.prompts, params, use_tqdm=not args.quiet)
    for out in outs:
        c = out.outputs[0]
        print(f"--- prompt: {out.prompt!r} ({len(out.prompt_token_ids)} tokens)")
        print(f"{c.text!r}  [{len(c.token_ids)} tokens, finish_reason={c.finish_reason}]")
    return 0


DEMO_PROMPTS = [
    "The river ran quietly past",
    "A good engineer measures before",
    "Once upon a time there was",
    "Hello! How can I help you",
]


def _cmd_demo(args) -> int:
    args.model = args.model or ensure_default_model()
    args.prompts = DEMO_PROMPTS
    return _cmd_generate(args)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the embedded tiny model)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write a random-weight HF model with a local tokenizer")
    mm.add_argument("dir")
    mm.add_argument("--preset", default="tiny", choices=["tiny", "small", "bench", "1b"])
    mm.add_argument("--family", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    mm.add_argument("--seed", type=int, default=0)
    mm.set_defaults(fn=_cmd_make_model)

    gen = sub.add_parser("generate", help="complete prompts with the offline engine")
    gen.add_argument("prompts", nargs="+")
    _add_engine_flags(gen)
    gen.set_defaults(fn=_cmd_generate)

    demo = sub.add_parser("demo", help="generate a few completions with the default model")
    _add_engine_flags(demo)
    demo.set_defaults(fn=_cmd_demo)

    from cluster.batch_cli import add_batch_parser
    from cluster.serve_cli import add_serve_parser

    add_serve_parser(sub)
    add_batch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
