"""Which transformers class `AutoTokenizer` picks for a tokenizer directory, remembered on disk.

`AutoTokenizer.from_pretrained` decides the class from the model's config, and reading the
config imports the model's config class, which in transformers 5 pulls in its kernels hub
check (a scan of every installed package's metadata), `torch.distributed.tensor` and sympy:
about 1.3-1.9 CPU-s in a fresh process, against 0.1 s for the tokenizer itself. Every replica,
core fallback and batch actor of an app is such a fresh process. The first load of a
directory records the class AutoTokenizer chose under the pdserve cache; later loads call that
class's `from_pretrained` directly with the arguments AutoTokenizer passes it, which is what
AutoTokenizer ends with in every branch.

The record is keyed by the directory's path, the name, size and mtime of every file in it and
the transformers version, so any change to the files or to transformers asks AutoTokenizer
again. Only transformers' own classes are recorded (never remote code). A missing, unreadable
or stale record costs only the AutoTokenizer load.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile

from engine.cache_dir import cache_root

logger = logging.getLogger(__name__)


def load_hf_tokenizer(model_dir: str):
    """`AutoTokenizer.from_pretrained(model_dir)`, through the class recorded for these files
    when there is one."""
    cls = remembered_class(model_dir)
    if cls is not None:
        try:
            # What AutoTokenizer passes the class it picked (`_from_auto`: only its telemetry).
            return cls.from_pretrained(model_dir, _from_auto=True)
        except Exception:  # noqa: BLE001 - whatever it is, AutoTokenizer decides (and reports it)
            logger.debug("the recorded %s did not load %s; asking AutoTokenizer", cls.__name__, model_dir,
                         exc_info=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    remember_class(model_dir, type(tokenizer))
    return tokenizer


def _record_path(model_dir: str) -> str | None:
    import transformers

    try:
        root = os.path.realpath(model_dir)
        files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                       for e in os.scandir(root) if e.is_file())
    except OSError:
        return None
    key = repr((root, files, transformers.__version__)).encode()
    return os.path.join(cache_root(), "tokenizer-classes", hashlib.sha256(key).hexdigest()[:24])


def remembered_class(model_dir: str):
    """The transformers class AutoTokenizer picked for these exact files, or None."""
    path = _record_path(model_dir)
    if path is None:
        return None
    try:
        with open(path) as f:
            name = f.read().strip()
    except OSError:
        return None
    import transformers

    cls = getattr(transformers, name, None) if name.isidentifier() else None
    return cls if isinstance(cls, type) and hasattr(cls, "from_pretrained") else None


def remember_class(model_dir: str, cls: type) -> None:
    """Record `cls` for these files if it is one of transformers' own exported classes."""
    import transformers

    if not cls.__module__.startswith("transformers.") or getattr(transformers, cls.__name__, None) is not cls:
        return
    path = _record_path(model_dir)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # A private file renamed into place: a concurrent reader never sees half a name.
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            f.write(cls.__name__)
        os.replace(tmp, path)
    except OSError as e:  # a read-only cache only costs the AutoTokenizer load next time
        logger.debug("could not record the tokenizer class of %s: %s", model_dir, e)
