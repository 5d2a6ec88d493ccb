"""The embedded default model every entry point falls back on when no `--model` is given.

Its own module so the CLI, the Serve config builder and the scripts share it without
importing each other.
"""

from __future__ import annotations

import os
import sys

from engine.errors import ParameterError

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


def require_model_dir(model: str) -> None:
    """Fail before any actor starts when the model directory is missing: every engine replica
    or batch actor opens the same path, on whichever node it lands."""
    if not isinstance(model, str) or not os.path.isdir(model):
        raise ParameterError("model", f"model must be a model directory visible to every node; "
                             f"{model!r} does not exist")
