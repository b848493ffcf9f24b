"""Run an artifact and the PyTorch model it came from side by side, graph by graph."""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from edgeattn._cpu import cpu_record
from edgeattn.export.precision import S8_SATURATES

# Relative logit tolerance (max |diff| / max |logit|) per precision.
DEFAULT_TOLERANCE = {"fp32": 1e-4, "fp16": 3e-2, "int8": 0.3, "int4": 0.3}


def default_text(n_bytes: int) -> bytes:
    """Python source every machine has: the standard library's os module."""
    with open(os.__file__, "rb") as f:
        return f.read(n_bytes)


def bits_per_byte(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean next-token cross entropy in bits; logits [T, V] predict targets [T]."""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(targets)), targets].mean() / math.log(2))


@dataclass
class CheckReport:
    graphs: dict[str, dict] = field(default_factory=dict)  # name -> {max_abs, rel, ops}
    bpb: dict[str, float] = field(default_factory=dict)  # "torch" / "artifact"
    bpb_text: str = ""  # what the bits per byte measured: which text, how many tokens and bytes
    perplexity: dict[str, float] = field(default_factory=dict)  # "torch" / "artifact": exp(mean NLL a token)
    tensorrt: list[str] | None = None
    tolerance: float = 0.0
    # the CPU the artifact ran on (edgeattn._cpu.cpu_record: model, kind, flags)
    cpu: dict = field(default_factory=dict)
    # which GroupQueryAttention kernel the session ran (edgeattn/runtimes/attention.py): {"kernel", "why"}
    attention: dict | None = None
    matmul: dict | None = None  # and which MatMulNBits kernel, the same way
    notes: list[str] = field(default_factory=list)  # what the figures depend on besides the artifact

    @property
    def ok(self) -> bool:
        return all(g["rel"] <= self.tolerance for g in self.graphs.values() if g["tokens"])


def run_logits(sess, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Each graph's logits as the runtimes run it: the prefill graph over full chunks (``prefill``), then the
    step graph token by token (``step``); ``logits``: every position's, [B, T, V] (``positions``: 0..T-1).
    An artifact whose calls return their last token's logits (``prefill_logits`` "last", the default of
    one-graph exports) gives every position's through its ``logits_count`` input. One without that input (an
    older export): ``prefill`` holds each chunk's last position only (from every backend, so that they
    compare), and ``logits`` come from a second pass of the step graph over every token."""
    C = sess.manifest.prefill_tokens
    full = sess.manifest.prefill_logits != "last" or bool(sess.manifest.logits_count)
    T = ids.shape[1]
    n_full = T // C if T > C else 0
    out = {"prefill": [], "step": []}
    every = []  # every position's logits, where the calls returned them
    sess.reset()
    for c in range(n_full):
        logits = sess.run_graph("prefill", ids[:, c * C : (c + 1) * C], every=full)
        out["prefill"].append(logits if full else logits[:, -1:])
        every.append(logits)
    for t in range(n_full * C, T):
        out["step"].append(sess.run_graph("step", ids[:, t : t + 1]))
    every += out["step"]
    if sum(x.shape[1] for x in every) != T:  # a "last" graph's prefill calls: step every token instead
        sess.reset()
        every = [sess.run_graph("step", ids[:, t : t + 1]) for t in range(T)]
    res = {k: np.concatenate(v, axis=1) if v else np.zeros((ids.shape[0], 0, 0)) for k, v in out.items()}
    res["logits"] = np.concatenate(every, axis=1)
    res["positions"] = np.arange(T, dtype=np.int64)
    return res


def _compare(a: np.ndarray, b: np.ndarray, graph_path) -> dict:
    """A graph's logits ``a`` against the PyTorch model's ``b`` ([B, T, V]) and the graph's op counts."""
    import onnx

    diff = float(np.abs(a - b).max()) if a.size else 0.0
    scale = float(np.abs(b).max()) if b.size else 1.0
    graph = onnx.load(str(graph_path), load_external_data=False).graph
    ops = Counter(n.op_type for n in graph.node)
    return {
        "tokens": a.shape[1],
        "max_abs": diff,
        "rel": diff / max(scale, 1e-12),
        "ops": dict(ops),
        "int8_weights": int8_weights(graph),
    }


def int8_weights(graph) -> str | None:
    """The element type of the integer MatMuls' weights, "s8" or "u8" (``export --int8-weights``), or
    "blocks" for 8-bit MatMulNBits (weight-only); None in a graph without any."""
    import onnx

    if any(
        n.op_type == "MatMulNBits" and any(a.name == "bits" and a.i == 8 for a in n.attribute)
        for n in graph.node
    ):
        return "blocks"
    types = {i.name: i.data_type for i in graph.initializer}
    found = {
        types.get(n.input[1])
        for n in graph.node
        if n.op_type in ("MatMulInteger", "DynamicQuantizeMatMul") and len(n.input) > 1
    }
    if onnx.TensorProto.INT8 in found:
        return "s8"
    return "u8" if onnx.TensorProto.UINT8 in found else None


def genai_logits(manifest, ids: np.ndarray, threads: int | None = None) -> np.ndarray:
    """Logits of every position of ``ids [B, T]`` from the artifact's onnxruntime-genai graph
    (``export --genai``'s model.onnx: any number of tokens per call), in one call from the zero state."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if threads:
        so.intra_op_num_threads = threads
    path = manifest.root / manifest.data["genai"]["graph"]
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feeds = {manifest.input_ids_name: ids}
    for i in sess.get_inputs():
        if i.name != manifest.input_ids_name:  # conv_state / recurrent_state, static shapes
            feeds[i.name] = np.zeros(i.shape, np.float32)
    return sess.run([manifest.logits_name], feeds)[0]


def check_artifact(
    artifact,
    tokens: int = 300,
    tolerance: float | None = None,
    text: bytes | None = None,
    threads: int | None = None,
    text_name: str | None = None,
) -> CheckReport:
    """``text`` (named ``text_name`` in the report; default: the start of Python's os.py) is fed as
    ``tokens + 1`` tokens; the report's bits per byte are those of its last ``tokens`` tokens."""
    import onnx

    from edgeattn.export.compat import tensorrt_report
    from edgeattn.runtimes import open_session

    art = open_session(artifact, backend="onnxruntime", threads=threads)
    if art.manifest.checkpoint is None:
        raise ValueError(
            f"{artifact} was exported with --no-checkpoint: check compares it with its PyTorch model and needs "
            "the checkpoint inside the artifact (export again without --no-checkpoint)"
        )
    ref = open_session(artifact, backend="torch", threads=threads)
    m = art.manifest
    if m.max_length is not None:
        tokens = min(tokens, m.max_length)
    tok = art.tokenizer
    if tok.kind == "byte":
        data = (text if text is not None else default_text(tokens + 1))[: tokens + 1]
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
        if m.vocab_size < 256:  # an imported model without its tokenizer: bytes folded into its ids
            ids = ids % m.vocab_size
    else:  # through the artifact's tokenizer; bits per byte of the text those tokens cover
        source = text if text is not None else default_text(8 * (tokens + 1))
        ids = np.asarray(tok.encode(source)[: tokens + 1], dtype=np.int64)
        data = tok.decode(ids[1:].tolist()).encode("utf-8")
    if len(ids) < 2:
        raise ValueError("the check text needs at least 2 tokens")
    ids = ids[None].repeat(m.batch_size, 0)
    inp, targets = ids[:, :-1], ids[0, 1:]
    got, want = run_logits(art, inp), run_logits(ref, inp)
    if tolerance is None:  # the precision's error plus a float16 KV buffer's (against the float32 one)
        from edgeattn.export.precision import KV_TOLERANCE

        kv = {e.dtype for e in m.state if e.shared} or {"float32"}
        tolerance = DEFAULT_TOLERANCE[m.precision] + max(KV_TOLERANCE[d] for d in kv)
    report = CheckReport(tolerance=tolerance)
    for g in ("prefill", "step"):
        report.graphs[g] = _compare(got[g], want[g], m.graph_path(g))
    if m.data.get("genai"):  # export --genai: onnxruntime-genai's graph, the whole text in one call
        report.graphs["genai"] = _compare(
            genai_logits(m, inp, threads), want["logits"], m.root / m.data["genai"]["graph"]
        )
    full_got, full_want = got["logits"][0], want["logits"][0]
    per_byte = (
        len(targets) / max(len(data) - 1, 1) if tok.kind == "byte" else len(targets) / max(len(data), 1)
    )
    report.bpb = {
        "torch": bits_per_byte(full_want, targets[got["positions"]]) * per_byte,
        "artifact": bits_per_byte(full_got, targets[got["positions"]]) * per_byte,
    }
    # per token over the same positions: 2 ** (bits a token)
    report.perplexity = {k: 2 ** (v / per_byte) for k, v in report.bpb.items()}
    n_bytes = round(len(targets) / per_byte)
    name = text_name if text is not None else os.__file__
    report.bpb_text = f"{len(targets)} tokens ({n_bytes} bytes) predicted from the start of {name}" + (
        "" if text is not None else ", not the training text"
    )
    report.cpu = cpu_record()
    report.attention = getattr(art, "attention", None)
    report.matmul = getattr(art, "matmul", None)
    for op, kernel, env, in_graph in (  # a KV buffer: GroupQueryAttention; int4: MatMulNBits
        ("GroupQueryAttention", report.attention, "EDGEATTN_ATTENTION", any(e.shared for e in m.state)),
        ("MatMulNBits", report.matmul, "EDGEATTN_MATMUL", m.precision == "int4"),
    ):
        if kernel and in_graph:
            report.notes.append(
                f"{op} ran on edgeattn's CPU kernel ({env}=onnxruntime runs ONNX Runtime's)"
                if kernel["kernel"] == "edgeattn"
                else f"{op} ran on ONNX Runtime's kernel: {kernel.get('why', '')}"
            )
    if m.prefill_logits == "last" and not m.logits_count:
        report.notes.append(
            "prefill_logits last without a logits_count input (an older export): each prefill call returns its "
            f"last token's logits, so the prefill row compares {report.graphs['prefill']['tokens']} positions (one "
            "a call); the perplexity scores every token, stepped one at a time"
        )
    if report.cpu["kind"] in S8_SATURATES and any(
        g.get("int8_weights") == "s8" for g in report.graphs.values()
    ):
        report.notes.append(
            f"this artifact's int8 weights are signed (--int8-weights s8): on this CPU ({report.cpu['kind']}, no "
            "VNNI) ONNX Runtime multiplies them with 16-bit saturating sums, so its error here is larger than on "
            "a CPU with VNNI or AMX; export with --int8-weights u8 (the default) for the same logits on every CPU"
        )
    if m.target == "portable":
        report.tensorrt = sorted(
            set(tensorrt_report(onnx.load(str(m.graph_path("step")), load_external_data=False)))
            | set(tensorrt_report(onnx.load(str(m.graph_path("prefill")), load_external_data=False)))
        )
    return report
