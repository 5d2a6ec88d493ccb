"""The sampling flags of `pdserve generate/demo` and `pdserve batch` (one definition, so
both commands take the same names; `--sampling-seed`, because `--seed` is the engine's)."""

from __future__ import annotations

import argparse

from engine.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling arguments")
    group.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                       help=f"tokens to generate per prompt (default {DEFAULT_MAX_TOKENS}, as the offline API)")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0, help="0: off")
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1: off (HF's meaning)")
    group.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI's meaning)")
    group.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (OpenAI's meaning)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The flags as SamplingParams (a bad value is a ParameterError naming the field)."""
    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        seed=args.sampling_seed, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
        stop=args.stop or None, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
    )
