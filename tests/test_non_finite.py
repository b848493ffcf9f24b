"""Non-finite numbers never reach a sampler or an artifact: a NaN weight is refused at export (and at
import, tests/test_import_validate.py), non-finite logits at run time in every Python path (Session.generate,
`edgeattn run`, Streams, the torch sampler), a NaN state or NaN logits given to Streams.add by name."""

import json

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from edgeattn.cli import export, run
from edgeattn.export import export_model
from edgeattn.runtimes import open_session
from edgeattn.runtimes.sampling import sample_next
from edgeattn.runtimes.streams import Streams
from tests.export_helpers import PREFILL, make_checkpoint

runner = CliRunner()
app = typer.Typer()
for _mod in (export, run):
    _mod.register(app)

NON_FINITE = "hold NaN or infinity: nothing is sampled from them"


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def edit_weights(ckpt, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory):
    """A dynamic-batch artifact whose weights are finite but whose head overflows float32: logits of +-inf
    (and NaN where they meet), as an fp16 overflow or a diverged training run gives."""
    root = tmp_path_factory.mktemp("overflow")
    ckpt = make_checkpoint(root / "ckpt", "gla", tie_embeddings=False)

    def huge_head(t):
        t["lm_head.weight"] = t["lm_head.weight"].sign() * 3e38

    edit_weights(ckpt, huge_head)
    return export_model(ckpt, root / "art", prefill_chunk=PREFILL, dynamic_batch=True)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_the_sampler_refuses_non_finite_logits(value, temperature):
    logits = np.array([0.5, 3.0, value, 2.9])
    with pytest.raises(ValueError, match=NON_FINITE):
        sample_next(logits, temperature=temperature, rng=np.random.default_rng(0))


def test_the_torch_sampler_refuses_nan_logits():
    import torch

    from edgeattn.train import sample_next as torch_sample

    logits = torch.tensor([[0.5, float("nan"), 1.0]])
    for temperature in (0.0, 1.0):
        with pytest.raises(ValueError, match=NON_FINITE):
            torch_sample(logits, temperature=temperature)


def test_export_refuses_a_nan_weight_naming_it(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")

    def nan(t):
        t["blocks.1.mixer.q_proj.weight"][3, 4] = float("nan")

    edit_weights(ckpt, nan)
    res = invoke("export", ckpt, "--out", tmp_path / "art")
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines == [
        f"error: {ckpt / 'model.safetensors'}: weight blocks.1.mixer.q_proj.weight holds non-finite values "
        "(NaN or infinity)"
    ]
    assert not (tmp_path / "art").exists()


def test_session_generate_refuses_non_finite_logits(overflowing):
    sess = open_session(overflowing)
    assert not np.isfinite(sess.prefill(np.array([[1, 2, 3]]))).all()  # the graph's own output
    sess.reset()
    for temperature in (0.0, 0.8):
        with pytest.raises(ValueError, match=NON_FINITE):
            sess.generate("def ", 12, temperature=temperature, seed=0)


def test_run_prints_one_error_line_instead_of_sampling_from_nan(overflowing):
    res = invoke("run", overflowing, "--prompt", "def ", "-n", 12, "--temperature", 0)
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and NON_FINITE in lines[0], res.output


def test_streams_refuse_non_finite_logits_of_the_model(overflowing):
    streams = Streams(overflowing)
    sid = streams.add([1, 2, 3], temperature=0)
    with pytest.raises(ValueError, match=f"stream {sid}'s logits {NON_FINITE}"):
        streams.step()
    assert streams.generated(sid) == []


def test_streams_add_refuses_nan_state_and_nan_logits_by_name(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    art = export_model(ckpt, tmp_path / "art", prefill_chunk=PREFILL, dynamic_batch=True)
    streams = Streams(art)
    sess = open_session(art)
    logits = sess.prefill(np.array([[1, 2, 3]]))[0]
    state = sess.get_state()
    nan_logits = np.full_like(logits, np.nan)
    with pytest.raises(ValueError, match=f"^logits {NON_FINITE}"):
        streams.add(state=state, logits=nan_logits)
    name = next(iter(state))
    bad = {**state, name: np.full_like(state[name], np.nan)}
    with pytest.raises(ValueError, match=rf"^state '{name}' holds NaN or infinity"):
        streams.add(state=bad, logits=logits)
    assert len(streams) == 0
    sid = streams.add(state=state, logits=logits, temperature=0)  # the finite ones still resume
    assert streams.step() == {sid: int(np.argmax(logits))}
    manifest = json.loads((art / "edgeattn.json").read_text())
    assert manifest["dynamic_batch"] is True
