"""EdgeLM: continuation in pieces equals one call, training reduces the loss, save/load, bad input."""

import pytest
import torch

from edgeattn import MIXERS
from edgeattn.models import EdgeConfig, EdgeLM
from tests.helpers import assert_close

STATEFUL = [m for m in MIXERS if m != "aft_full"]
HYBRID = "gla,softmax,retnet,swa,flash,aft_local"


def tiny(mixer, n_layers=2, **kw):
    kw = {"window": 16, "max_seq_len": 256, **kw}
    return EdgeConfig(
        d_model=32,
        n_layers=n_layers,
        n_heads=2,
        mixer=mixer,
        chunk_size=16,
        feature_dim=16,
        flash_chunk=16,
        flash_qk_dim=16,
        **kw,
    )


@pytest.mark.parametrize("mixer", [*STATEFUL, HYBRID])
def test_pieces_with_state_equal_one_call(mixer):
    n_layers = len(mixer.split(",")) if "," in mixer else 2
    model = EdgeLM(tiny(mixer, n_layers)).eval()
    ids = torch.randint(0, 256, (2, 150))
    with torch.no_grad():
        full, _ = model(ids)
        state, outs, pos = None, [], 0
        for n in (1, 7, 64, 1, 33, 44):
            logits, state = model(ids[:, pos : pos + n], state=state)
            outs.append(logits)
            pos += n
    assert pos == 150
    assert_close(mixer, torch.cat(outs, 1), full, 1e-4)


def _train(model, steps, seq=32, batch=8, lr=3e-3):
    text = b"def add(a, b):\n    return a + b\n\nclass Point:\n    x = 0\n    y = 1\n" * 40
    data = torch.tensor(list(text), dtype=torch.long)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts])
        y = torch.stack([data[s + 1 : s + seq + 1] for s in starts])
        logits, _ = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("mixer", [*MIXERS, HYBRID])
def test_training_reduces_the_loss(mixer):
    n_layers = len(mixer.split(",")) if "," in mixer else 1
    model = EdgeLM(tiny(mixer, n_layers, max_seq_len=32 if mixer == "aft_full" else 256))
    losses = _train(model, 200)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.5 * first, f"{mixer}: loss {first:.3f} -> {last:.3f}"


def test_save_load_roundtrip(tmp_path):
    model = EdgeLM(tiny("gla,retnet")).eval()
    path = model.save(tmp_path / "ckpt")
    loaded = EdgeLM.load(path).eval()
    ids = torch.randint(0, 256, (1, 20))
    assert loaded.cfg == model.cfg
    assert torch.equal(model(ids)[0], loaded(ids)[0])
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_load_refuses_a_corrupt_checkpoint(tmp_path):
    path = EdgeLM(tiny("gla")).save(tmp_path / "ckpt")
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt"):
        EdgeLM.load(path)
    with pytest.raises(ValueError, match="not an edgeattn checkpoint"):
        EdgeLM.load(tmp_path / "missing")


def test_unknown_mixer_is_refused():
    with pytest.raises(ValueError, match="unknown mixer 'gru'"):
        EdgeConfig(mixer="gru")
    with pytest.raises(ValueError, match=r"one per layer"):
        EdgeConfig(mixer=["gla", "retnet"], n_layers=3)


def test_state_of_another_layer_is_refused():
    model = EdgeLM(tiny("gla,linear"))
    ids = torch.randint(0, 256, (1, 4))
    _, state = model(ids)
    with pytest.raises(ValueError, match="state of layer 0"):
        model(ids, state=[state[1], state[0]])
    with pytest.raises(ValueError, match="must have shape"):
        model(ids, state=[{k: v[:, :1] for k, v in state[0].items()}, state[1]])
    with pytest.raises(ValueError, match="list of 2"):
        model(ids, state=state[:1])


def test_bad_input_ids_are_refused():
    model = EdgeLM(tiny("gla"))
    with pytest.raises(ValueError, match=r"input_ids must have shape \[B, T\]"):
        model(torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must lie in \[0, 256\)"):
        model(torch.tensor([[1, 256]]))


@pytest.mark.parametrize("mixer,tie", [(HYBRID, True), ("gated_deltanet,softmax", False)])
def test_from_state_dict_adopts_the_tensors_and_equals_a_loaded_model(mixer, tie):
    """``EdgeLM.from_state_dict`` (what the converters and ``EdgeLM.load`` build with: no randomly initialised
    copy) holds the dict's own tensors, ties the head to the adopted table, keeps buffers that are not in a
    state dict (retnet's ``log_gamma``) and computes what ``load_state_dict`` into a fresh model computes."""
    n_layers = len(mixer.split(","))
    cfg = tiny(mixer, n_layers, tie_embeddings=tie)
    torch.manual_seed(0)
    reference = EdgeLM(cfg).eval()
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    if tie:
        state.pop("lm_head.weight")
    pointers = {k: v.data_ptr() for k, v in state.items()}
    model, missing, unexpected = EdgeLM.from_state_dict(cfg, state)
    assert (missing, unexpected) == ([], [])
    assert not state  # taken over
    params = dict(model.named_parameters(remove_duplicate=False))
    assert all(not p.is_meta for p in params.values())
    for k, ptr in pointers.items():
        assert params[k].data_ptr() == ptr, k
    assert (model.lm_head.weight is model.embed.weight) == tie
    for (name, buf), (_, ref) in zip(model.named_buffers(), reference.named_buffers()):
        assert not buf.is_meta and torch.equal(buf, ref), name
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        assert torch.equal(model.eval()(ids)[0], reference(ids)[0])


def test_from_state_dict_reports_a_missing_parameter():
    cfg = tiny("gla")
    state = EdgeLM(cfg).state_dict()
    state.pop("norm.weight")
    _, missing, unexpected = EdgeLM.from_state_dict(cfg, state)
    assert missing == ["norm.weight"] and unexpected == []


def test_from_state_dict_in_threads_leaves_torch_unpatched():
    """Concurrent callers (a server loading models in threads) each get their model, and
    ``nn.Module.register_parameter`` is torch's own afterwards (interleaved patches would leave one)."""
    from concurrent.futures import ThreadPoolExecutor

    original = torch.nn.Module.register_parameter
    cfg = tiny("gla")
    state = EdgeLM(cfg).state_dict()

    def build(_):
        model, missing, _unexpected = EdgeLM.from_state_dict(cfg, {k: v.clone() for k, v in state.items()})
        return missing, any(p.is_meta for p in model.parameters())

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(build, range(16)))
    assert all(r == ([], False) for r in results)
    assert torch.nn.Module.register_parameter is original
    assert not torch.nn.Linear(2, 2).weight.is_meta
