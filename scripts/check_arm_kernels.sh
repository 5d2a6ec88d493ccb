#!/usr/bin/env bash
# The quantized products of kernels/cpu at every aarch64 ISA level, checked on an x86 machine:
# tests/kernels_c/quant_check.c (a float64 reference and the Python tests' tolerances) built
# with the aarch64 cross compiler at each level's flags (kernels/cpu/build.py's ARM_LEVELS) and
# run under user-mode qemu with every CPU feature on (-cpu max); then natively at the x86
# levels this CPU runs, so that the same driver holds both to one reference
# (docs/kernels.md#checking-the-aarch64-levels). qemu emulates: its times say nothing of
# speed on ARM hardware.
#
#   bash scripts/check_arm_kernels.sh          # needs gcc-aarch64-linux-gnu and qemu-user
#
# Environment: CROSS_CC (default aarch64-linux-gnu-gcc), QEMU (default qemu-aarch64),
# SYSROOT (default /usr/aarch64-linux-gnu), CC (default gcc) for the x86 levels.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
CROSS_CC=${CROSS_CC:-aarch64-linux-gnu-gcc}
QEMU=${QEMU:-qemu-aarch64}
SYSROOT=${SYSROOT:-/usr/aarch64-linux-gnu}
CC=${CC:-gcc}
workdir=$(mktemp -d)
trap 'rm -rf "$workdir"' EXIT

# "arch level flags..." per line, from build.py itself (standard library only, so no
# environment is needed to read it).
levels=$(python3 - "$root/kernels/cpu/build.py" <<'EOF'
import importlib.util
import sys

spec = importlib.util.spec_from_file_location("build", sys.argv[1])
build = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
for name, (_, flags) in build.ARM_LEVELS.items():
    print("arm", name, *flags)
for name in build.runnable_levels(machine="x86_64"):
    print("x86", name, *build.X86_LEVELS[name][1])
EOF
)

status=0
summary=""
while read -r arch level flags; do
    # shellcheck disable=SC2086  # the flags are words
    if [ "$arch" = arm ]; then
        cc=$CROSS_CC run=("$QEMU" -cpu max -L "$SYSROOT")
    else
        [ "$(uname -m)" = x86_64 ] || continue
        cc=$CC run=()
    fi
    exe="$workdir/quant_check-$arch-$level"
    echo "== $arch $level: $cc $flags"
    if ! $cc -O3 -fopenmp -std=gnu11 $flags -I"$root/kernels/cpu" "$root/tests/kernels_c/quant_check.c" \
            "$root/kernels/cpu/quant.c" -o "$exe" -lm -Wno-psabi; then
        summary+="$arch $level: BUILD FAILED"$'\n'
        status=1
        continue
    fi
    "${run[@]}" "$exe" "$arch/$level" >"$exe.log" || status=1
    cat "$exe.log"
    line=$(tail -n 1 "$exe.log")
    [[ $line == quant_check* ]] || line="$arch $level: no summary line (the driver crashed)"
    summary+="$line"$'\n'
done <<<"$levels"
echo "== summary"
printf '%s' "$summary"
exit $status
