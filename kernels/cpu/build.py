"""Builds kernels/cpu/*.c into one shared library with the machine's C compiler on first use
and loads it through ctypes (no torch headers, so a build takes about a second)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
# C signatures, in the order of the arguments of each function.
_SIGNATURES = {
    "paged_attention_rows_f32": [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64,
                                 _I64, _I64, _I64, _I64, _F32, _I64, _F32, _PTR, _I64, _I64, _INT],
    "rms_norm_f32": [_PTR, _I64, _PTR, _I64, _PTR, _F32, _PTR, _PTR, _I64, _I64, _INT],
    "silu_and_mul_f32": [_PTR, _I64, _PTR, _I64, _I64, _INT],
    "gelu_tanh_and_mul_f32": [_PTR, _I64, _PTR, _I64, _I64, _INT],
    "rotary_neox_f32": [_PTR, _PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _I64,
                        _I64, _I64, _INT],
    "reshape_and_cache_f32": [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64],
    "quant_matmul_f32": [_PTR, _I64, _PTR, _I64, _I64, _INT, _I64, _PTR, _I64, _I64, _INT, _INT],
    "quant_embedding_f32": [_PTR, _I64, _PTR, _I64, _INT, _I64, _PTR, _INT],
    "decode_stack_scratch": [_PTR, _I64],
    "decode_stack_f32": [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR],
}
_RESTYPES = {"decode_stack_scratch": _I64}  # the rest return nothing
_lib: ctypes.CDLL | None = None
_tried = False


def _cpu_signature() -> str:
    """What -march=native depends on, so a cache shared across machines keeps one build per CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _build(cc: str) -> Path:
    digest = hashlib.sha256(
        b"".join(src.read_bytes() for src in _SOURCES + _HEADERS) + " ".join([cc, *_FLAGS, _cpu_signature()]).encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "kernels"
    target = root / f"cpu_kernels-{digest}.so"
    if not target.exists():
        root.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: processes starting together never load a
        # half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
        os.close(fd)
        try:
            subprocess.run([cc, *_FLAGS, *map(str, _SOURCES), "-o", tmp, "-lm"], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built (the references run instead)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("no C compiler found: the CPU path runs the torch references (slower)")
        return None
    try:
        # torch loads its OpenMP runtime first, so the library's libgomp.so.1 resolves to it:
        # one thread pool for both.
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning("native CPU kernels unavailable (%s): the torch references run instead",
                       getattr(e, "stderr", "") or e)
        return None
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = _RESTYPES.get(name)
    _lib = lib
    return lib
