"""tests/kernels_c/quant_check.c, the C driver that scripts/check_arm_kernels.sh runs at every
aarch64 level under qemu: linked with the library of each level this CPU runs (as build.py
builds and caches it), it holds quant_matmul_f32 to its float64 reference; given a wrong
product it fails. (The qemu run itself needs a cross toolchain, so it stays a script:
docs/kernels.md.)"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels.cpu import build

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "kernels_c" / "quant_check.c"
CPU = ROOT / "kernels" / "cpu"
CC = shutil.which("gcc") or shutil.which("cc")
LEVELS = build.runnable_levels() if CC else []
CASES = 256  # 8 types x 3 shapes x (T x method + 4 batch-one magnitudes), as main() counts them


def _build(tmp_path: Path, name: str, sources: list[Path]) -> Path:
    exe = tmp_path / name
    # --no-as-needed: the library stays a dependency when the stub below defines its symbol.
    proc = subprocess.run([CC, "-O2", "-std=gnu11", f"-I{CPU}", str(DRIVER), "-Wl,--no-as-needed",
                           *map(str, sources), "-o", str(exe), "-lm", "-ldl"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return exe


@pytest.mark.parametrize("level", LEVELS)
def test_the_driver_passes_at_every_level_this_cpu_runs(level, tmp_path):
    # Linked with the level's library as build.py builds and caches it: the very code that loads.
    exe = _build(tmp_path, f"quant_check-{level}", [build.build(level)])
    proc = subprocess.run([str(exe), level], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.splitlines()[-1] == f"quant_check {level}: {CASES} cases, 0 failed"


def test_the_driver_fails_a_wrong_product(tmp_path):
    # The library's product with row 3 of y 1% off, and for T = 8 a write past each row of y:
    # both must be reported, with a failing exit status.
    stub = tmp_path / "wrong.c"
    stub.write_text("""#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#define ARGS const float *x, int64_t xs, const uint8_t *w, int64_t N, int64_t rb, int type, int64_t K, \\
             float *y, int64_t ys, int64_t T, int method, int num_threads
void quant_matmul_f32(ARGS) {
    void (*real)(ARGS) = (void (*)(ARGS))dlsym(RTLD_NEXT, "quant_matmul_f32");
    real(x, xs, w, N, rb, type, K, y, ys, T, method, num_threads);
    for (int64_t t = 0; t < T; t++) {
        y[t * ys + 3] *= 1.01f;
        if (T == 8) y[t * ys + N] = 0.0f;
    }
}
""")
    exe = _build(tmp_path, "quant_check-wrong", [stub, build.build(build.runnable_levels()[0])])
    proc = subprocess.run([str(exe), "wrong"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert re.search(r"^FAIL off x@W\^T .* Q4_0 N=37 K=608 T=1 method=fp32", proc.stdout, re.M)
    assert re.search(r"^FAIL off x_q@W\^T .* Q6_K N=100 K=1024 T=3 method=int8", proc.stdout, re.M)
    assert re.search(r"^FAIL wrote past a row of y Q6_K N=5 K=256 T=8", proc.stdout, re.M)
    assert re.search(rf"^quant_check wrong: {CASES} cases, [1-9]\d* failed$", proc.stdout, re.M)
