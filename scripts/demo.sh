#!/usr/bin/env bash
# The main job, end to end: set up, train a small GLA model on the Python standard library's sources,
# export it to ONNX, generate through ONNX Runtime, check it against PyTorch, and measure decode latency
# and memory at 128 and 8192 tokens next to a softmax KV-cache baseline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
E=.venv/bin/edgeattn
OUT=${DEMO_OUT:-runs/demo}
SECONDS_TO_TRAIN=${DEMO_TRAIN_SECONDS:-300}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

echo "== train (GLA, ${SECONDS_TO_TRAIN} s on the stdlib corpus)"
$E train --mixer gla --time-budget "$SECONDS_TO_TRAIN" --out "$OUT/gla"
echo "== export"
$E export "$OUT/gla" --out "$OUT/gla.onnx" --force
echo "== generate through ONNX Runtime"
$E run "$OUT/gla.onnx" --prompt "def " -n 300 --temperature 0.7 --seed 0
echo "== check the artifact against PyTorch"
$E check "$OUT/gla.onnx"
echo "== decode latency and memory at 128 and 8192 tokens, against a softmax KV cache"
.venv/bin/python benchmarks/demo_decode.py "$OUT/gla.onnx" --marks 128,8192
