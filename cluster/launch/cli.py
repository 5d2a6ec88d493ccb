"""`pdserve` command line."""

from __future__ import annotations

import argparse
import logging
import sys

from cluster.launch.batch_cli import add_batch_parser
from cluster.launch.sampling_flags import add_sampling_args, sampling_params
from cluster.launch.serve_cli import add_serve_parser
from engine.args import EngineArgs
from engine.models.default_model import default_model


def _cmd_make_model(args) -> int:
    from engine.models.make_llava import make_llava
    from engine.models.make_model import make_model

    if args.family == "llava":  # CLIP + projector + a Llama LM, with its image processor
        make_llava(args.dir, args.preset, seed=args.seed, vision_preset=args.vision_preset)
    else:
        make_model(args.dir, args.preset, args.family, seed=args.seed)
    print(f"wrote {args.preset} {args.family} model to {args.dir}")
    return 0


def _cmd_generate(args) -> int:
    from engine import LLM

    params = sampling_params(args)
    engine_args = EngineArgs.from_cli_args(args, model=args.model or default_model())
    llm = LLM.from_engine_args(engine_args)
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
    args.prompts = DEMO_PROMPTS
    return _cmd_generate(args)


def _add_generate_flags(p: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    mm = sub.add_parser("make-model", help="write a random-weight HF model with a local tokenizer")
    mm.add_argument("dir")
    mm.add_argument("--preset", default="tiny", choices=["tiny", "small", "bench", "1b"])
    mm.add_argument("--family", default="llama", choices=["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3", "llava"])
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--vision-preset", default="tiny", choices=["tiny", "bench"],
                    help="CLIP shape of a llava model (tiny: 16 image tokens; bench: 256)")
    mm.set_defaults(fn=_cmd_make_model)

    gen = sub.add_parser("generate", help="complete prompts with the offline engine")
    gen.add_argument("prompts", nargs="+")
    _add_generate_flags(gen)
    gen.set_defaults(fn=_cmd_generate)

    demo = sub.add_parser("demo", help="generate a few completions with the default model")
    _add_generate_flags(demo)
    demo.set_defaults(fn=_cmd_demo)

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
