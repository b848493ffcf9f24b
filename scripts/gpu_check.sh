#!/usr/bin/env bash
# The GPU check of issue 36 on a device machine: install the carried fla wheels when fla is missing, then
# benchmarks/gpu_check.py (its docstring says what it measures). Output in $OUT (or the first argument).
# The exact device call, after `bash scripts/fetch_gpu_wheels.sh` here:
#
#     run(command="PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=590)
#
# Any further arguments go to gpu_check.py (e.g. --sections kernels,train --budgets kernels=200).
#
# Compiling is most of a first run (fla's autotuned kernels above all). The Triton cache it leaves is
# packed into $OUT/triton-cache.tgz (when under 48 MB); a later call that carries it back as
# .triton-cache.tgz in the checkout starts from it (copy it there from the run's files_at, carry it with
# .whl): the same GPU architecture and Triton version reuse every compiled kernel and autotune result.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-runs/gpu-check}}
shift || true
PY=${PYTHON:-python3}
source scripts/gpu_env.sh gpu_check.sh
if [[ -f .triton-cache.tgz ]]; then
    tar -xzf .triton-cache.tgz -C "$TRITON_CACHE_DIR" && echo "gpu_check.sh: Triton cache from .triton-cache.tgz"
fi
"$PY" benchmarks/gpu_check.py --out "$OUT_DIR" "$@"
rc=$?
[[ $rc == 2 ]] && exit 2  # refused its arguments (one line said why): nothing else runs
mkdir -p "$OUT_DIR"
# issue 34's `edgeattn linearize --device cuda` (a tiny transformers teacher; skipped on machines without CUDA)
"$PY" -m pytest -q -rs tests/test_linearize.py -k cuda > "$OUT_DIR/linearize_cuda.txt" 2>&1
echo "gpu_check.sh: linearize on CUDA: $(tail -n 1 "$OUT_DIR/linearize_cuda.txt")"
tar -czf "$OUT_DIR/triton-cache.tgz" -C "$TRITON_CACHE_DIR" . 2>/dev/null
if [[ $(stat -c %s "$OUT_DIR/triton-cache.tgz" 2>/dev/null || echo 0) -gt $((48 * 1024 * 1024)) ]]; then
    rm -f "$OUT_DIR/triton-cache.tgz"
    echo "gpu_check.sh: the Triton cache is over 48 MB: not packed" >&2
fi
exit $rc
