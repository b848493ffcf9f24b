#!/usr/bin/env bash
# Download the wheels that the GPU check (scripts/gpu_check.sh) carries to the device machine, which reaches
# no package index: fla-core and flash-linear-attention 0.6.0 (pure Python, ~1.5 MB together; the version
# the dev extra pins and tests/test_kernels_delta.py's references come from). Their own needs (einops,
# torch >= 2.7, triton >= 3.3, transformers >= 5.6.2, < 6) are all in the device image (torch 2.11,
# triton 3.6, transformers 5.17), so --no-deps. Into .whl/ (git-ignored), which a device call names in
# `carry`:
#
#     bash scripts/fetch_gpu_wheels.sh          # here, once
#     run(command="PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=590)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[[ -x .venv/bin/python ]] && PY=${PYTHON:-.venv/bin/python}
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl fla-core==0.6.0 flash-linear-attention==0.6.0
ls -l .whl
