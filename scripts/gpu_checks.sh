#!/usr/bin/env bash
# The GPU checks in one command, on a machine with a CUDA GPU
# (docs/development.md#running-the-gpu-checks). PY names the Python (default python3); wheels in
# .whl/, if any, are installed to /tmp/site for a machine without network access. Each stage
# has its own time limit and log, so one failing stage does not hide the others; a summary line
# per stage comes last.
#
#   bash scripts/gpu_checks.sh [stage ...]    # stages: gpu_tests env parity_small throughput kernels
#                                              #         parity_1b parity_smollm2 gguf_tests kernels_quant
#                                              #         attention1 gguf_gpu profile (default: the first five)
#                                              #         stash_ray, then serve_cpu in a later run
#                                              #         stash_smol, then parity_smollm2 likewise
# Logs go to /tmp/gpu_out, or to the folder in the LOG_DIR environment variable.
set -u
LOG_DIR=${LOG_DIR:-/tmp/gpu_out}
mkdir -p "$LOG_DIR"
PY=${PY:-python3}
install() {  # wheels into /tmp/site, first on the path (docs/development.md#running-the-gpu-checks)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@" || exit 1
}
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
if ls .whl/*.whl >/dev/null 2>&1; then
    install .whl/*.whl
fi
# Packages with no wheel on the registry for that Python (llguidance: abi3, copied from this
# machine's venv) travel as an importable folder.
[ -d .gpu/site ] && export PYTHONPATH=$PWD/.gpu/site:$PYTHONPATH
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PDSERVE_CACHE=/tmp/pdserve-cache
SUMMARY=""

stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
    rc=$?
    tail -n 12 "$LOG_DIR/$name.log"
    SUMMARY+="$name rc=$rc $(($(date +%s) - start))s"$'\n'
}

SMOL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(gpu_tests env parity_small throughput kernels)
for s in "${stages[@]}"; do
    case $s in
        gpu_tests)
            # The gpu-marked tests on CUDA with compiled Triton (docs/development.md#tests-on-a-gpu).
            # Only the files that hold them are collected: the others import packages this
            # machine lacks (Ray, the openai client).
            # Four workers share the card (each engine takes GPU_TEST_SHARE of it) and compile
            # their kernels side by side.
            stage gpu_tests 240 env PDSERVE_TEST_GPU=1 $PY -m pytest -m gpu -q -p no:cacheprovider -n 4 --timeout 120 \
                $(grep -rl --include='test_*.py' 'pytest.mark.gpu' tests) ;;
        env) stage env 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv; nproc;
              '"$PY"' -c "import sys,torch,triton,transformers; print(sys.version.split()[0], torch.__version__, triton.__version__, transformers.__version__)"' ;;
        parity_small) stage parity_small 120 $PY scripts/gpu_parity.py --preset small ;;
        throughput) stage throughput 150 $PY scripts/bench_throughput.py --gpu ;;
        gguf_tests)  # the GGUF kernel's and the kept-blocks engine's gpu-marked tests alone
            stage gguf_tests 90 env PDSERVE_TEST_GPU=1 $PY -m pytest -m gpu -q -p no:cacheprovider \
                tests/kernels/test_triton_gguf.py tests/engine/test_quantized_gguf.py ;;
        kernels) stage kernels 150 $PY scripts/bench_kernels.py ;;
        kernels_quant) stage kernels_quant 130 $PY scripts/bench_kernels.py --only gguf tiles ;;
        attention1) stage attention1 60 $PY scripts/bench_kernels.py --only attention1 ;;
        gguf_gpu) stage gguf_gpu 100 $PY scripts/bench_gguf_gpu.py ;;
        profile) stage profile 150 $PY scripts/gpu_profile.py ;;
        parity_1b) stage parity_1b 150 $PY scripts/gpu_parity.py --preset 1b ;;
        stash_ray) mkdir -p /tmp/wa && cp .gpu/wa/* /tmp/wa/ && ls /tmp/wa | wc -l ;;
        serve_cpu)
            # Ray and Serve from two parts when the machine lacks them: stash_ray kept the
            # first part in an earlier run, this run brings the rest.
            if [ -f /tmp/wa/ray.part0 ] && [ -f .gpu/wb/ray.part1 ]; then
                cat /tmp/wa/ray.part0 .gpu/wb/ray.part1 > /tmp/wa/ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
                install /tmp/wa/*.whl .gpu/wb/*.whl
            fi
            stage serve_cpu 400 $PY scripts/bench_server_cpu.py --preset small --modes colocated \
                --concurrency 8,64 --requests 96,512 --repeats 1 --intervals "" --skip-bytes --idle-s 0 \
                --quiet-wait-s 0 --gpu-memory-utilization 0.4 --json "$LOG_DIR/serve_cpu.json" ;;
        stash_smol) cp .gpu/smol.00 /tmp/smol.00 ;;  # SmolLM2's first part; parity_smollm2 in a later run
        parity_smollm2)
            if [ ! -f "$SMOL" ]; then  # never a truncated file under the final name
                cat /tmp/smol.00 .gpu/smol.01 > "$SMOL.part" && mv "$SMOL.part" "$SMOL" || exit 1
            fi
            stage parity_smollm2 90 $PY scripts/gpu_parity.py --model "$SMOL" ;;
        *) echo "unknown stage $s"; exit 2 ;;
    esac
done
echo "=== summary"
printf '%s' "$SUMMARY"
