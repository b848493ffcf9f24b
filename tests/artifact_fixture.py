"""A synthetic exported artifact, its numpy reference, and a plain onnxruntime driver of any artifact.

``build_artifact(dir)`` writes an artifact that follows docs/artifact-format.md to the letter, built with
``onnx.helper`` (no torch, no exporter): byte vocabulary, batch 1, three state tensors

    past_key_values.0.position         [1, 1]        tokens consumed (float32, like every state tensor)
    past_key_values.{0,1}.recurrent_state  [1, H, K, V]  a decayed sum of outer products

``step.onnx`` runs one token; ``prefill.onnx`` runs ``prefill_tokens`` tokens as an explicit unrolled sequence
of the same step math. The logits depend on every state tensor, so a runtime that drops, copies wrongly or
fails to swap state produces other tokens. ``reference_step`` is the same step in numpy.

``OrtDriver(dir)`` runs any artifact from its manifest alone with onnxruntime's Python API (prefill in
chunks of ``graphs.prefill.tokens``, step for the rest, zeros as the initial state, dynamic state dims
starting at 0): the reference the C++ runtime is compared with, and reusable on a real exported artifact.

``build_generate()`` builds the C++ example once per pytest session (tests/test_cpp.py and
tests/test_cpp_real.py share it) and ``run_generate(binary, dir, prompt, *args)`` runs it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from edgeattn.runtimes.state_file import load_state, save_state

D_MODEL = 8
N_HEADS = 2
HEAD_K = 4
HEAD_V = 4
N_LAYERS = 2
DECAYS = (0.9, 0.6)  # per head; < 1 keeps the state bounded over thousands of tokens


# ----------------------------------------------------------------------------------------------------------
# weights and the numpy reference
# ----------------------------------------------------------------------------------------------------------


def make_weights(seed: int = 0, vocab_size: int = 256) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    f32 = np.float32
    w = {
        "embed": rng.standard_normal((vocab_size, D_MODEL)).astype(f32),  # [vocab, D]
        "freqs": rng.uniform(0.05, 1.0, (1, D_MODEL)).astype(f32),  # [1, D] position feature
        "w_out": (rng.standard_normal((D_MODEL, vocab_size)) * 0.7).astype(f32),  # [D, vocab]
    }
    for layer in range(N_LAYERS):
        w[f"wq{layer}"] = (rng.standard_normal((D_MODEL, N_HEADS * HEAD_K)) * 0.5).astype(f32)
        w[f"wk{layer}"] = rng.standard_normal((D_MODEL, N_HEADS * HEAD_K)).astype(f32)
        w[f"wv{layer}"] = rng.standard_normal((D_MODEL, N_HEADS * HEAD_V)).astype(f32)
        w[f"decay{layer}"] = np.array(DECAYS, dtype=f32).reshape(1, N_HEADS, 1, 1)
    return w


def state_entries() -> list[dict]:
    """The manifest's ``state`` list, in order."""
    entries = [_entry(0, "position", [1, 1])]
    for layer in range(N_LAYERS):
        entries.append(_entry(layer, "recurrent_state", [1, N_HEADS, HEAD_K, HEAD_V]))
    return entries


def _entry(layer: int, name: str, shape: list) -> dict:
    return {
        "input": f"past_key_values.{layer}.{name}",
        "output": f"present.{layer}.{name}",
        "layer": layer,
        "name": name,
        "shape": shape,
        "dtype": "float32",
    }


def zero_state() -> dict[str, np.ndarray]:
    return {e["input"]: np.zeros(e["shape"], np.float32) for e in state_entries()}


def reference_step(w: dict[str, np.ndarray], token: int, state: dict[str, np.ndarray]):
    """One token in numpy: ``(logits [vocab], new_state)``; ``state`` (by input name) is not modified."""
    new = {}
    pos = state["past_key_values.0.position"] + 1  # [1, 1]
    new["past_key_values.0.position"] = pos
    h = w["embed"][token][None, :] + np.sin(pos * w["freqs"])  # [1, D]
    for layer in range(N_LAYERS):
        k = np.tanh(h @ w[f"wk{layer}"]).reshape(1, N_HEADS, HEAD_K, 1)
        v = np.tanh(h @ w[f"wv{layer}"]).reshape(1, N_HEADS, 1, HEAD_V)
        s = state[f"past_key_values.{layer}.recurrent_state"] * w[f"decay{layer}"] + k * v  # [1, H, K, V]
        new[f"past_key_values.{layer}.recurrent_state"] = s
        q = (h @ w[f"wq{layer}"]).reshape(1, N_HEADS, 1, HEAD_K)
        h = h + (q @ s).reshape(1, N_HEADS * HEAD_V)  # [1, H, 1, V] -> [1, D]
    return (h @ w["w_out"])[0], new


# ----------------------------------------------------------------------------------------------------------
# ONNX graphs and the artifact
# ----------------------------------------------------------------------------------------------------------


def _graph(w: dict[str, np.ndarray], tokens: int, opset: int):
    """input_ids [1, tokens] + state -> logits [1, tokens, vocab] + state: ``tokens`` unrolled steps."""
    from onnx import TensorProto, helper, numpy_helper

    vocab = w["embed"].shape[0]
    nodes = []
    inits = [numpy_helper.from_array(a, name) for name, a in w.items()]
    consts = {
        "one": np.ones((1, 1), np.float32),
        "shape_k": np.array([1, N_HEADS, HEAD_K, 1], np.int64),
        "shape_v": np.array([1, N_HEADS, 1, HEAD_V], np.int64),
        "shape_q": np.array([1, N_HEADS, 1, HEAD_K], np.int64),
        "shape_o": np.array([1, N_HEADS * HEAD_V], np.int64),
        "axis1": np.array([1], np.int64),
    }
    consts.update({f"t{t}": np.array(t, np.int64) for t in range(tokens)})
    inits += [numpy_helper.from_array(a, name) for name, a in consts.items()]

    def node(op, inputs, output, **attrs):
        nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output

    entries = state_entries()
    cur = {e["input"]: e["input"] for e in entries}
    step_logits = []
    for t in range(tokens):
        p = f"t{t}_"
        ids = node("Gather", ["input_ids", f"t{t}"], p + "ids", axis=1)  # [1]
        e = node("Gather", ["embed", ids], p + "e", axis=0)  # [1, D]
        pos = node("Add", [cur["past_key_values.0.position"], "one"], p + "pos")  # [1, 1]
        ang = node("Sin", [node("Mul", [pos, "freqs"], p + "angle")], p + "sin")
        h = node("Add", [e, ang], p + "h0")
        nxt = {"past_key_values.0.position": pos}
        for layer in range(N_LAYERS):
            q = f"{p}l{layer}_"
            k = node("Tanh", [node("MatMul", [h, f"wk{layer}"], q + "kx")], q + "k")
            v = node("Tanh", [node("MatMul", [h, f"wv{layer}"], q + "vx")], q + "v")
            kv = node(
                "Mul",
                [node("Reshape", [k, "shape_k"], q + "k4"), node("Reshape", [v, "shape_v"], q + "v4")],
                q + "kv",
            )
            name = f"past_key_values.{layer}.recurrent_state"
            s = node("Add", [node("Mul", [cur[name], f"decay{layer}"], q + "decayed"), kv], q + "s")
            nxt[name] = s
            qh = node("Reshape", [node("MatMul", [h, f"wq{layer}"], q + "qx"), "shape_q"], q + "q4")
            o = node("Reshape", [node("MatMul", [qh, s], q + "o4"), "shape_o"], q + "o")
            h = node("Add", [h, o], q + "h")
        logits = node("MatMul", [h, "w_out"], p + "logits")  # [1, vocab]
        step_logits.append(node("Unsqueeze", [logits, "axis1"], p + "logits3"))  # [1, 1, vocab]
        cur = nxt
    if tokens == 1:
        node("Identity", step_logits, "logits")
    else:
        node("Concat", step_logits, "logits", axis=1)
    for en in entries:
        node("Identity", [cur[en["input"]]], en["output"])

    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, tokens])]
    inputs += [helper.make_tensor_value_info(en["input"], TensorProto.FLOAT, en["shape"]) for en in entries]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, tokens, vocab])]
    outputs += [helper.make_tensor_value_info(en["output"], TensorProto.FLOAT, en["shape"]) for en in entries]
    graph = helper.make_graph(nodes, f"synthetic_{tokens}", inputs, outputs, inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="edgeattn-tests"
    )
    model.ir_version = 8  # readable by onnxruntime >= 1.14
    return model


def build_artifact(
    root: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 256,
    prefill_tokens: int = 4,
    format_version: int = 1,
    opset: int = 17,
    nan_token: int | None = None,
) -> Path:
    """Write the synthetic artifact to ``root`` (created) and return it. ``nan_token``: that token's embedding
    is NaN (a model whose logits turn NaN once it reads the token)."""
    import onnx

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    w = make_weights(seed, vocab_size)
    if nan_token is not None:
        w["embed"][nan_token] = np.nan
    onnx.save(_graph(w, 1, opset), root / "step.onnx")
    onnx.save(_graph(w, prefill_tokens, opset), root / "prefill.onnx")
    model = {"synthetic": True, "d_model": D_MODEL, "n_layers": N_LAYERS, "n_heads": N_HEADS, "seed": seed}
    fp = hashlib.sha256(json.dumps(model, sort_keys=True).encode())
    for name in sorted(w):
        fp.update(name.encode() + w[name].tobytes())
    files = {}
    for name in ("step.onnx", "prefill.onnx"):
        data = (root / name).read_bytes()
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    manifest = {
        "format": "edgeattn",
        "format_version": format_version,
        "fingerprint": fp.hexdigest(),
        "model": model,
        "vocab_size": vocab_size,
        "batch_size": 1,
        "target": "portable",
        "precision": "fp32",
        "opset": opset,
        "requires": {"onnxruntime": "1.14.0"},
        "max_length": None,
        "inputs": {"input_ids": "input_ids"},
        "outputs": {"logits": "logits"},
        "graphs": {
            "step": {"path": "step.onnx", "tokens": 1},
            "prefill": {"path": "prefill.onnx", "tokens": prefill_tokens},
        },
        "state": state_entries(),
        "files": files,
    }
    (root / "edgeattn.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return root


# ----------------------------------------------------------------------------------------------------------
# a plain onnxruntime driver of any artifact's manifest
# ----------------------------------------------------------------------------------------------------------


class OrtDriver:
    """Runs an artifact from ``edgeattn.json`` alone with ``onnxruntime.InferenceSession`` (batch 1)."""

    def __init__(self, root: str | Path, threads: int = 1):
        import onnxruntime as ort

        self.root = Path(root)
        self.manifest = json.loads((self.root / "edgeattn.json").read_text())
        m = self.manifest
        self.fingerprint = m["fingerprint"]
        self.vocab_size = int(m["vocab_size"])
        self.entries = m["state"]
        self.ids_name = m.get("inputs", {}).get("input_ids", "input_ids")
        self.logits_name = m.get("outputs", {}).get("logits", "logits")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1

        def load(graph: str):
            return ort.InferenceSession(
                str(self.root / m["graphs"][graph]["path"]), opts, providers=["CPUExecutionProvider"]
            )

        self.step_sess = load("step")
        self.prefill_sess = load("prefill") if "prefill" in m["graphs"] else None
        self.chunk = int(m["graphs"]["prefill"]["tokens"]) if self.prefill_sess else 0
        self.reset()

    def reset(self) -> None:
        self.state = {
            e["input"]: np.zeros([0 if isinstance(d, str) else d for d in e["shape"]], np.float32)
            for e in self.entries
        }
        self.position = 0

    def _run(self, sess, ids: list[int]) -> np.ndarray:
        feeds = {self.ids_name: np.array([ids], np.int64), **self.state}
        names = [self.logits_name] + [e["output"] for e in self.entries]
        out = sess.run(names, feeds)
        self.state = {e["input"]: o for e, o in zip(self.entries, out[1:])}
        self.position += len(ids)
        return out[0][0, -1]  # [vocab] logits of the last token

    def prefill(self, ids: list[int]) -> np.ndarray:
        """Chunks of the prefill graph, then single steps; the logits of the last token."""
        assert len(ids) > 0
        i = 0
        logits = None
        while self.chunk and len(ids) - i >= self.chunk:
            logits = self._run(self.prefill_sess, list(ids[i : i + self.chunk]))
            i += self.chunk
        for t in ids[i:]:
            logits = self._run(self.step_sess, [t])
        return logits

    def step(self, token: int) -> np.ndarray:
        return self._run(self.step_sess, [int(token)])

    def greedy(self, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
        """Prefill ``prompt``, then take the argmax ``n`` times feeding each token back (as the C++ example
        does: every generated token is consumed). Returns the tokens and the logits each was chosen from."""
        logits = self.prefill(prompt)
        tokens, rows = [], []
        for _ in range(n):
            rows.append(logits)
            tokens.append(int(np.argmax(logits)))
            logits = self.step(tokens[-1])
        return tokens, np.stack(rows)

    def save_state(self, path: str | Path) -> None:
        save_state(path, self.state, self.fingerprint, self.position)

    def load_state(self, path: str | Path) -> None:
        expected = {e["input"]: tuple(e["shape"]) for e in self.entries}
        tensors, meta = load_state(path, fingerprint=self.fingerprint, expected=expected)
        self.state = {e["input"]: tensors[e["input"]] for e in self.entries}
        self.position = int(meta["position"])


# ----------------------------------------------------------------------------------------------------------
# the C++ example: built once per pytest session, run as a subprocess
# ----------------------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
CPP_BUILD = REPO / "build" / "cpp-tests"
_BUILD_OUTCOME: list[tuple[str, object]] = []  # ("ok", binary) | ("skip", reason) | ("fail", message), once


def _build() -> tuple[str, object]:
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        return "skip", f"the C++ runtime needs {' and '.join(missing)}, not found on PATH"
    configure = ["cmake", "-S", "edgeattn/runtimes/cpp", "-B", str(CPP_BUILD)]
    steps = [
        (["bash", "scripts/fetch_onnxruntime_headers.sh"], "fetching the ONNX Runtime headers"),
        ([*configure, f"-DEDGEATTN_PYTHON={sys.executable}"], "cmake configure"),
        (["cmake", "--build", str(CPP_BUILD), "-j2"], "cmake build"),
    ]
    for cmd, what in steps:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            return "fail", f"{what} failed ({' '.join(cmd)}):\n{(proc.stdout + proc.stderr)[-4000:]}"
    return "ok", CPP_BUILD / "generate"


def build_generate() -> Path:
    """The built example binary: headers fetched, configured and built in build/cpp-tests on the first call
    of the session, the same outcome after that. Skips without cmake or a C++ compiler; fails with the
    failing step's output."""
    import pytest

    if not _BUILD_OUTCOME:
        import fcntl

        # pytest-xdist's workers share build/cpp-tests: one builds while the others wait, then find it built
        CPP_BUILD.parent.mkdir(exist_ok=True)
        with open(CPP_BUILD.parent / ".cpp-tests.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            _BUILD_OUTCOME.append(_build())
    kind, value = _BUILD_OUTCOME[0]
    if kind == "skip":
        pytest.skip(str(value))
    if kind == "fail":
        pytest.fail(str(value), pytrace=False)
    return Path(value)


class Result:
    """One run of the example: ``tokens`` (the generated bytes), ``stderr``, ``report`` (its JSON line)."""

    def __init__(self, proc: subprocess.CompletedProcess, prompt: bytes):
        self.proc = proc
        self.returncode = proc.returncode
        self.stderr = proc.stderr.decode(errors="replace")
        out = proc.stdout
        self.tokens = list(out[len(prompt) : -1]) if proc.returncode == 0 else None
        lines = [ln for ln in self.stderr.splitlines() if ln.startswith("{")]
        self.report = json.loads(lines[-1]) if lines else None


def run_generate(binary: Path, artifact_dir, prompt: bytes, *args, check: bool = True, threads: int = 1):
    """Run ``generate DIR --prompt PROMPT --threads THREADS ARGS...``; with ``check`` it must succeed."""
    cmd = [str(binary), str(artifact_dir), "--prompt", prompt, "--threads", str(threads), *map(str, args)]
    res = Result(subprocess.run(cmd, capture_output=True, timeout=120), prompt)
    if check:
        assert res.returncode == 0, res.stderr
        assert res.proc.stdout.startswith(prompt)
    return res


def greedy_logits(sess, prompt_ids, n: int) -> tuple[list[int], np.ndarray]:
    """The loop of ``generate_ids(prompt, n, temperature=0)`` and of the C++ example, keeping the logits each
    token was drawn from: prefill ``prompt_ids`` (a sequence of ids), then argmax and step ``n`` times (every
    generated token is consumed)."""
    logits = sess.prefill(np.asarray(prompt_ids, np.int64)[None])
    tokens, rows = [], []
    for _ in range(n):
        rows.append(logits[0])
        tokens.append(int(np.argmax(logits[0])))
        logits = sess.step(np.array([[tokens[-1]]], np.int64))
    return tokens, np.stack(rows)
