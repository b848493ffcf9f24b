"""Streams: N streams stepped together at batch N equal N separate batch-1 sessions (logits, tokens, sampling,
state files), with streams added, stopped and dropped at different times; bad input refused."""

import numpy as np
import pytest

from edgeattn.export import export_model
from edgeattn.runtimes import open_session
from edgeattn.runtimes.streams import Streams
from tests.export_helpers import PREFILL, make_checkpoint, text_ids

TOL = 1e-5


class _Artifacts(dict):
    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, key):
        mixer, target, *kv = key  # (mixer, target) or (mixer, target, KV buffer dtype)
        if kv == ["float32"]:  # the default
            self[key] = self[mixer, target]
            return self[key]
        ckpt = self.root / f"ckpt_{mixer.replace(',', '_')}"
        if not ckpt.exists():
            make_checkpoint(ckpt, mixer)
        self[key] = export_model(
            ckpt,
            self.root / "_".join([mixer.replace(",", "_"), target, *kv]),
            target=target,
            prefill_chunk=PREFILL,
            dynamic_batch=True,
            kv_dtype=kv[0] if kv else "float32",
        )
        return self[key]


@pytest.fixture(scope="module")
def arts(tmp_path_factory):
    return _Artifacts(tmp_path_factory.mktemp("streams"))


def _prompt(n, seed):
    return text_ids(n, seed)[0]


class _Reference:
    """One stream decoded alone in its own batch-1 session (greedy)."""

    def __init__(self, art, prompt):
        self.sess = open_session(art)
        self.logits = self.sess.prefill(prompt[None])[0]

    def step(self):
        tok = int(np.argmax(self.logits))
        self.logits = self.sess.step(np.array([[tok]]))[0]
        return tok


@pytest.mark.parametrize(
    ("mixer", "target"),
    [
        ("gla", "onnxruntime"),
        ("retnet", "onnxruntime"),
        ("gated_deltanet", "onnxruntime"),
        ("mamba2", "onnxruntime"),
        ("flash", "onnxruntime"),
        ("swa", "portable"),
        ("gated_deltanet,softmax", "onnxruntime"),  # a GroupQueryAttention KV buffer: a position per row
    ],
)
def test_streams_equal_separate_sessions_as_streams_come_and_go(arts, mixer, target):
    art = arts[mixer, target]
    streams = Streams(art)
    refs, worst = {}, 0.0
    prompts = {0: _prompt(PREFILL + 4, 1), 1: _prompt(5, 2), 2: _prompt(PREFILL + 1, 3), 3: _prompt(3, 4)}
    schedule = [("add", 0), 3, ("add", 1), 2, ("add", 2), 2, ("drop", 1), ("add", 3), 3, ("drop", 0), 2]
    ids = {}
    for action in schedule:
        if isinstance(action, int):
            for _ in range(action):
                got = streams.step()
                assert sorted(got) == sorted(ids[k] for k in refs)  # every live stream, one token each
                for k, ref in refs.items():
                    assert got[ids[k]] == ref.step()
                    worst = max(worst, float(np.abs(streams.logits(ids[k]) - ref.logits).max()))
            continue
        op, k = action
        if op == "add":
            ids[k] = streams.add(prompts[k], temperature=0)
            refs[k] = _Reference(art, prompts[k])
            worst = max(worst, float(np.abs(streams.logits(ids[k]) - refs[k].logits).max()))
        else:
            streams.drop(ids[k])
            del refs[k]
        assert sorted(streams.live) == sorted(ids[k] for k in refs)
    assert worst <= TOL, worst
    for k, ref in refs.items():  # the state held in the batch rows equals the lone session's
        want = ref.sess.get_state()
        got = streams.get_state(ids[k])
        for name, w in want.items():
            np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=TOL)  # state values reach ~20


@pytest.mark.parametrize(
    ("mixer", "kv"),
    [("gla", "float32"), ("gated_deltanet,softmax", "float32"), ("gated_deltanet,softmax", "int8")],
)
def test_prefill_many_equals_separate_sessions(arts, mixer, kv):
    # pieces of one length at batch 3, each against its own batch-1 session; the GLA's first row resumes
    # from a state, while a KV buffer batches new prompts only, whose piece fits one prefill call
    art = arts[mixer, "onnxruntime", kv]
    kv = "softmax" in mixer
    s = Streams(art, max_streams=4)
    n = PREFILL if kv else 2 * PREFILL + 5
    heads = [None if kv else _prompt(7, 40), None, None]
    pieces = [_prompt(n, 41 + i) for i in range(3)]
    starts = [(None, 0) if h is None else s.prefill(h)[::2] for h in heads]  # (state, position)
    out = s.prefill_many([(p, st, pos) for p, (st, pos) in zip(pieces, starts)])
    for head, piece, (state, logits, pos) in zip(heads, pieces, out):
        ref = open_session(art)
        if head is not None:
            ref.prefill(head[None])
        want = ref.prefill(piece[None])[0]
        assert pos == n + (0 if head is None else len(head))
        np.testing.assert_allclose(logits, want, atol=TOL)
        _assert_state_close(state, ref.get_state(), s.manifest)


def test_per_stream_sampling_equals_the_single_session_sampler(arts):
    art = arts["gla", "onnxruntime"]
    params = [
        dict(temperature=0.9, top_k=20, seed=7),
        dict(temperature=1.3, top_p=0.8, seed=11),
        dict(temperature=0.7, seed=7),
        dict(temperature=0.0),
    ]
    streams = Streams(art)
    prompts = [_prompt(6 + 3 * i, 20 + i) for i in range(len(params))]
    sids = [streams.add(p, max_new_tokens=12, stop_ids=[], **kw) for p, kw in zip(prompts, params)]
    while streams.live:
        streams.step()
    for sid, p, kw in zip(sids, prompts, params):
        want = list(open_session(art).generate_ids(p, 12, stop_ids=[], **kw))
        assert streams.generated(sid) == want
        assert streams.done(sid)


def test_stopped_stream_state_with_a_kv_buffer_equals_the_lone_session(arts):
    # a stopped stream's state (parked; of a KV buffer the filled slots copied, the rest zeros) against a
    # batch-1 session that consumed the same tokens; each get_state is a copy of its own
    art = arts["gated_deltanet,softmax", "onnxruntime"]
    prompt = _prompt(7, 8)
    ref = _Reference(art, prompt)
    streams = Streams(art)
    sid = streams.add(prompt, temperature=0, max_new_tokens=3, stop_ids=[])
    streams.add(_prompt(5, 9), temperature=0)
    while sid in streams.live:
        streams.step()
    assert streams.generated(sid) == [ref.step() for _ in range(3)]
    got, want = streams.get_state(sid), ref.sess.get_state()
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=1e-5, atol=TOL)
    for a in got.values():
        a[...] = 1
    for name, w in want.items():
        np.testing.assert_allclose(streams.get_state(sid)[name], w, rtol=1e-5, atol=TOL)


def test_stop_token_ends_one_stream_and_its_state_continues_elsewhere(arts, tmp_path):
    art = arts["mamba2", "onnxruntime"]
    prompt = _prompt(9, 5)
    ref = _Reference(art, prompt)
    greedy = [ref.step() for _ in range(4)]  # ref has now consumed all four
    streams = Streams(art)
    other = streams.add(_prompt(4, 6), temperature=0)
    sid = streams.add(prompt, temperature=0, stop_ids=[greedy[3]])
    for _ in range(6):
        streams.step()
    if greedy[3] in greedy[:3]:
        pytest.skip("the stop token came earlier in the greedy run")
    assert streams.generated(sid) == greedy[:3] and streams.done(sid)
    assert streams.live == [other] and len(streams.generated(other)) == 6
    state = streams.get_state(sid)
    for name, w in ref.sess.get_state().items():
        np.testing.assert_allclose(state[name], w, rtol=1e-5, atol=TOL)
    # saved, then resumed in a plain session and as a new stream: both continue like the reference
    streams.save_state(sid, tmp_path / "s.safetensors")
    sess = open_session(art)
    sess.load_state(tmp_path / "s.safetensors")
    assert sess.position == len(prompt) + 4
    resumed = streams.add(state=tmp_path / "s.safetensors", logits=ref.logits, temperature=0)
    got = streams.step()
    want = ref.step()
    assert got[resumed] == want
    np.testing.assert_allclose(sess.step(np.array([[want]]))[0], ref.logits, rtol=0, atol=TOL)
    np.testing.assert_allclose(streams.logits(resumed), ref.logits, rtol=0, atol=TOL)


def test_bad_input_is_refused(arts, tmp_path):
    art = arts["gla", "onnxruntime"]
    streams = Streams(art, max_streams=2)
    with pytest.raises(ValueError, match="prompt_ids must be a 1-D"):
        streams.add([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        streams.add([])
    with pytest.raises(ValueError, match="token ids must lie in"):
        streams.add([1, 999])
    with pytest.raises(ValueError, match="temperature"):
        streams.add([1, 2], temperature=float("nan"))
    with pytest.raises(ValueError, match="next-token logits"):
        streams.add(state=open_session(art).get_state())
    with pytest.raises(ValueError, match="logits only without prompt_ids"):
        streams.add([1, 2], state=open_session(art).get_state(), logits=np.zeros(256))
    with pytest.raises(ValueError, match="logits must have shape"):
        streams.add(state=open_session(art).get_state(), logits=np.zeros(3))
    with pytest.raises(ValueError, match="no stream with id 5"):
        streams.drop(5)
    streams.add([1, 2])
    streams.add([3])
    with pytest.raises(ValueError, match="max_streams is 2"):
        streams.add([4])
    assert len(streams.step()) == 2
    ckpt = tmp_path / "ckpt"
    make_checkpoint(ckpt, "gla")
    fixed = export_model(ckpt, tmp_path / "fixed", prefill_chunk=PREFILL)
    with pytest.raises(ValueError, match="--dynamic-batch"):
        Streams(fixed)
    make_checkpoint(tmp_path / "ckpt_sm", "softmax")
    grow = export_model(tmp_path / "ckpt_sm", tmp_path / "sm", target="portable", dynamic_batch=True)
    with pytest.raises(
        ValueError, match=r"every layer holds a KV cache \(softmax; layers 0, 1\).*grows with every token"
    ):
        Streams(grow)
    # a hybrid (as Qwen3.5: linear-attention layers and full-attention ones) is named as such, not a "baseline"
    make_checkpoint(tmp_path / "ckpt_hy", "gla,softmax,gla")
    hybrid = export_model(tmp_path / "ckpt_hy", tmp_path / "hy", target="portable", dynamic_batch=True)
    with pytest.raises(ValueError, match=r"1 of its 3 layers hold a KV cache \(softmax; layers 1\)") as e:
        Streams(hybrid)
    assert "baseline" not in str(e.value)


def _assert_state_close(got, want, manifest):
    """Two batch-1 float32 states: equal within float rounding (an int8 KV slot within one step of its scale,
    where a rounding went the other way)."""
    for e in manifest.state:
        assert got[e.input].dtype == np.float32 and got[e.input].shape == want[e.input].shape
        step = 0 if e.scale is None else np.asarray(e.scale, np.float32)[None, :, None, :] * (1 + 1e-5)
        assert np.all(np.abs(got[e.input] - want[e.input]) <= step + TOL + 1e-5 * np.abs(want[e.input])), (
            e.input
        )


@pytest.mark.parametrize("kv", ["int8", "float16"])
def test_reduced_kv_buffers_equal_the_lone_session(arts, kv, tmp_path):
    """A KV buffer of int8 (ONNX Runtime's quantized cache) or float16 held in the batch rows in its own dtype:
    greedy streams give the tokens of ``Session.generate_ids`` per prompt on the same artifact (the same graph
    and quantized cache at batch 1), a stream's state equals the session's after the same tokens, and a stream
    resumed from a saved state (or a state dict) continues as the session does."""
    art = arts["gated_deltanet,softmax", "onnxruntime", kv]
    streams = Streams(art)
    m = streams.manifest
    kv_entries = [e for e in m.state if e.shared]
    assert kv_entries and {e.dtype for e in kv_entries} == {kv}
    # the buffers are the graph's dtype: a quarter (int8) or a half (float16) of the float32 buffers' bytes
    wide = Streams(arts["gated_deltanet,softmax", "onnxruntime"])
    for e, a, b in zip(m.state, streams._bufs[0], wide._bufs[0]):
        assert a.dtype == np.dtype(e.dtype) and a.shape == b.shape
        assert a.nbytes * (4 if e.dtype == "int8" else 2 if e.dtype == "float16" else 1) == b.nbytes
    saved = sum(a.nbytes - b.nbytes for a, b in zip(wide._bufs[0], streams._bufs[0]))  # capacity 1: one row
    assert saved > 0 and wide.state_bytes_per_stream - streams.state_bytes_per_stream == saved

    n, more = 9, 6
    prompts = [_prompt(PREFILL + 3, 60), _prompt(5, 61), _prompt(2 * PREFILL, 62), _prompt(1, 63)]
    want = [list(open_session(art).generate_ids(p, n + more, temperature=0, stop_ids=[])) for p in prompts]
    sids = [streams.add(p, temperature=0, max_new_tokens=n, stop_ids=[]) for p in prompts[:2]]
    for _ in range(3):
        streams.step()
    sids += [streams.add(p, temperature=0, max_new_tokens=n, stop_ids=[]) for p in prompts[2:]]
    streams.step()
    # a live stream's state (from the batch rows) against a session that consumed the same tokens
    ref = open_session(art)
    ref.prefill(prompts[0][None])
    for t in streams.generated(sids[0]):
        ref.step(np.array([[t]]))
    assert sids[0] in streams.live and streams.position(sids[0]) == ref.position
    _assert_state_close(streams.get_state(sids[0]), ref.get_state(), m)
    while streams.live:
        streams.step()
    for sid, w in zip(sids, want):
        assert streams.generated(sid) == w[:n]
    # a stopped stream's state (parked in the graph's dtype) against the session's after prompt + n tokens
    ref = open_session(art)
    ref.prefill(prompts[2][None])
    for t in want[2][:n]:
        ref.step(np.array([[t]]))
    _assert_state_close(streams.get_state(sids[2]), ref.get_state(), m)
    # resumed from a state file and from a state dict: the next tokens of the uninterrupted session's run
    path = tmp_path / f"{kv}.state"
    streams.save_state(sids[2], path)
    logits = streams.logits(sids[2])
    from_file = streams.add(state=path, logits=logits, temperature=0, max_new_tokens=more, stop_ids=[])
    given = streams.get_state(sids[0])
    from_dict = streams.add(
        state=given,
        logits=streams.logits(sids[0]),
        position=streams.position(sids[0]),
        temperature=0,
        max_new_tokens=more,
        stop_ids=[],
    )
    _assert_state_close(streams.get_state(from_dict), given, m)  # float32 -> the row's dtype -> float32
    _assert_state_close(streams.get_state(from_file), ref.get_state(), m)
    while streams.live:
        streams.step()
    assert streams.generated(from_file) == want[2][n:]
    assert streams.generated(from_dict) == want[0][n:]
    ref = open_session(art)  # the logits after every token, against the session's
    ref.prefill(prompts[0][None])
    for t in want[0]:
        logits = ref.step(np.array([[t]]))[0]
    np.testing.assert_allclose(streams.logits(from_dict), logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kv", ["float32", "int8"])
def test_nan_in_a_states_filled_slots_is_refused_past_them_accepted(arts, kv, tmp_path):
    """``add(state=...)`` checks the KV buffers' filled slots only (below the state's position): NaN or
    infinity there is refused, as in any other state tensor; NaN or garbage past them (never read) is
    accepted, and the stream continues exactly as from the clean state."""
    import re

    art = arts["gated_deltanet,softmax", "onnxruntime", kv]
    streams = Streams(art)
    state, logits, pos = streams.prefill(_prompt(PREFILL + 3, 70))
    key, value = (e.input for e in streams.manifest.state if e.shared)
    recurrent = next(e.input for e in streams.manifest.state if e.name == "recurrent_state")
    position = next(e.input for e in streams.manifest.state if e.name == "position")
    for name, where, bad in [
        (key, (0, 1, pos - 1, 3), np.nan),  # the last filled slot
        (value, (0, 0, 0, 0), np.inf),
        (recurrent, (0, 1, 2, 3), np.nan),
        (position, (0,), np.nan),
    ]:
        poisoned = {k: v.copy() for k, v in state.items()}
        poisoned[name][where] = bad
        with pytest.raises(ValueError, match=rf"state {re.escape(repr(name))} holds NaN or infinity"):
            streams.add(state=poisoned, logits=logits, position=pos)
    assert not streams.live
    junk = {k: v.copy() for k, v in state.items()}
    junk[key][:, :, pos:] = np.nan
    junk[value][:, :, pos:] = 1e30
    kw = dict(logits=logits, position=pos, temperature=0, max_new_tokens=5, stop_ids=[])
    clean, dirty = streams.add(state=state, **kw), streams.add(state=junk, **kw)
    while streams.live:
        streams.step()
    assert streams.generated(dirty) == streams.generated(clean)
    got, want = streams.get_state(dirty), streams.get_state(clean)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name])
    streams.save_state(dirty, tmp_path / "dirty.state")  # finite: a state file takes it
