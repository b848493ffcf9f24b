"""fla models imported: tests/fixtures/fla/<model_type>/ holds a tiny random model built with fla's own
classes (flash-linear-attention 0.6, scripts/make_fla_fixtures.py) and fla's logits and greedy tokens, the
reference. fla runs on this CPU only in Triton's interpreter, so the default tests read the stored reference
and a slow test regenerates it with fla itself."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edgeattn.convert import import_model
from edgeattn.export import export_model
from edgeattn.export.check import run_logits
from edgeattn.runtimes import open_session
from tests.hf_helpers import rel_err

FIXTURES = Path(__file__).parent / "fixtures" / "fla"
# fixture directory (a model_type, or a variant of one) -> edgeattn mixer
MIXERS = {
    "gla": "gla",
    "delta_net": "deltanet",
    "gated_deltanet": "gated_deltanet",
    "retnet": "retnet",  # rotary embeddings (a position state), grouped k/v heads
    "retnet_relu": "retnet",  # a feature map, no output gate
    "linear_attn": "linear",  # fla's default learned feature map, grouped k/v heads
    "linear_attn_elu": "linear",  # elu + 1, q/k sum norms, normalized
}
MODELS = list(MIXERS)
PREFILL = 24  # 80 reference tokens: 3 prefill chunks, then 8 single steps


def reference(mt: str):
    return np.load(FIXTURES / mt / "reference.npz")


@pytest.fixture(scope="module", params=MODELS)
def imported(request, tmp_path_factory):
    mt = request.param
    ckpt = tmp_path_factory.mktemp(mt) / "ckpt"
    cfg, _ = import_model(FIXTURES / mt, ckpt)
    assert cfg.mixers == [MIXERS[mt]] * cfg.n_layers
    return mt, ckpt


def test_checkpoint_logits_equal_fla(imported):
    import torch

    from edgeattn.models import EdgeLM

    mt, ckpt = imported
    ref = reference(mt)
    with torch.no_grad():
        got = EdgeLM.load(ckpt).eval()(torch.from_numpy(ref["ids"])[None])[0][0].numpy()
    assert rel_err(got, ref["logits"]) <= 1e-4


@pytest.mark.parametrize("target", ["onnxruntime", "portable"])
def test_artifact_logits_equal_fla_prefill_then_steps(imported, tmp_path, target):
    mt, ckpt = imported
    ref = reference(mt)
    art = export_model(ckpt, tmp_path / "art", target=target, prefill_chunk=PREFILL, prefill_logits="all")
    got = run_logits(open_session(art), ref["ids"][None])
    assert got["step"].shape[1] == len(ref["ids"]) % PREFILL > 0
    full = np.concatenate([got["prefill"], got["step"]], axis=1)[0]
    assert rel_err(full, ref["logits"]) <= 1e-4
    if target == "onnxruntime":  # greedy tokens, and a state resumed in a new process
        prompt = ref["ids"][:8].tolist()
        want = ref["greedy"].tolist()
        assert list(open_session(art).generate_ids(prompt, len(want), temperature=0)) == want
        sess = open_session(art)
        sess.prefill(ref["ids"][None, :40])
        sess.save_state(tmp_path / "s.state")
        script = textwrap.dedent(
            f"""
            import numpy as np
            from edgeattn.runtimes import open_session
            sess = open_session({str(art)!r})
            sess.load_state({str(tmp_path / "s.state")!r})
            ids = np.load({str(FIXTURES / mt / "reference.npz")!r})["ids"][None]
            np.save({str(tmp_path / "out.npy")!r}, np.stack([sess.step(ids[:, t : t + 1])[0] for t in range(40, 80)]))
            """
        )
        subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
        assert rel_err(np.load(tmp_path / "out.npy"), ref["logits"][40:]) <= 1e-4


def _edit_config(tmp_path, mt: str, **changes) -> Path:
    d = tmp_path / "src"
    shutil.copytree(FIXTURES / mt, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@pytest.mark.parametrize(
    "mt,changes,msg",
    [
        ("gla", {"use_short_conv": True}, "config field use_short_conv = True"),
        ("gla", {"feature_map": "relu"}, "config field feature_map = 'relu'"),
        ("gla", {"num_kv_heads": 1}, "config field num_kv_heads = 1"),
        ("gla", {"attn": {"layers": [1], "num_heads": 2}}, "config field attn = "),
        ("gated_deltanet", {"use_short_conv": False}, "config field use_short_conv = False"),
        ("gated_deltanet", {"output_gate_activation": "sigmoid"}, "output_gate_activation = 'sigmoid'"),
        ("gated_deltanet", {"hidden_act": "gelu"}, "config field hidden_act = 'gelu'"),
        ("gated_deltanet", {"head_dim": 16}, "the config disagrees with the weights"),
        ("gla", {"expand_k": 1.0}, "the config disagrees with the weights"),
        ("delta_net", {"qk_activation": "relu"}, "config field qk_activation = 'relu'"),
        ("delta_net", {"use_gate": True}, "config field use_gate = True"),
        ("retnet", {"use_short_conv": True}, "config field use_short_conv = True"),
        ("retnet", {"feature_map": "gelu_new"}, "config field feature_map = 'gelu_new'"),
        ("retnet", {"num_kv_heads": 3}, "config field num_kv_heads = 3"),
        ("retnet", {"num_kv_heads": 4}, "the config disagrees with the weights"),
        ("linear_attn", {"feature_map": "hedgehog"}, "config field feature_map = 'hedgehog'"),
        ("linear_attn", {"feature_map": "dpfp"}, "config field feature_map = 'dpfp'"),
        ("linear_attn", {"expand_v": 2.0}, "the config disagrees with the weights"),
    ],
)
def test_unrepresentable_or_inconsistent_configs_are_refused(tmp_path, mt, changes, msg):
    src = _edit_config(tmp_path, mt, **changes)
    with pytest.raises(ValueError, match="") as e:
        import_model(src, tmp_path / "ckpt")
    assert msg in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("mt", MODELS)
def test_fla_itself_regenerates_the_reference(tmp_path, mt):
    """Rerun fla (Triton interpreter) with scripts/make_fla_fixtures.py into a temporary directory: the same
    weights and logits as the stored fixture, and edgeattn's import equals this fresh reference."""
    pytest.importorskip("fla.models", reason="fla's model classes are in flash-linear-attention")
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parents[1] / "scripts")!r})
        from pathlib import Path
        import make_fla_fixtures
        make_fla_fixtures.make({mt!r}, Path({str(tmp_path)!r}))
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=1200)
    fresh, stored = np.load(tmp_path / mt / "reference.npz"), reference(mt)
    assert np.array_equal(fresh["ids"], stored["ids"])
    assert rel_err(fresh["logits"], stored["logits"]) <= 1e-5
    assert np.array_equal(fresh["greedy"], stored["greedy"])
    import_model(tmp_path / mt, tmp_path / "ckpt")
    art = export_model(tmp_path / "ckpt", tmp_path / "art", prefill_chunk=PREFILL, prefill_logits="all")
    got = run_logits(open_session(art), fresh["ids"][None])
    full = np.concatenate([got["prefill"], got["step"]], axis=1)[0]
    assert rel_err(full, fresh["logits"]) <= 1e-4


def test_sharded_checkpoint_imports_the_same(tmp_path):
    """The fixture's tensors split over two shards with a model.safetensors.index.json."""
    from safetensors.torch import load_file, save_file

    mt = "gated_deltanet"
    src = tmp_path / "sharded"
    src.mkdir()
    shutil.copy(FIXTURES / mt / "config.json", src / "config.json")
    tensors = load_file(str(FIXTURES / mt / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(src / f), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    import_model(src, tmp_path / "ckpt")
    art = export_model(tmp_path / "ckpt", tmp_path / "art", prefill_chunk=PREFILL, prefill_logits="all")
    ref = reference(mt)
    got = run_logits(open_session(art), ref["ids"][None])
    assert rel_err(np.concatenate([got["prefill"], got["step"]], axis=1)[0], ref["logits"]) <= 1e-4
    (src / "model-00002-of-00002.safetensors").unlink()  # a missing shard: one line, nothing written
    with pytest.raises(ValueError, match="model-00002-of-00002.safetensors listed in"):
        import_model(src, tmp_path / "ckpt2")
    assert not (tmp_path / "ckpt2").exists()


def test_cli_export_and_check_of_an_fla_directory(tmp_path):
    from typer.testing import CliRunner

    from edgeattn.cli.main import app

    runner = CliRunner()
    res = runner.invoke(app, ["export", str(FIXTURES / "gla"), "--out", str(tmp_path / "art")])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["check", str(tmp_path / "art"), "--tokens", "40"])
    assert res.exit_code == 0 and "OK" in res.output, res.output
