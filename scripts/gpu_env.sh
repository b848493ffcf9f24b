# Sourced by scripts/gpu_check.sh and scripts/gpu_profile.sh, from the checkout's root with PY set: fla from
# the carried wheels in .whl/ when the device image lacks it (into /tmp/site), this checkout first on
# PYTHONPATH, and one Triton cache folder. $1: the calling script's name, for its error line.
if ! "$PY" -c "import fla" 2>/dev/null; then
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "$1: fla is not installed and .whl/ holds no wheels (run scripts/fetch_gpu_wheels.sh here, carry .whl)" >&2
        exit 2
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
mkdir -p "$TRITON_CACHE_DIR"
