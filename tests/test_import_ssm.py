"""Mamba2 and RWKV-4 imported: the artifact's logits, greedy tokens and
resumed state against transformers' own classes (fp32, sharded, bf16) on CPU."""

import copy
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from edgeattn.convert import import_model
from edgeattn.export import export_model
from edgeattn.export.check import run_logits
from edgeattn.runtimes import open_session
from tests import hf_helpers
from tests.hf_helpers import hf_greedy, hf_logits, rel_err

PREFILL = 16
N = 200
MODELS = ["mamba2", "rwkv"]


@pytest.fixture(scope="module", params=MODELS)
def hf(request, tmp_path_factory):
    model = getattr(hf_helpers, request.param)()
    root = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(root / "fp32")
    import_model(root / "fp32", root / "ckpt")
    return model, root


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 320, size=(1, N)).astype(np.int64)


def edge_logits(ckpt, ids):
    import torch

    from edgeattn.models import EdgeLM

    with torch.no_grad():
        return EdgeLM.load(ckpt).eval()(torch.from_numpy(ids))[0].numpy()


@pytest.mark.parametrize("target", ["onnxruntime", "portable"])
def test_logits_equal_transformers_prefill_then_steps(hf, ids, tmp_path, target):
    model, root = hf
    art = export_model(
        root / "ckpt", tmp_path / "art", target=target, prefill_chunk=PREFILL, prefill_logits="all"
    )
    got = run_logits(open_session(art), ids)
    full = np.concatenate([got["prefill"], got["step"]], axis=1)
    assert got["step"].shape[1] == N % PREFILL
    assert rel_err(full, hf_logits(model, ids)) <= 1e-4
    if target == "onnxruntime":  # greedy tokens and a state resumed in a new process, on the same artifact
        prompt = ids[0, :19].tolist()
        assert list(open_session(art).generate_ids(prompt, 50, temperature=0)) == hf_greedy(model, prompt, 50)
        sess = open_session(art)
        sess.prefill(ids[:, :120])
        sess.save_state(tmp_path / "s.state")
        np.save(tmp_path / "ids.npy", ids)
        script = textwrap.dedent(
            f"""
            import numpy as np
            from edgeattn.runtimes import open_session
            sess = open_session({str(art)!r})
            sess.load_state({str(tmp_path / "s.state")!r})
            ids = np.load({str(tmp_path / "ids.npy")!r})
            np.save({str(tmp_path / "out.npy")!r}, np.stack([sess.step(ids[:, t : t + 1])[0] for t in range(120, {N})]))
            """
        )
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
        assert rel_err(np.load(tmp_path / "out.npy"), hf_logits(model, ids)[0, 120:]) <= 1e-4


def test_sharded_and_bf16_checkpoints(hf, ids, tmp_path):
    import torch

    model, root = hf
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    import_model(tmp_path / "sharded", tmp_path / "c1")
    assert rel_err(edge_logits(tmp_path / "c1", ids), hf_logits(model, ids)) <= 1e-4
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    ref = type(model).from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    import_model(tmp_path / "bf16", tmp_path / "c2")
    assert rel_err(edge_logits(tmp_path / "c2", ids), hf_logits(ref, ids)) <= 1e-4
