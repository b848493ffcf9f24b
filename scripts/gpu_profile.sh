#!/usr/bin/env bash
# Why the Triton kernels are slower than fla's on a GPU (issue 36), in one device call after
# scripts/gpu_check.sh: benchmarks/gpu_profile.py (the launch-setting sweep, our forms and the per-kernel
# breakdown of ours and fla's), Nsight Compute on one forward + backward of gla, its gates as pairs and as
# float32 sums (our Triton kernels: speed of light, occupancy, launch statistics: CSV), and with
# GPU_PROFILE_TRAIN=1 the train section's edgeattn Gated DeltaNet row (which the first H200 run's 130 s train
# budget left out; now 170 s). Output in $OUT (or the first argument), 8 files at most. About 4-5 minutes
# (6 with the train row):
#
#     run(command="PYTHONUNBUFFERED=1 bash scripts/gpu_profile.sh", carry=[".whl"], timeout_s=330)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-runs/gpu-profile}}
PY=${PYTHON:-python3}
if [[ -e "$OUT_DIR" && ! -d "$OUT_DIR" ]]; then
    echo "gpu_profile.sh: $OUT_DIR exists and is not a folder" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"
source scripts/gpu_env.sh gpu_profile.sh
timeout 170 "$PY" benchmarks/gpu_profile.py --out "$OUT_DIR" --budget ${PROFILE_BUDGET:-150} 2>&1 | tee "$OUT_DIR/profile.log"
rc=${PIPESTATUS[0]}
echo "gpu_profile.sh: profile exit $rc"
[[ $rc == 2 ]] && exit 2  # refused its arguments: no ncu runs
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
if [[ -n "$NCU" ]]; then
    # the per-key GLA with its gates as exact pairs (shipped) and as float32 sums (gated_delta's was profiled
    # on the H200 run of 2026-11-28; NCU_RUNS="gated_delta:triton ..." for others)
    for run in ${NCU_RUNS:-gla:triton gla:triton-f32g}; do
        op=${run%%:*}; impl=${run#*:}; name=ncu_${op}${impl#triton}
        # edgeattn's Triton kernels only (torch.profiler's breakdown has PyTorch's); from cudaProfilerStart
        timeout ${NCU_TIMEOUT:-60} "$NCU" --profile-from-start off -k "regex:^chunk_" --clock-control none \
            --section SpeedOfLight --section Occupancy --section LaunchStats --csv --page details \
            --log-file "$OUT_DIR/$name.csv" "$PY" benchmarks/gpu_profile.py --ncu "$op" --ncu-impl "$impl" \
            --out "$OUT_DIR"
        echo "gpu_profile.sh: ncu $op $impl exit $? ($(wc -l < "$OUT_DIR/$name.csv" 2>/dev/null || echo 0) lines)"
    done
else
    echo "gpu_profile.sh: ncu not found" | tee "$OUT_DIR/ncu_gla.csv"
fi
if [[ "${GPU_PROFILE_TRAIN:-0}" == 1 ]]; then
    timeout 90 "$PY" benchmarks/gpu_check.py --out "$OUT_DIR/train" --sections train --models gated_deltanet \
        --train-libs edgeattn --budgets train=${TRAIN_BUDGET:-70}
    echo "gpu_profile.sh: train exit $?"
fi
