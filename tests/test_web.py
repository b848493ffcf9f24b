"""`edgeattn web` (issue 23): the site runs in a real headless Chromium (Debian's chromium driven by
puppeteer-core, tests/browser.py) and generates the same greedy tokens as Python's Session on the same
artifact (ONNX Runtime in Python is the independent reference for onnxruntime-web in the page); its memory
stays flat; the CLI refuses what the page cannot run with one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlencode

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from edgeattn.cli import web as web_cli
from edgeattn.runtimes import open_session
from edgeattn.web import build_site, graph_ops
from edgeattn.web.serve import serve_site
from tests.browser import REPO, Browser, browser_missing
from tests.export_helpers import EXPORTABLE, make_checkpoint

runner = CliRunner()
app = typer.Typer()
web_cli.register(app)
app.command("noop")(lambda: None)  # two commands: `web` stays a subcommand

MISSING = browser_missing()
needs_browser = pytest.mark.skipif(MISSING is not None, reason=f"no browser to test in: {MISSING}")

PROMPT = "def main(args): # héllo ✓ "  # > one prefill chunk (16 tokens), non-ASCII bytes
DONE = "window.edgeattn && window.edgeattn.done"

# name -> (mixer, export options); the tiny models of tests/export_helpers.py
ARTIFACTS = {
    "gla": ("gla", dict(target="portable")),
    "gated_deltanet": ("gated_deltanet", dict(target="portable")),
    "hybrid": ("gla,softmax", dict(target="portable")),  # a growing KV cache in JavaScript
    "gla_fused": ("gla", dict(target="onnxruntime")),  # com.microsoft.LinearAttention, one graph
    "hybrid_fused": ("gla,softmax", dict(target="onnxruntime")),  # GroupQueryAttention on a KV buffer
    "gla_int4": ("gla", dict(target="onnxruntime", precision="int4")),  # MatMulNBits, GatherBlockQuantized
    # a call returns [1, 1, V] whatever its tokens (issue 31: the page took row T-1 of it, an empty slice)
    "gla_last": ("gla", dict(target="onnxruntime", prefill_logits="last")),
    # KV buffers of float16 and int8 (issue 31: the page fed them float32 zeros)
    "hybrid_f16kv": ("gla,softmax", dict(target="onnxruntime", kv_dtype="float16")),
    "hybrid_i8kv_last": ("gla,softmax", dict(target="onnxruntime", kv_dtype="int8", prefill_logits="last")),
    # refused: GatedRMSNorm with its activation attribute (the trace's fused norm; the optimizer, off here,
    # rewrites it into plain ops since ONNX Runtime's CPU kernel is slow)
    "gated_deltanet_fused": ("gated_deltanet", dict(target="onnxruntime", optimize=False)),
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """name -> artifact dir, exported on first use."""
    from edgeattn.export import export_model

    root = tmp_path_factory.mktemp("web")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            mixer, kw = ARTIFACTS[name]
            ckpt = make_checkpoint(root / f"ckpt-{name}", mixer)
            made[name] = export_model(ckpt, root / name, prefill_chunk=16, **kw)
        return made[name]

    return get


@pytest.fixture(scope="module")
def browser():
    if MISSING is not None:
        pytest.skip(f"no browser to test in: {MISSING}")
    with Browser() as b:
        yield b


def page_url(url: str, **query) -> str:
    return url + "?" + urlencode({"autostart": 1, **query})


def python_greedy(artifact: Path, prompt: str, n: int) -> list[int]:
    sess = open_session(artifact)
    return list(sess.generate_ids(sess.tokenizer.encode(prompt), n, temperature=0))


def run_page(browser: Browser, site: Path, timeout: float = 120, **query) -> dict:
    with serve_site(site) as url:
        browser.goto(page_url(url, **query))
        browser.wait_for(DONE, timeout=timeout)
        return browser.evaluate(
            "({tokens: edgeattn.tokens, text: edgeattn.text, error: edgeattn.error, threads: edgeattn.threads,"
            " isolated: self.crossOriginIsolated, shown: document.getElementById('generated').textContent,"
            " stats: document.getElementById('stats').textContent, state_bytes: edgeattn.state_bytes})"
        )


# ---- the CLI, no browser needed ----


def test_graph_ops_reads_what_onnx_reads(artifacts):
    """The op list (read without the onnx package) equals onnx's own parse of the graph."""
    import onnx

    for name in ("gla", "gated_deltanet_fused"):
        path = artifacts(name) / "step.onnx"
        model = onnx.load(str(path), load_external_data=False)
        want = {
            (n.domain or "ai.onnx", n.op_type, tuple(a.name for a in n.attribute)) for n in model.graph.node
        }
        assert graph_ops(path) == want


def test_web_refuses_an_op_the_page_cannot_run_in_one_line(artifacts, tmp_path):
    out = tmp_path / "site"
    res = runner.invoke(app, ["web", str(artifacts("gated_deltanet_fused")), "--out", str(out)])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "GatedRMSNorm" in lines[0]
    assert "--target portable" in lines[0] and not out.exists()


def test_web_without_onnxruntime_web_says_how_to_get_it(artifacts, tmp_path):
    out = tmp_path / "site"
    res = runner.invoke(
        app, ["web", str(artifacts("gla")), "--out", str(out), "--node-modules", str(tmp_path)]
    )
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: onnxruntime-web is not installed") and "npm" in res.output
    assert len(res.output.strip().splitlines()) == 1 and not out.exists()


def test_web_refuses_a_non_empty_out_and_bad_artifacts(artifacts, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    res = runner.invoke(app, ["web", str(artifacts("gla")), "--out", str(tmp_path / "full")])
    assert res.exit_code == 2 and "--force" in res.output
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    art = artifacts("gla")
    for out in (art, art / "site", art.parent):  # the site would replace or hold the artifact
        res = runner.invoke(app, ["web", str(art), "--out", str(out), "--force"])
        assert res.exit_code == 2 and "overlap" in res.output, res.output
    assert (art / "edgeattn.json").is_file() and not (art / "site").exists()
    res = runner.invoke(app, ["web", str(tmp_path / "nothing"), "--out", str(tmp_path / "s")])
    assert res.exit_code == 2 and res.output.startswith("error: ") and "does not exist" in res.output


def test_web_refuses_weights_beyond_the_wasm_heap(artifacts, tmp_path, monkeypatch):
    """Two graphs hold two copies of the weights in the page; past 85% of WebAssembly's 4 GiB: one line."""
    import edgeattn.web as web

    art = artifacts("gla")
    weights = json.loads((art / "edgeattn.json").read_text())["weights"]["bytes"]
    monkeypatch.setattr(web, "WASM_HEAP_LIMIT", int(2 * weights / 0.85) - 1)  # just below two copies' worth
    res = runner.invoke(app, ["web", str(art), "--out", str(tmp_path / "site")])
    assert res.exit_code == 2 and res.output.startswith("error: the page would hold") and "int4" in res.output
    assert not (tmp_path / "site").exists()


@needs_browser
def test_site_holds_the_artifact_without_its_checkpoint(artifacts, tmp_path):
    site = build_site(artifacts("gla"), tmp_path / "site")
    names = {p.relative_to(site).as_posix() for p in site.rglob("*") if p.is_file()}
    assert {
        "index.html",
        "edgeattn.js",
        "model/edgeattn.json",
        "model/step.onnx",
        "model/prefill.onnx",
    } <= names
    assert {"ort/ort.wasm.min.mjs", "ort/ort-wasm-simd-threaded.wasm"} <= names
    assert not any(n.startswith("model/checkpoint") for n in names)
    # the site's model/ is itself a valid artifact (every listed file there, sha256 checked)
    assert open_session(site / "model").manifest.checkpoint is None
    # nothing is fetched from elsewhere: the page and module name no http(s) URL
    for name in ("index.html", "edgeattn.js"):
        assert "http://" not in (site / name).read_text() and "https://" not in (site / name).read_text()


# ---- in Chromium ----


@needs_browser
def test_smoke_8_greedy_tokens_and_a_screenshot_with_text(artifacts, browser, tmp_path):
    art = artifacts("gla")
    site = build_site(art, tmp_path / "site")
    page = run_page(browser, site, prompt=PROMPT, max_new_tokens=8, temperature=0)
    assert page["error"] is None
    assert page["tokens"] == python_greedy(art, PROMPT, 8)
    assert page["isolated"] and page["threads"] >= 1  # COOP/COEP from the server: WASM threads allowed
    # the text shown is the UTF-8 decoding of the bytes (invalid sequences replaced, as Python does)
    assert page["text"] == bytes(page["tokens"]).decode("utf-8", errors="replace") == page["shown"]
    assert "tokens/s" in page["stats"] and f"state {page['state_bytes']:,} bytes" in page["stats"]
    box = browser.evaluate(
        "(() => { const r = document.getElementById('generated').getBoundingClientRect();"
        " return [r.left, r.top, r.right, r.bottom].map(Math.round); })()"
    )
    shot = browser.screenshot(tmp_path / "page.png")
    runs = REPO / "runs"
    runs.mkdir(exist_ok=True)
    shutil.copyfile(shot, runs / "web-screenshot.png")
    assert_shows_text(shot, box)


def assert_shows_text(png: Path, box: list[int]) -> None:
    """The generated text's box [left, top, right, bottom] in the screenshot holds dark glyph pixels on the
    white page (the box is empty, and all white, before generation)."""
    from PIL import Image

    img = np.asarray(Image.open(png).convert("L"), dtype=np.int32)
    left, top, right, bottom = box
    assert right - left > 20 and bottom - top > 8, f"no generated text on the page: box {box}"
    region = img[top:bottom, left:right]
    dark = region < 100  # glyphs are near black; the background is white (255)
    assert dark.sum() > 50 and dark.mean() < 0.5, (dark.sum(), dark.mean())
    assert (img > 240).mean() > 0.5  # the rest is the white page, not a blank or black capture


@needs_browser
@pytest.mark.parametrize(
    "name",
    [
        "gla",
        "gated_deltanet",
        "hybrid",
        "gla_fused",
        "hybrid_fused",
        "gla_last",
        "hybrid_f16kv",
        "hybrid_i8kv_last",
    ],
)
def test_64_greedy_tokens_equal_python_session(name, artifacts, browser, tmp_path):
    """Same ids as ONNX Runtime in Python: the page feeds state, chunks and steps as the Session does."""
    art = artifacts(name)
    site = build_site(art, tmp_path / "site")
    page = run_page(browser, site, prompt=PROMPT, max_new_tokens=64, temperature=0)
    assert page["error"] is None
    assert page["tokens"] == python_greedy(art, PROMPT, 64)


@needs_browser
def test_the_page_refuses_more_tokens_than_the_kv_buffer_holds(artifacts, browser, tmp_path):
    """The softmax layer's buffer holds max_length tokens (512 here): the page says so, as Session does."""
    art = artifacts("hybrid_fused")
    with pytest.raises(ValueError, match="exceed"):
        python_greedy(art, PROMPT, 600)
    page = run_page(browser, build_site(art, tmp_path / "site"), prompt=PROMPT, max_new_tokens=600)
    assert page["error"] is not None and "maximum of 512" in page["error"] and page["tokens"] == []


# SwiftShader's software Vulkan gives headless Chromium a WebGPU adapter (no GPU needed)
WEBGPU_ARGS = [
    "--enable-unsafe-webgpu",
    "--enable-unsafe-swiftshader",
    "--use-webgpu-adapter=swiftshader",
    "--enable-features=Vulkan",
]


@needs_browser
def test_webgpu_when_the_browser_has_an_adapter(artifacts, tmp_path):
    """ep=auto picks WebGPU where the browser gives an adapter; the ids stay Session's."""
    art = artifacts("gla")
    site = build_site(art, tmp_path / "site")
    with Browser(args=WEBGPU_ARGS) as browser:
        # 8 tokens: SwiftShader compiles each graph's shaders on its first run (~10 s on a loaded machine)
        page = run_page(browser, site, prompt=PROMPT, max_new_tokens=8, temperature=0)
        if browser.evaluate("edgeattn.ep") != "webgpu":
            assert not browser.evaluate(
                "(async () => !!(navigator.gpu && await navigator.gpu.requestAdapter()))()"
            )
            pytest.skip("this chromium gives no WebGPU adapter, even with SwiftShader")
    assert page["error"] is None
    assert page["tokens"] == python_greedy(art, PROMPT, 8)


@needs_browser
@pytest.mark.filterwarnings("ignore:step.onnx in int4")  # the tiny random model's int4 error, expected
def test_int4_logits_are_close_to_python(artifacts, browser, tmp_path):
    """MatMulNBits runs in the page, but not bit for bit as ONNX Runtime on x86: the graphs ask for
    accuracy_level 4 (int8 activations), which x86 MLAS honours and WASM computes in float32; greedy
    tokens part when two logits are close, so the prefill's logits are compared instead."""
    art = artifacts("gla_int4")
    site = build_site(art, tmp_path / "site")
    run_page(browser, site, prompt=PROMPT, max_new_tokens=1, temperature=0)
    got = np.array(browser.evaluate("Array.from(edgeattn.prefillLogits)"), dtype=np.float32)
    sess = open_session(art)
    want = sess.prefill(np.array([sess.tokenizer.encode(PROMPT)]))[0]
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max(), np.abs(got - want).max()


@needs_browser
def test_sampling_is_seeded_and_bytes_decode_across_tokens(artifacts, browser, tmp_path):
    site = build_site(artifacts("gla"), tmp_path / "site")
    with serve_site(site) as url:
        browser.goto(url)
        browser.wait_for("window.edgeattn && window.edgeattn.ready")
        # the form, as a user: keystrokes into the prompt, a click on Generate
        browser.evaluate(
            "document.getElementById('prompt').value = ''; document.getElementById('max_new_tokens').value = 12"
        )
        browser.type("#prompt", "def ")
        browser.click("#run")
        browser.wait_for("edgeattn.done && edgeattn.tokens.length === 12")
        clicked = browser.evaluate("edgeattn.tokens")
        gen = "edgeattn.generate({prompt: 'def ', max_new_tokens: 48, temperature: %s, top_p: %s, seed: %s})"
        a = browser.evaluate(gen % (1.5, 0.9, 7))
        b = browser.evaluate(gen % (1.5, 0.9, 7))
        c = browser.evaluate(gen % (1.5, 0.9, 8))
        greedy = browser.evaluate(gen % (0, 1, "null"))
        text = "héllo ✓ 日本 😀"
        ids = list(text.encode()) + [0xFF, 0xE2, 0x9C, 0x41]  # then an invalid byte and a cut-off character
        pieces = browser.evaluate(f"edgeattn.decodePieces({ids})")
    assert a == b and len(a) == 48 and all(0 <= t < 256 for t in a)
    assert a != c and a != greedy
    assert greedy == python_greedy(artifacts("gla"), "def ", 48)
    assert clicked == greedy[:12]  # the form's defaults: temperature 0
    # UTF-8 across token boundaries: each character shown once whole; invalid bytes replaced as Python does
    assert "".join(pieces) == bytes(ids).decode("utf-8", errors="replace")
    assert "😀" in pieces[: len(text)] and "\ufffd" not in "".join(pieces)[: len(text)]


@needs_browser
def test_2000_tokens_keep_the_wasm_and_js_heaps_flat(artifacts, browser, tmp_path):
    """A generation of 300 tokens, then one of 2,000 from the same prompt (the page starts each from zeros):
    the heaps after each (garbage collected through CDP) are the same. Two generations rather than two
    readings during one, so that the check does not depend on how fast the page runs."""
    site = build_site(artifacts("gla"), tmp_path / "site")
    with serve_site(site) as url:
        browser.goto(url)
        browser.wait_for("window.edgeattn && window.edgeattn.ready")
        browser.evaluate("edgeattn.generate({prompt: 'def ', max_new_tokens: 300, temperature: 0}), 0")
        browser.wait_for(DONE, timeout=120)
        assert browser.evaluate("document.getElementById('generated').textContent.length") > 0
        early = memory(browser)
        browser.evaluate("edgeattn.generate({prompt: 'def ', max_new_tokens: 2000, temperature: 0}), 0")
        # the page yields while it generates: a script sent at once is answered before the 2,000 tokens end
        assert browser.evaluate("edgeattn.done") is False
        browser.wait_for(DONE, timeout=300)
        late = memory(browser)
        assert (
            browser.evaluate("edgeattn.tokens.length") == 2000 and browser.evaluate("edgeattn.error") is None
        )
    assert late["wasm"] == early["wasm"] > 0  # the WASM heap never grew
    assert late["js"] - early["js"] < 512 * 1024, (early, late)  # 1,700 more ids and their text: ~30 KB
    assert late["rss"] - early["rss"] < 32 * 2**20, (early, late)


def memory(browser: Browser) -> dict:
    browser.gc()
    m = browser.metrics()
    return {
        "wasm": browser.evaluate("edgeattn.wasmBytes()"),
        "js": m["JSHeapUsedSize"],
        "rss": browser.renderer_rss(),
    }


@needs_browser
def test_tokenizer_json_artifact_encodes_and_decodes_as_tokenizers(tmp_path, browser):
    """An artifact with a Hugging Face tokenizer.json: the page encodes with @huggingface/tokenizers, stops
    at the end-of-sequence id and shows the same ids and text as the Python session (tokenizers)."""
    from edgeattn.export import export_model
    from tests.hf_helpers import train_tokenizer

    ckpt = make_checkpoint(tmp_path / "ckpt", "gla", vocab_size=300)
    train_tokenizer(ckpt, vocab_size=300)
    art = export_model(ckpt, tmp_path / "art", target="portable", prefill_chunk=16)
    prompt = "def main(args):\n    héllo ✓ 日本"
    sess = open_session(art)
    want = python_greedy(art, prompt, 48)
    site = build_site(art, tmp_path / "site")
    page = run_page(browser, site, prompt=prompt, max_new_tokens=48, temperature=0)
    assert page["error"] is None
    assert page["tokens"] == want
    assert page["text"] == sess.tokenizer.decode(want)


def test_cli_writes_a_site_end_to_end(artifacts, tmp_path):
    """`edgeattn web` as a user runs it (a subprocess through the console module)."""
    if MISSING is not None and "node_modules" in MISSING:
        pytest.skip(MISSING)
    out = tmp_path / "site"
    res = subprocess.run(
        [sys.executable, "-m", "edgeattn.cli.main", "web", str(artifacts("gla")), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert (out / "index.html").is_file() and json.loads((out / "site.json").read_text())[
        "ort_version"
    ] == "1.30.0"


REFUSED = {("gated_deltanet", "onnxruntime"), ("kda", "onnxruntime")}  # GatedRMSNorm's `activation`


@needs_browser
@pytest.mark.slow
@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
@pytest.mark.parametrize("mixer", EXPORTABLE)
def test_every_mixer_runs_in_the_page_or_is_refused(mixer, target, browser, tmp_path):
    """The list in edgeattn.web and the README: each exportable mixer on each target either generates
    Session's greedy ids in the page or is refused by `edgeattn web` with the op named."""
    from edgeattn.export import export_model

    ckpt = make_checkpoint(tmp_path / "ckpt", mixer)
    art = export_model(ckpt, tmp_path / "art", target=target, prefill_chunk=16, include_checkpoint=False)
    if (mixer, target) in REFUSED:
        with pytest.raises(ValueError, match="GatedRMSNorm"):
            build_site(art, tmp_path / "site")
        return
    site = build_site(art, tmp_path / "site")
    page = run_page(browser, site, prompt=PROMPT, max_new_tokens=24, temperature=0)
    assert page["error"] is None
    assert page["tokens"] == python_greedy(art, PROMPT, 24)


@needs_browser
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_portable_fp16_and_int8_run_in_the_page(precision, browser, tmp_path):
    from edgeattn.export import export_model

    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    art = export_model(ckpt, tmp_path / "art", target="portable", precision=precision, prefill_chunk=16)
    site = build_site(art, tmp_path / "site")
    page = run_page(browser, site, prompt=PROMPT, max_new_tokens=24, temperature=0)
    assert page["error"] is None
    assert page["tokens"] == python_greedy(art, PROMPT, 24)


@needs_browser
def test_int8_weight_blocks_run_in_the_page(browser, tmp_path):
    """int8's default on the onnxruntime target: 8-bit MatMulNBits, which onnxruntime-web's WASM build runs."""
    from edgeattn.export import export_model

    ckpt = make_checkpoint(tmp_path / "ckpt", "gla")
    art = export_model(ckpt, tmp_path / "art", precision="int8", prefill_chunk=16)
    site = build_site(art, tmp_path / "site")
    page = run_page(browser, site, prompt=PROMPT, max_new_tokens=24, temperature=0)
    assert page["error"] is None
    assert page["tokens"] == python_greedy(art, PROMPT, 24)


@needs_browser
def test_the_site_opened_as_a_file_says_to_serve_it_over_http(artifacts, browser, tmp_path):
    """file:// loads no ES module in Chromium: the page says so, and how to serve it, instead of staying
    at "loading..." (issue 31)."""
    site = build_site(artifacts("gla"), tmp_path / "site")
    browser.goto((site / "index.html").as_uri() + "?autostart=1")
    browser.wait_for(DONE, timeout=20)
    status = browser.evaluate("document.getElementById('status').textContent")
    assert status.startswith("error: this page must be served over HTTP"), status
    assert f"python -m edgeattn.web.serve {site}" in status, status
    assert browser.evaluate("edgeattn.error") in status and browser.evaluate("edgeattn.tokens") == []


def test_a_full_disk_is_one_line_and_leaves_nothing(artifacts, tmp_path, monkeypatch):
    """ENOSPC while the site's files are copied (issue 31): one `error:` line naming --out, exit 2, no site and
    no temporary left beside it."""
    import errno
    import os

    import edgeattn.web as web

    if MISSING is not None and "node_modules" in MISSING:
        pytest.skip(MISSING)
    real = shutil.copyfile

    def copyfile(src, dst, **kw):
        if str(dst).endswith(".wasm"):  # the model is in: the disk fills on onnxruntime-web's files
            Path(dst).write_bytes(Path(src).read_bytes()[:1000])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))
        return real(src, dst, **kw)

    monkeypatch.setattr(web.shutil, "copyfile", copyfile)
    (tmp_path / "sites").mkdir()
    out = tmp_path / "sites" / "site"
    res = runner.invoke(app, ["web", str(artifacts("gla")), "--out", str(out)])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --out {out}: no space left on device"), res.output
    assert list((tmp_path / "sites").iterdir()) == []
