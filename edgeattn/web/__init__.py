"""`edgeattn web ARTIFACT --out SITE`: a static site that runs an exported artifact in the browser with
onnxruntime-web (WASM; WebGPU where the browser has an adapter), keeping the state in JavaScript.

    SITE/index.html        the page (prompt, sampling options, text as it grows, tokens/s, state bytes)
    SITE/edgeattn.js       the ES module that drives the graphs from the manifest (edgeattn/web/static/)
    SITE/model/            the artifact's manifest, graphs, weights and tokenizer (not the torch checkpoint)
    SITE/ort/              the onnxruntime-web files the page loads (copied from web/node_modules)
    SITE/tokenizers/       @huggingface/tokenizers, only for artifacts with a tokenizer.json

The JavaScript dependencies are the repository's npm project ``web/`` (package.json, package-lock.json),
installed by ``scripts/setup_env.sh``; ``--node-modules DIR`` (or ``EDGEATTN_WEB_MODULES``) points
elsewhere, e.g. at an ``npm install onnxruntime-web@1.30.0 @huggingface/tokenizers@0.2.0`` of a pip
install without the repository.

Which graphs run: onnxruntime-web's WASM build is ONNX Runtime's CPU execution provider, so every
standard op of the ``portable`` target runs (fp32, fp16, int8). Of the contrib ops of the
``onnxruntime`` target, WEB_CONTRIB_OPS lists those that loaded and ran in onnxruntime-web 1.30.0
(tested by experiment on exported graphs, tests/test_web.py loads each in Chromium); the rest are
refused before anything is written, with the op named.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from edgeattn._atomic import make_temp_dir, replace_dir

STATIC = Path(__file__).parent / "static"
REPO_MODULES = Path(__file__).resolve().parents[2] / "web" / "node_modules"
ORT_VERSION = "1.30.0"  # web/package.json pins it; WEB_CONTRIB_OPS was established on it

# onnxruntime-web's WASM files: the page imports ORT_MODULE; the runtime loads the .mjs/.wasm pair itself.
ORT_FILES = {
    "wasm": ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm"),
    "webgpu": (
        "ort.webgpu.min.mjs",
        "ort-wasm-simd-threaded.asyncify.mjs",
        "ort-wasm-simd-threaded.asyncify.wasm",
    ),
}
TOKENIZERS_FILE = "tokenizers.min.mjs"

# com.microsoft ops that ran in onnxruntime-web 1.30.0's WASM build on edgeattn's exported graphs (op ->
# the attributes it knows; None: any). GatedRMSNorm exists but 1.30 refuses its `activation` attribute
# ("Unrecognized attribute: activation for operator GatedRMSNorm"); the export's optimizer rewrites that
# norm into plain ops (edgeattn.export.optimize.unfuse_gated_norms), so only graphs exported without it
# carry one: export those with the optimizer or with --target portable for the browser.
WEB_CONTRIB_OPS: dict[str, frozenset | None] = {
    "LinearAttention": None,
    "LinearAttentionGate": None,
    "CausalConvWithState": None,
    "GroupQueryAttention": None,
    "SkipSimplifiedLayerNormalization": None,
    "MatMulNBits": None,
    "GatherBlockQuantized": None,
    "GatedRMSNorm": frozenset({"epsilon"}),
}


# ---- the graphs' ops, read without the onnx package (the base install has none) ----


def _fields(buf: bytes):
    """(field number, wire type, value) of one protobuf message: varints as int, length-delimited as bytes."""
    i, n = 0, len(buf)
    while i < n:
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i : i + size], i + size
        elif wire == 1:
            value, i = None, i + 8
        elif wire == 5:
            value, i = None, i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, wire, value


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def _graph_nodes(graph: bytes):
    """(domain, op_type, attribute names) of every node of a GraphProto, subgraphs included."""
    for field, wire, value in _fields(graph):
        if field != 1 or wire != 2:  # GraphProto.node
            continue
        op = domain = ""
        attrs = []
        for f, w, v in _fields(value):
            if f == 4 and w == 2:  # NodeProto.op_type
                op = v.decode()
            elif f == 7 and w == 2:  # NodeProto.domain
                domain = v.decode()
            elif f == 5 and w == 2:  # NodeProto.attribute
                for af, aw, av in _fields(v):
                    if af == 1 and aw == 2:  # AttributeProto.name
                        attrs.append(av.decode())
                    elif af in (6, 11) and aw == 2:  # AttributeProto.g / graphs
                        yield from _graph_nodes(av)
        yield domain or "ai.onnx", op, tuple(attrs)


def graph_ops(path: str | os.PathLike) -> set[tuple[str, str, tuple[str, ...]]]:
    """The (domain, op_type, attribute names) of every node of an ONNX file (its initializers stay on disk)."""
    data = Path(path).read_bytes()
    for field, wire, value in _fields(data):
        if field == 7 and wire == 2:  # ModelProto.graph
            return set(_graph_nodes(value))
    raise ValueError(f"{path} holds no ONNX graph")


def unsupported_op(manifest) -> str | None:
    """A one-line reason naming the first op of the artifact's graphs that onnxruntime-web cannot run, or None."""
    for path in sorted({manifest.graph_path(g) for g in ("step", "prefill")}):
        for domain, op, attrs in sorted(graph_ops(path)):
            if domain in ("ai.onnx", "ai.onnx.ml"):
                continue
            known = WEB_CONTRIB_OPS.get(op, False) if domain == "com.microsoft" else False
            if known is False:
                return (
                    f"{path.name} uses {domain}.{op}, which onnxruntime-web {ORT_VERSION} (WASM) does not run"
                )
            extra = sorted(set(attrs) - known) if known is not None else []
            if extra:
                return (
                    f"{path.name} uses {domain}.{op} with the attribute {extra[0]!r}, which onnxruntime-web "
                    f"{ORT_VERSION} (WASM) does not know"
                )
    return None


# ---- the site ----

WASM_HEAP_LIMIT = (
    4 * 2**30
)  # a 32-bit WebAssembly memory: onnxruntime-web's WASM build holds everything in it


def heap_estimate(manifest) -> int:
    """Bytes of weights the page's WASM heap holds: one copy per graph file (each onnxruntime-web session
    keeps its own; there is no shared-initializer API in the browser)."""
    graphs = {manifest.data["graphs"][g]["path"] for g in ("step", "prefill")}
    files = manifest.data["files"]
    if manifest.weights is not None:
        return len(graphs) * int(manifest.weights["bytes"]) + sum(
            int(files[g].get("bytes", 0)) for g in graphs
        )
    return sum(int(files[g].get("bytes", 0)) for g in graphs)


def find_modules(node_modules: str | os.PathLike | None = None) -> Path:
    """The node_modules folder holding onnxruntime-web: the argument, $EDGEATTN_WEB_MODULES, or the repo's web/."""
    where = node_modules or os.environ.get("EDGEATTN_WEB_MODULES") or REPO_MODULES
    where = Path(where)
    if not (where / "onnxruntime-web" / "dist" / ORT_FILES["wasm"][0]).is_file():
        raise FileNotFoundError(
            f"onnxruntime-web is not installed in {where}: run `bash scripts/setup_env.sh` (or `npm ci` in web/) "
            f"in a clone of the repository, or `npm install onnxruntime-web@{ORT_VERSION} "
            "@huggingface/tokenizers@0.2.0` in a folder and pass its node_modules with --node-modules"
        )
    return where


def build_site(
    artifact: str | os.PathLike,
    out: str | os.PathLike,
    *,
    node_modules: str | os.PathLike | None = None,
    force: bool = False,
) -> Path:
    """Write the static site of ``artifact`` to ``out`` (whole or not at all); ValueError / FileNotFoundError
    with one line for what the page cannot run or what is missing."""
    from edgeattn.export.manifest import MANIFEST, Manifest

    out = Path(out)
    manifest = Manifest.load(artifact)  # verifies every file's sha256
    a, o = manifest.root.resolve(), out.resolve()
    if a == o or a in o.parents or o in a.parents:
        raise ValueError(f"--out {out} and the artifact {artifact} overlap: write the site elsewhere")
    if manifest.batch_size != 1:
        raise ValueError(
            f"the page generates one sequence: export with --batch 1 (this artifact has {manifest.batch_size})"
        )
    reason = unsupported_op(manifest)
    if reason:
        raise ValueError(f"{reason}; export with --target portable for the browser")
    need = heap_estimate(manifest)
    if need > 0.85 * WASM_HEAP_LIMIT:  # room for activations, the state and the runtime itself
        raise ValueError(
            f"the page would hold {need / 2**30:.1f} GiB of weights in WebAssembly's 4 GiB memory: export with "
            "--precision int4 (and the onnxruntime target: one graph, one copy) or use a smaller model"
        )
    modules = find_modules(node_modules)
    if out.exists() and any(out.iterdir()) and not force:
        raise ValueError(f"--out {out} is not empty; pass --force to replace it")

    tmp = make_temp_dir(out)
    try:
        model = tmp / "model"
        model.mkdir()
        # the artifact without its torch checkpoint: the site's model/ is itself a valid artifact
        data = dict(manifest.data, checkpoint=None)
        data["files"] = {
            f: info for f, info in manifest.data["files"].items() if not _in_checkpoint(manifest, f)
        }
        for name in data["files"]:
            dst = model / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(manifest.root / name, dst)
        (model / MANIFEST).write_text(json.dumps(data, indent=2) + "\n")
        (tmp / "ort").mkdir()
        dist = modules / "onnxruntime-web" / "dist"
        for name in ORT_FILES["wasm"] + ORT_FILES["webgpu"]:
            shutil.copyfile(dist / name, tmp / "ort" / name)
        if manifest.data.get("tokenizer", {}).get("type") == "huggingface":
            src = modules / "@huggingface" / "tokenizers" / "dist" / TOKENIZERS_FILE
            if not src.is_file():
                raise FileNotFoundError(
                    f"@huggingface/tokenizers is not installed in {modules} (npm ci in web/)"
                )
            (tmp / "tokenizers").mkdir()
            shutil.copyfile(src, tmp / "tokenizers" / TOKENIZERS_FILE)
        for name in ("index.html", "edgeattn.js"):
            shutil.copyfile(STATIC / name, tmp / name)
        site = {"ort_version": _version(modules / "onnxruntime-web"), "model": "model/" + MANIFEST}
        chat = chat_wrap(manifest)
        if chat is not None:
            site["chat"] = chat
        (tmp / "site.json").write_text(json.dumps(site, indent=2) + "\n")
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


CHAT_SENTINEL = "\x00edgeattn-message\x00"


def chat_wrap(manifest) -> dict | None:
    """The page's chat (``?chat=1``): the model's chat template rendered around one user message, as
    ``{"prefix", "suffix"}`` (what `edgeattn run --chat` sends is prefix + prompt + suffix). None without a
    template, without the tokenizers extra that renders it, or where the template does not copy the message
    through verbatim (it would change it)."""
    from edgeattn._deps import MissingDependency
    from edgeattn.artifact.tokenizer import load_tokenizer

    if not (manifest.data.get("tokenizer") or {}).get("chat_template"):
        return None
    try:
        text = load_tokenizer(manifest).apply_chat_template(CHAT_SENTINEL)
    except MissingDependency:
        return None
    if text.count(CHAT_SENTINEL) != 1:
        return None
    prefix, suffix = text.split(CHAT_SENTINEL)
    return {"prefix": prefix, "suffix": suffix}


def _in_checkpoint(manifest, name: str) -> bool:
    ckpt = manifest.data.get("checkpoint")
    return bool(ckpt) and name.startswith(ckpt.rstrip("/") + "/")


def _version(package: Path) -> str:
    try:
        return json.loads((package / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return "unknown"
