"""Native CPU kernels: C compiled on first use with the machine's C compiler, called through
ctypes (no torch headers, so a build takes about a second).

`paged_attention` has the contract and signature of `kernels.reference.paged_attention`; rows
with at most `NATIVE_MAX_QUERY_LEN` query tokens (decode, short chunks) run in C straight off
the paged cache, longer ones through the reference. Anything the C code does not cover (not
fp32, odd head sizes, no compiler, PDSERVE_CPU_KERNELS=0) runs the reference unchanged.
"""

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

import torch

from kernels import reference

logger = logging.getLogger(__name__)

# Longer runs of query tokens are prefills: SDPA's GEMMs beat per-query dot products there.
NATIVE_MAX_QUERY_LEN = 16
_MAX_HEAD_DIM = 512  # MAX_D in paged_attention.c
_SOURCE = Path(__file__).with_name("paged_attention.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
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
        _SOURCE.read_bytes() + " ".join([cc, *_FLAGS, _cpu_signature()]).encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "kernels"
    target = root / f"paged_attention-{digest}.so"
    if not target.exists():
        root.mkdir(parents=True, exist_ok=True)
        # Built under a temporary name and renamed: processes starting together never load a
        # half-written library.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
        os.close(fd)
        try:
            subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", tmp, "-lm"], check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return target


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None where they cannot be built (the reference runs instead)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0" or not sys.platform.startswith("linux"):
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        logger.warning("no C compiler found: CPU attention runs the torch reference (slower)")
        return None
    try:
        # torch loads its OpenMP runtime first, so the library's libgomp.so.1 resolves to it:
        # one thread pool for both.
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        logger.warning("native CPU kernels unavailable (%s): the torch reference runs instead", detail)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.paged_attention_rows_f32.argtypes = [
        ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64,
        ctypes.c_float, ptr, i64, i64, ctypes.c_int,
    ]
    lib.paged_attention_rows_f32.restype = None
    _lib = lib
    return lib


def _native_ok(q, key_cache, value_cache, block_table, query_start_loc, seq_lens, out) -> bool:
    D = q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dtype == key_cache.dtype == value_cache.dtype == out.dtype == torch.float32
        and D % 8 == 0 and D <= _MAX_HEAD_DIM
        and q.stride(-1) == 1 and out.stride(-1) == 1
        and key_cache.is_contiguous() and value_cache.is_contiguous()
        and block_table.dtype == query_start_loc.dtype == seq_lens.dtype == torch.int32
        and block_table.stride(-1) == 1
        and query_start_loc.is_contiguous() and seq_lens.is_contiguous()
    )


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [R, max_blocks] int32
    query_start_loc: torch.Tensor,  # [R + 1] int32
    seq_lens: torch.Tensor,  # [R] int32
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
) -> torch.Tensor:
    """kernels.reference.paged_attention, short query runs in C (module docstring)."""
    if out is None:
        out = torch.empty_like(q)
    lib = library()
    if lib is None or not _native_ok(q, key_cache, value_cache, block_table, query_start_loc, seq_lens, out):
        return reference.paged_attention(q, key_cache, value_cache, block_table, query_start_loc,
                                         seq_lens, scale, out)
    starts = query_start_loc.tolist()
    ctx = seq_lens.tolist()
    short, long = [], []
    for r in range(len(ctx)):
        q_len = starts[r + 1] - starts[r]
        if q_len > NATIVE_MAX_QUERY_LEN:
            long.append(r)
        elif q_len > 0:
            short.append(r)
    if short:
        rows = torch.tensor(short, dtype=torch.int64)
        _, block_size, Hkv, D = key_cache.shape
        lib.paged_attention_rows_f32(
            q.data_ptr(), q.stride(0), q.stride(1), key_cache.data_ptr(), value_cache.data_ptr(),
            block_table.data_ptr(), block_table.stride(0), query_start_loc.data_ptr(),
            seq_lens.data_ptr(), rows.data_ptr(), len(short), q.shape[1], Hkv, D, block_size,
            scale, out.data_ptr(), out.stride(0), out.stride(1), torch.get_num_threads(),
        )
    if long:
        reference.prefill_attention(q, key_cache, value_cache, block_table, starts, ctx, long, scale, out)
    return out
