"""State files (edgeattn.runtimes.state_file): round trip, the safetensors layout, and every refusal."""

from __future__ import annotations

import hashlib
import json
import struct

import numpy as np
import pytest

from edgeattn.runtimes.state_file import check_state, load_state, save_state

FP = "ab" * 32


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "past_key_values.0.recurrent_state": rng.standard_normal((1, 2, 4, 4)).astype(np.float32),
        "past_key_values.0.position": np.array([[7.0]], np.float32),
        "past_key_values.1.normalizer": rng.standard_normal((1, 2, 4)).astype(np.float32),
    }


def _expected() -> dict[str, tuple]:
    return {name: t.shape for name, t in _state().items()}


def test_round_trip(tmp_path):
    path = tmp_path / "s.state"
    save_state(path, _state(), FP, 7)
    tensors, meta = load_state(path, fingerprint=FP, expected=_expected())
    assert list(tensors) == list(_state())  # file order is the order given
    for name, t in _state().items():
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], t)
        assert tensors[name].flags.writeable
    data = b"".join(np.ascontiguousarray(t, "<f4").tobytes() for t in _state().values())
    assert meta == {
        "format": "edgeattn-state",
        "format_version": "2",
        "fingerprint": FP,
        "position": "7",
        "data_sha256": hashlib.sha256(data).hexdigest(),  # of every tensor byte, in file order
    }
    assert [p.name for p in tmp_path.iterdir()] == ["s.state"]  # no temporary file left behind


def test_layout_is_safetensors(tmp_path):
    """8-byte little-endian length, space-padded JSON header, tensors back to back: readable by hand."""
    path = tmp_path / "s.state"
    save_state(path, _state(), FP, 3)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    assert header["__metadata__"]["position"] == "3"
    info = header["past_key_values.0.recurrent_state"]
    assert info["dtype"] == "F32" and info["shape"] == [1, 2, 4, 4]
    begin, end = info["data_offsets"]
    got = np.frombuffer(raw[8 + n + begin : 8 + n + end], "<f4").reshape(1, 2, 4, 4)
    np.testing.assert_array_equal(got, _state()["past_key_values.0.recurrent_state"])


def test_readable_by_safetensors(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy", reason="the safetensors package is optional")
    from safetensors import safe_open

    path = tmp_path / "s.state"
    save_state(path, _state(), FP, 3)
    tensors = safetensors_numpy.load_file(str(path))
    for name, t in _state().items():
        np.testing.assert_array_equal(tensors[name], t)
    with safe_open(str(path), "np") as f:
        assert f.metadata()["fingerprint"] == FP


def test_overwrite_is_atomic_replace(tmp_path):
    path = tmp_path / "s.state"
    save_state(path, _state(0), FP, 1)
    save_state(path, _state(1), FP, 2)
    tensors, meta = load_state(path)
    assert meta["position"] == "2"
    np.testing.assert_array_equal(
        tensors["past_key_values.1.normalizer"], _state(1)["past_key_values.1.normalizer"]
    )


def test_save_refuses_bad_input(tmp_path):
    with pytest.raises(ValueError, match="float32"):
        save_state(tmp_path / "s", {"a": np.zeros(3)}, FP, 0)
    with pytest.raises(ValueError, match="fingerprint"):
        save_state(tmp_path / "s", _state(), "", 0)
    with pytest.raises(ValueError, match="position"):
        save_state(tmp_path / "s", _state(), FP, -1)
    assert list(tmp_path.iterdir()) == []


def _header_file(path, header: dict, data: bytes = b"") -> None:
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


def _meta(**over) -> dict:
    return {
        "format": "edgeattn-state",
        "format_version": "2",
        "fingerprint": FP,
        "position": "0",
        "data_sha256": "0" * 64,
        **over,
    }


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.write_bytes(b"abc"), "shorter than"),
        (lambda p: p.write_bytes(b"\xff" * 64), "header length"),
        (lambda p: p.write_bytes(struct.pack("<Q", 4) + b"{{{{"), "not JSON"),
        (lambda p: _header_file(p, {"x": 1}), "format"),
        (lambda p: _header_file(p, {"__metadata__": {"format": "other"}}), "format"),
        (lambda p: _header_file(p, {"__metadata__": _meta(position="-1")}), "position"),
        (lambda p: _header_file(p, {"__metadata__": _meta(fingerprint="")}), "fingerprint"),
        (lambda p: _header_file(p, {"__metadata__": _meta(format_version="3")}), "format_version 3"),
        (
            lambda p: _header_file(p, {"__metadata__": _meta(format_version="1")}),
            "before state files carried",
        ),
        (lambda p: _header_file(p, {"__metadata__": _meta(data_sha256="")}), "data_sha256"),
        (
            lambda p: _header_file(
                p,
                {"__metadata__": _meta(), "a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 4]}},
                b"\0" * 4,
            ),
            "F32",
        ),
        (
            lambda p: _header_file(
                p,
                {"__metadata__": _meta(), "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
                b"\0" * 8,
            ),
            "data_offsets",
        ),
        (
            lambda p: _header_file(
                p,
                {"__metadata__": _meta(), "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                b"\0" * 8,
            ),
            "after the last tensor",
        ),
    ],
)
def test_load_refuses_corrupt_files(tmp_path, make, message):
    path = tmp_path / "bad.state"
    make(path)
    with pytest.raises(ValueError, match=message) as info:
        load_state(path)
    assert "\n" not in str(info.value)


def test_load_refuses_truncated_file(tmp_path):
    path = tmp_path / "s.state"
    save_state(path, _state(), FP, 0)
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ValueError, match="not an edgeattn state file"):
        load_state(path)


def test_load_refuses_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read state file"):
        load_state(tmp_path / "nope.state")


def test_load_refuses_another_model_and_other_tensors(tmp_path):
    path = tmp_path / "s.state"
    save_state(path, _state(), FP, 0)
    with pytest.raises(ValueError, match="another model"):
        load_state(path, fingerprint="cd" * 32)
    expected = _expected()
    expected["past_key_values.2.recurrent_state"] = (1, 2, 4, 4)
    with pytest.raises(ValueError, match="lacks past_key_values.2.recurrent_state"):
        load_state(path, expected=expected)
    expected = _expected()
    del expected["past_key_values.1.normalizer"]
    with pytest.raises(ValueError, match="unknown past_key_values.1.normalizer"):
        load_state(path, expected=expected)
    expected = _expected()
    expected["past_key_values.0.recurrent_state"] = (1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"shape \[1, 2, 4, 4\]"):
        load_state(path, expected=expected)


def test_check_state_dynamic_dims_match_any_size():
    tensors = {"past_key_values.0.key": np.zeros((1, 2, 5, 4), np.float32)}
    check_state(tensors, {"past_key_values.0.key": (1, 2, "past_length", 4)})
    with pytest.raises(ValueError, match="shape"):
        check_state(tensors, {"past_key_values.0.key": (1, 3, "past_length", 4)})


def test_every_byte_flip_in_the_tensor_data_is_refused(tmp_path):
    path = tmp_path / "s.state"
    save_state(path, _state(), FP, 5)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    data_start = 8 + n
    assert len(raw) - data_start == 4 * sum(t.size for t in _state().values())
    flipped = tmp_path / "flipped.state"
    for i in range(data_start, len(raw)):
        for bit in (0, 7):
            bad = bytearray(raw)
            bad[i] ^= 1 << bit
            flipped.write_bytes(bytes(bad))
            with pytest.raises(ValueError, match="does not match the data_sha256|NaN or inf"):
                load_state(flipped)
    load_state(path)  # the original still loads


def test_non_finite_state_is_refused(tmp_path):
    for value in (np.nan, np.inf, -np.inf):
        state = _state()
        state["past_key_values.1.normalizer"][0, 1, 2] = value
        with pytest.raises(ValueError, match="NaN or inf"):
            save_state(tmp_path / "s.state", state, FP, 0)
        assert not (tmp_path / "s.state").exists()
    # a file with NaN and a correct checksum (written by hand, as another writer could) is refused on load
    state = _state()
    state["past_key_values.0.recurrent_state"][0, 0, 0, 0] = np.nan
    blobs = [np.ascontiguousarray(t, "<f4").tobytes() for t in state.values()]
    header, offset = {"__metadata__": _meta(data_sha256=hashlib.sha256(b"".join(blobs)).hexdigest())}, 0
    for (name, t), blob in zip(state.items(), blobs):
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    _header_file(tmp_path / "nan.state", header, b"".join(blobs))
    with pytest.raises(ValueError, match="past_key_values.0.recurrent_state holds NaN or inf"):
        load_state(tmp_path / "nan.state")
