"""Builds kernels/cpu/*.c into a shared library with the machine's C compiler on first use and
loads it through ctypes (no torch headers, so a build takes seconds, not minutes).

One build per ISA level, each with explicit flags (never -march=native), so a level's library
is the same on every machine that runs it and a cache shared between machines holds one file
per level. The level is the best this CPU runs (its /proc/cpuinfo flags), or the one
PDSERVE_CPU_ISA names.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "PDSERVE_CPU_ISA"
_SOURCES = sorted(Path(__file__).parent.glob("*.c"))
_HEADERS = sorted(Path(__file__).parent.glob("*.h"))
_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
# x86 levels, best first: the /proc/cpuinfo flags a level needs, and its compiler flags. Each
# starts from the x86-64 baseline, so the compiler's own default -march does not leak in.
_X86 = "-march=x86-64"
_X86_AVX2 = ["-mavx2", "-mfma", "-mf16c"]
X86_LEVELS = {
    "avx512": (("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"),
               [_X86, *_X86_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]),
    # Intel's client cores from Alder Lake on: AVX2 with the 256-bit VNNI dot product.
    "avx2_vnni": (("avx2", "fma", "f16c", "avx_vnni"), [_X86, *_X86_AVX2, "-mavxvnni"]),
    "avx2": (("avx2", "fma", "f16c"), [_X86, *_X86_AVX2]),
    "portable": ((), [_X86]),
}
# aarch64 levels, best first, from /proc/cpuinfo's "Features": asimd (Advanced SIMD, which
# quant_neon*.h's intrinsics need) and asimddp (the int8 dot product, vdotq_s32). "portable"
# turns Advanced SIMD off, so it runs on any aarch64 core and is the plain C the others are
# checked against (its vector types compile to scalar code).
ARM_LEVELS = {
    "neon_dotprod": (("asimd", "asimddp"), ["-march=armv8.2-a+dotprod"]),
    "neon": (("asimd",), ["-march=armv8-a"]),
    "portable": ((), ["-march=armv8-a+nosimd"]),
}
# Elsewhere only plain C at the compiler's default for the target.
OTHER_LEVELS = {"portable": ((), [])}
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
    "half_matmul_f32": [_PTR, _I64, _PTR, _I64, _I64, _I64, _INT, _PTR, _I64, _I64, _INT],
    "decode_stack_scratch": [_PTR, _I64],
    "decode_stack_f32": [_PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR],
}
_RESTYPES = {"decode_stack_scratch": _I64}  # the rest return nothing
_lib: ctypes.CDLL | None = None
_lib_level: str | None = None
_tried = False
# Tensor-parallel ranks in threads load their models at once: the first call builds while the
# others wait, rather than reading `_tried` set and `_lib` not yet loaded (None: no kernels).
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}


def _levels(machine: str) -> dict[str, tuple[tuple[str, ...], list[str]]]:
    if machine in ("x86_64", "AMD64", "amd64"):
        return X86_LEVELS
    return ARM_LEVELS if machine in ("aarch64", "arm64") else OTHER_LEVELS


def _cpu_flags() -> set[str]:
    """The CPU's feature names: /proc/cpuinfo's "flags" (x86) or "Features" (ARM) line."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((x for x in f if x.startswith(("flags", "Features"))), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def runnable_levels(cpu_flags: set[str] | None = None, machine: str | None = None) -> list[str]:
    """The levels this CPU (or the given flags on the given platform.machine()) runs, best first."""
    flags = _cpu_flags() if cpu_flags is None else cpu_flags
    levels = _levels(machine or platform.machine())
    return [name for name, (needs, _) in levels.items() if set(needs) <= flags]


def isa_level(cpu_flags: set[str] | None = None, machine: str | None = None) -> str:
    """The level the kernels are built for: PDSERVE_CPU_ISA if set, else the best this CPU runs.
    A forced level this CPU cannot run (or no level at all) is a ValueError naming the choices."""
    runnable = runnable_levels(cpu_flags, machine)
    forced = os.environ.get(ENV, "").strip()
    if not forced:
        return runnable[0]
    if forced not in runnable:
        known = list(_levels(machine or platform.machine()))
        what = "is not a level this CPU can run" if forced in known else "is not a known level"
        raise ValueError(f"{ENV}={forced!r} {what}; allowed on this CPU: {', '.join(runnable)} "
                         f"(levels known on this architecture: {', '.join(known)})")
    return forced


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(level: str, cc: str | None = None) -> Path:
    """The library of `level` (built once, then cached under $PDSERVE_CACHE/kernels)."""
    cc = cc or _compiler()
    if cc is None:
        raise OSError("no C compiler found")
    flags = [*_FLAGS, *_levels(platform.machine())[level][1]]
    digest = hashlib.sha256(
        b"".join(src.read_bytes() for src in _SOURCES + _HEADERS) + " ".join([cc, *flags]).encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "kernels"
    target = root / f"cpu_kernels-{level}-{digest}.so"
    if not target.exists():
        root.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: processes starting together never load a
        # half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
        os.close(fd)
        try:
            subprocess.run([cc, *flags, *map(str, _SOURCES), "-o", tmp, "-lm"], check=True,
                           capture_output=True, text=True, timeout=300)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def load(level: str) -> ctypes.CDLL:
    """The kernels of `level`, built if needed, with their ctypes signatures set. Raises OSError
    or subprocess.SubprocessError when they cannot be built."""
    if level not in _loaded:
        # torch loads its OpenMP runtime first, so the library's libgomp.so.1 resolves to it:
        # one thread pool for both.
        lib = ctypes.CDLL(str(build(level)))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = _RESTYPES.get(name)
        _loaded[level] = lib
    return _loaded[level]


def library() -> ctypes.CDLL | None:
    """The compiled kernels of isa_level(), or None where they cannot be built (the references
    run instead)."""
    if _tried:
        return _lib
    with _lock:
        return _load_library()


def _load_library() -> ctypes.CDLL | None:
    global _lib, _lib_level, _tried
    if _tried:
        return _lib
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0" or not sys.platform.startswith("linux"):
        _tried = True
        return None
    level = isa_level()  # a bad PDSERVE_CPU_ISA is the user's to fix: raised, not swallowed
    if _compiler() is None:
        _tried = True
        logger.warning("no C compiler found: the CPU path runs the torch references (slower)")
        return None
    try:
        lib = load(level)
    except (OSError, subprocess.SubprocessError) as e:
        _tried = True
        logger.warning("native CPU kernels unavailable (%s): the torch references run instead",
                       getattr(e, "stderr", "") or e)
        return None
    _lib, _lib_level = lib, level
    _tried = True  # last: the unlocked fast path reads _lib once this is set
    best = runnable_levels()[0]
    logger.info("native CPU kernels: ISA level %s%s", level,
                f" (forced by {ENV}; this CPU runs {best})" if level != best else "")
    return _lib


def level_in_use() -> str:
    """What runs the CPU kernels, for logs and reports: the loaded library's ISA level, or
    "references" when there is none (no compiler, PDSERVE_CPU_KERNELS=0, a failed build)."""
    return _lib_level if library() is not None else "references"
