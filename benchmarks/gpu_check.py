"""The GPU half of edgeattn in one run (issue 36): the Triton kernels compiled and tested, raced against
fla's, training throughput against fla's models, and decode on CUDA through the torch backend.

What it does, one section after another, each in its own process with its own time budget (a section
that runs past it is killed and recorded as timed out; an exception inside a section is recorded and the
section goes on with its next item; a crashed section, say an illegal memory access, takes nothing else
down):

    tests    pytest on tests/test_kernels.py, test_kernels_aft_flash.py and test_kernels_delta.py, slow cases
             included, compiled (TRITON_INTERPRET unset): every kernel against its PyTorch or fla reference,
             forward and backward, float32 and bfloat16, NaN-poisoned outputs, odd lengths.
    kernels  forward + backward, bfloat16, B=8, H=16, K=V=128, T=2048 and 8192: edgeattn's Triton kernels
             against fla's chunk_gla (per-key gate), chunk_simple_gla (per-head gate),
             chunk_gated_delta_rule and chunk_kda, and causal SDPA; ms (median of CUDA events), TFLOP/s and
             GB/s (benchmarks/kernels.py's FLOP and byte models), the ratio fla ms / ours (> 1: faster than
             fla), and ours against fla on the same inputs (relative RMS of the output and every gradient).
             Ours in each of its forms (``FORMS``): "triton" (shipped: the delta rule's WY part in PyTorch,
             the cumulative gates as exact float32 pairs), "triton-f32g" (the gates as float32 sums, fla's
             form, EDGEATTN_GATE_SUM=float32) and for the delta rules "triton-wy" (the WY part in Triton,
             EDGEATTN_DELTA_WY=triton) and "triton-wy-f32g". Then, as time allows, the PyTorch chunk forms
             the kernels replace.
    train    training throughput, bfloat16 autocast, T=2048, batch 8, fused AdamW, gradient clipping:
             edgeattn `gla` and `gated_deltanet` models against fla's GLAForCausalLM and
             GatedDeltaNetForCausalLM of the same shape (117M parameters each: d 768, 12 layers, 6 heads of
             K=V=128, vocabulary 32000, tied embeddings). The edgeattn model is fla's, random weights,
             imported with edgeattn.convert (the same shape by construction). Each library trains as it
             trains: edgeattn's loop (logits, then float32 cross-entropy), fla's model with labels (its
             fused cross-entropy). Tokens/s over the timed steps after warm-up, peak CUDA memory.
             ``--train-libs`` adds edgeattn's other forms: edgeattn-f32g, edgeattn-wy, edgeattn-wy-f32g.
    decode   the 92.5M GLA (d 768, 12 layers, 12 heads, vocabulary 256, random weights) exported and run by
             the torch backend on CUDA: ms/token after a prefill of 128 and 16384 tokens, allocated and peak
             memory at each, stepping eagerly (``cuda_graph=False``) and as the session's CUDA graph (the
             default on CUDA, open_session(backend="torch", device="cuda")); the graph checked against eager
             over ``check_steps`` greedy tokens from the same prompt (every token, the largest logit diff).

Output, all in the folder ``--out`` (``$OUT`` on the device machine): results.jsonl (one JSON object per
line, every figure and every error), results.md (the tables), gpu_check.log (everything printed) and
junit.xml (pytest's report). Progress is printed as it goes; the tables are printed last.

On this CPU the same script runs at tiny shapes (``--tiny``; Triton's interpreter, TRITON_INTERPRET=1 set
for the sections) as tests/test_gpu_check.py: on the GPU only ``SIZES`` changes. Three entries of the tiny
sizes are there for the interpreter, not for size: the kernels run in float32 (fla's kernels return garbage
in bfloat16 under the interpreter), the training without autocast and fla's models without their fused
cross-entropy (both CUDA-only in fla). There, on the same inputs, ours and fla agree to ~1e-6.

fla on the device: fla-core and flash-linear-attention 0.6.0 (pure Python wheels: einops, torch >= 2.7,
triton >= 3.3 and transformers >= 5.6.2, < 6, all in the device image: torch 2.11, triton 3.6,
transformers 5.17), carried in .whl/ (``scripts/fetch_gpu_wheels.sh``) and installed by
scripts/gpu_check.sh. Known on Hopper with Triton 3.4 to 3.7.0, which torch 2.11's Triton 3.6 is: Triton
miscompiles ``tl.dot(tl.trans(x), y)`` where x is a dot's result (fla #640: wrong gradients of
chunk_gated_delta_rule), and fla 0.6 refuses the backward of its gated ``chunk_bwd_dqkwg`` there
(chunk_simple_gla, chunk_gated_delta_rule, GatedDeltaNetForCausalLM) with a RuntimeError. The kernels
and train sections lift that guard to time fla (noted in the results: fla's gradients there are not
trusted). edgeattn's kernels use the same pattern (gated_chunk.py, flash.py, delta_chunk.py): the tests
section, with its bfloat16 cases at K = 64 and 128, is what says whether they are hit.

The device run (a later session's; at most 10 minutes a command, 15 minutes of device time in all):

    run(command="PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=590)

after ``bash scripts/fetch_gpu_wheels.sh`` here. The budgets (``BUDGETS``, 515 s together, about 9
minutes with the imports and the wheels' install) keep the run inside 590 s. From the first H100 runs
(RESULTS.md): the compiled tests take 87 s; fla's kernels compile for about 40 s an op even with their
autotuning capped (``--fla-autotune-configs``), so the kernels section gets the most. On an H200
(2026-11-28) every section finished inside its budget: 421 s in all, the train section (then 130 s) with
10 s to spare and without its Gated DeltaNet edgeattn row (about 40 s, from a second call: ``--sections
train --models gated_deltanet --train-libs edgeattn``), hence 170 s now. The Triton cache came to over 48 MB
there, so it was not packed; a second call recompiles. Then scripts/gpu_profile.sh (benchmarks/gpu_profile.py)
says where the time goes.

With our other forms (``FORMS``) the kernels section times up to four forms an op, compiled in background
processes while the tests run (``--precompile``); the run that times them all fits two calls:

    run(command="PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh $OUT --sections tests,kernels "
                "--budgets kernels=280", carry=[".whl"], timeout_s=480)
    run(command="PYTHONUNBUFFERED=1 bash scripts/gpu_check.sh $OUT --sections train,decode "
                "--train-libs fla,edgeattn,edgeattn-wy-f32g --budgets train=250", carry=[".whl"], timeout_s=400)

    python benchmarks/gpu_check.py --out DIR [--sections tests,kernels,train,decode] [--budgets train=60]
    python benchmarks/gpu_check.py --out DIR --tiny      # this CPU: tiny shapes, Triton's interpreter

Exit code 0 when every section ran to its end (failing tests and errors are results, in the files), 1 when
a section was killed or crashed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

from edgeattn.bench.args import ArgumentParser

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SECTIONS = ("tests", "kernels", "train", "decode")
# Seconds per section on an H100. Imports, Triton compiles and fla's autotuning are inside them.
BUDGETS = {"tests": 100, "kernels": 200, "train": 170, "decode": 45}
TEST_FILES = ("tests/test_kernels.py", "tests/test_kernels_aft_flash.py", "tests/test_kernels_delta.py")
# Compiles for sm80/sm90 without running anything: a CPU-side check that already runs in the slow suite.
TEST_DESELECT = (
    "tests/test_kernels_delta.py::test_new_kernels_compile_for_sm80_and_sm90_within_99_kb_of_shared_memory",
)
MiB = 2**20
KILL_GRACE = 15.0  # seconds past its budget before a section (which watches its own deadline) is killed

# The only difference between the GPU run and the CPU test.
SIZES = {
    "gpu": dict(
        tests_k=None,  # every test, slow ones too
        kernels=dict(B=8, H=16, K=128, lengths=(2048, 8192), dtype="bfloat16"),
        train=dict(d=768, layers=12, heads=6, head_dim=128, vocab=32000, batch=8, T=2048, warmup=3, steps=10),
        decode=dict(d=768, layers=12, heads=12, contexts=(128, 16384), warmup=8, steps=64, check_steps=64),
    ),
    "tiny": dict(
        tests_k="test_chunk_gates_float32 and none",
        # > 64 tokens: two chunks, one partial. float32: fla's kernels in Triton's interpreter return garbage
        # in bfloat16 (seen: a chunk_simple_gla output of 2e10 where float32 agrees with ours to 1e-7)
        kernels=dict(B=1, H=1, K=16, lengths=(80,), dtype="float32"),
        # fla's fused cross-entropy takes CUDA tensors only; its custom autograd functions autocast on CUDA
        # only (on the CPU, bfloat16 activations meet float32 weights): float32 here
        train=dict(
            autocast=None,
            d=32,
            layers=2,
            heads=2,
            head_dim=16,
            vocab=64,
            batch=1,
            T=80,
            warmup=1,
            steps=1,
            fla=dict(fuse_cross_entropy=False),
        ),
        decode=dict(d=32, layers=2, heads=2, contexts=(16, 80), warmup=1, steps=3, check_steps=4),
    ),
}


# ---- results: JSON lines, written as they come -----------------------------------------------------------


class Recorder:
    """Appends one JSON object per line to ``path`` (flushed, so a killed section keeps what it wrote)."""

    def __init__(self, path: Path, section: str):
        self.path, self.section = path, section

    def write(self, kind: str, **fields) -> dict:
        rec = {"section": self.section, "kind": kind, **fields}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        return rec


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by a kill
            continue
    return out


def say(*parts) -> None:
    print(*parts, flush=True)


class Section:
    """What a section's code gets: sizes, the recorder, the device and the time left."""

    def __init__(self, name: str, args, deadline: float):
        import torch

        self.name, self.args, self.deadline = name, args, deadline
        self.size = SIZES["tiny" if args.tiny else "gpu"]
        self.rec = Recorder(Path(args.out) / "results.jsonl", name)
        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.device = "cuda" if self.cuda else "cpu"
        self.notes: list[str] = []

    def left(self) -> float:
        return self.deadline - time.time()

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            self.rec.write("note", text=text)
            say(f"[{self.name}] note: {text}")

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def item(self, what: str, fn, *, need: float = 0.0):
        """Run ``fn()``; an exception becomes an "error" record (and None), too little time a "skipped" one."""
        if self.left() < need:
            self.rec.write(
                "skipped", item=what, reason=f"time budget: {self.left():.0f} s left, needs ~{need:.0f}"
            )
            say(f"[{self.name}] skipped {what}: {self.left():.0f} s left")
            return None
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 -- every failure is a result
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:500]
            self.rec.write("error", item=what, error=msg, seconds=round(time.perf_counter() - t0, 2))
            say(f"[{self.name}] ERROR in {what}: {msg}")
            traceback.print_exc(limit=6, file=sys.stdout)
            return None
        finally:
            if self.cuda:
                self.torch.cuda.empty_cache()


def rel_rms(got, ref) -> float:
    """||got - ref|| / ||ref|| over all elements, in float32 (NaN when got holds NaN)."""
    got, ref = got.detach().float(), ref.detach().float()
    return ((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def lift_fla_hopper_guard() -> str | None:
    """fla 0.6 raises in the backward of its gated chunk_bwd_dqkwg on Hopper with Triton in [3.4, 3.7.1)
    (a Triton miscompile, fla #640). Lift the guard so that fla can be timed; return the note saying so."""
    try:
        import fla.ops.common.chunk_o as chunk_o
    except ImportError:
        return None
    if (
        getattr(chunk_o, "IS_NVIDIA_HOPPER", False)
        and getattr(chunk_o, "TRITON_ABOVE_3_4_0", False)
        and not getattr(chunk_o, "TRITON_ABOVE_3_7_1", True)
    ):
        chunk_o.TRITON_ABOVE_3_7_1 = True
        return (
            "fla 0.6 refuses the backward of chunk_simple_gla / chunk_gated_delta_rule on Hopper with this "
            "Triton (< 3.7.1: a miscompile, fla #640); the guard was lifted to time it: fla's gradients there "
            "are not trusted"
        )
    return None


# ---- section: the kernel tests, compiled ------------------------------------------------------------------


def section_tests(s: Section) -> None:
    import importlib.util

    out = Path(s.args.out)
    junit = out / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", *TEST_FILES, "-v", "-rfE", "-p", "no:cacheprovider"]
    cmd += [f"--junitxml={junit}", "-o", "junit_family=xunit1"]
    k = s.args.tests_k if s.args.tests_k is not None else s.size["tests_k"]
    if k:
        cmd += ["-k", k]
    else:
        cmd += ["-m", ""]  # pyproject's addopts leave the slow cases out; here they run
    cmd += [f"--deselect={d}" for d in TEST_DESELECT]
    workers = s.args.test_workers
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", str(s.args.test_timeout)]
    env = dict(os.environ)
    if s.cuda:
        env.pop("TRITON_INTERPRET", None)  # compiled: the point of this section
    s.rec.write("tests_command", command=" ".join(cmd[1:]), triton_interpret=env.get("TRITON_INTERPRET"))
    say(f"[tests] $ {' '.join(cmd[2:])}")
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: dict[str, str] = {}  # test -> outcome from pytest -v's lines: what is left if pytest is killed

    def pump():
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            test = next((w for w in line.split() if w.startswith("tests/") and "::" in w), None)
            outcome = next((w for w in line.split() if w in VERBOSE_OUTCOMES), None)
            if test and outcome:
                seen[test] = VERBOSE_OUTCOMES[outcome]

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=max(5.0, s.left() - 10))
    except subprocess.TimeoutExpired:  # pytest and its workers, killed: the tests run so far are in `seen`
        kill_tree(proc)
        rc = None
    reader.join(timeout=5)
    seconds = round(time.perf_counter() - t0, 1)
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    if rc is None or not junit.exists():
        for test, outcome in seen.items():
            counts[outcome] += 1
            s.rec.write("test", test=test, outcome=outcome, seconds=None, message="(from pytest's output)")
    else:
        import xml.etree.ElementTree as ET

        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = "failed" if tag == "failure" else tag
                    message = (el.get("message") or el.text or "").strip().splitlines()[:1]
                    message = message[0][:300] if message else ""
                    break
            counts[outcome] += 1
            name = f"{case.get('file') or case.get('classname')}::{case.get('name')}"
            s.rec.write(
                "test", test=name, outcome=outcome, seconds=float(case.get("time") or 0), message=message
            )
    s.rec.write(
        "tests_summary",
        returncode=rc,
        seconds=seconds,
        timed_out=rc is None,
        **counts,
    )
    say(f"[tests] {counts} in {seconds} s (pytest exit {rc})")


VERBOSE_OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
                    "XFAIL": "skipped", "XPASS": "passed"}  # fmt: skip


# ---- section: kernels against fla ------------------------------------------------------------------------

# op -> (gate kind, fla function's name): the rows of the issue
KERNEL_OPS = {
    "gla": ("key", "chunk_gla"),
    "simple_gla": ("head", "chunk_simple_gla"),
    "gated_delta": ("head", "chunk_gated_delta_rule"),
    "kda": ("key", "chunk_kda"),
}
DELTA_OPS = ("gated_delta", "kda")


def kernel_impls(op: str) -> dict:
    """impl name -> fn over ``kernel_inputs(op, ...)`` (or a string saying why it is absent): edgeattn's
    "triton" and its other forms ("triton-f32g"; for the delta rules also "triton-wy", "triton-wy-f32g";
    ``FORMS``), fla's "fla", the PyTorch chunk form "torch"."""
    import kernels as kb  # benchmarks/kernels.py

    gate, _ = KERNEL_OPS[op]
    if op in ("gla", "simple_gla"):
        raw = kb.implementations(gate)
        named = {"triton": raw["triton"], "fla": raw["fla"], "torch": raw["torch"]}
    else:
        raw = kb.delta_impls(gate)
        named = {"triton": raw["delta-triton"], "fla": raw["delta-fla"], "torch": raw["delta-torch"]}
    for impl in our_impls(op)[1:]:  # the shipped "triton" first, then its other forms
        named[impl] = in_forms(named["triton"], **FORMS[impl.removeprefix("triton")])
    return named


def our_impls(op: str) -> tuple[str, ...]:
    """The impl names of edgeattn's forms of ``op``, the shipped one first."""
    return tuple("triton" + suffix for suffix, forms in FORMS.items() if "wy" not in forms or op in DELTA_OPS)


def kernel_inputs(op: str, B: int, T: int, H: int, K: int, dtype, device: str) -> tuple:
    """benchmarks/kernels.py's inputs of ``op`` (K = V), its bfloat16 tensors in ``dtype``."""
    import kernels as kb
    import torch

    gate, _ = KERNEL_OPS[op]
    if op in ("gla", "simple_gla"):
        xs = kb.make_inputs(B, T, H, K, K, gate, device=device)
    else:
        xs = kb.delta_inputs(B, T, H, H, K, K, gate, device=device)
    return tuple(x.to(dtype) if x.dtype == torch.bfloat16 else x for x in xs)


def fwd_bwd(fn, inputs, do=None):
    """One forward + backward of ``fn`` on fresh leaves of ``inputs`` with a fixed output gradient ``do``
    (default: seeded normal noise): (output, gradients of every input, do)."""
    import torch

    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    o = fn(*leaves)
    if do is None:
        gen = torch.Generator(device=o.device).manual_seed(7)
        do = torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype)
    o.backward(do)
    return o.detach(), [x.grad for x in leaves], do


def check_out_dir(out: str) -> str | None:
    """The error line when ``--out`` names something other than a folder (None when it is one or absent)."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        return f"--out {out}: exists and is not a folder"
    return None


def section_kernels(s: Section) -> None:
    import kernels as kb  # benchmarks/kernels.py: inputs, implementations, FLOP and byte models

    torch = s.torch
    z = s.size["kernels"]
    B, H, K = s.args.batch or z["B"], s.args.heads or z["H"], s.args.head_dim or z["K"]
    V = K
    dtype = getattr(torch, z["dtype"])
    lengths = [int(t) for t in s.args.lengths.split(",")] if s.args.lengths else list(z["lengths"])
    ops = [x for x in s.args.ops.split(",") if x] if s.args.ops else list(KERNEL_OPS)
    lifted = lift_fla_hopper_guard()
    if lifted:
        s.note(lifted)
    peak_tf = peak_gb = None
    if s.cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        peak_tf, peak_gb = kb.device_peaks(torch.cuda.get_device_name(), None, None)
    s.rec.write("kernels_shape", B=B, H=H, K=K, V=V, lengths=lengths, dtype=z["dtype"], peak_tflops=peak_tf,
                peak_gbs=peak_gb)  # fmt: skip

    impls_of = kernel_impls

    def inputs_of(op, T):
        return kernel_inputs(op, B, T, H, K, dtype, s.device)

    def models(op, T):
        gate, _ = KERNEL_OPS[op]
        if op in ("gla", "simple_gla"):
            return kb.flops_linear(B, T, H, K, V), kb.bytes_moved(B, T, H, K, V, gate)
        return kb.flops_delta(B, T, H, H, K, V), kb.bytes_delta(B, T, H, H, K, V, gate)

    times: dict[tuple, float] = {}

    def timed_row(op, impl, fn, inputs, T):
        ms = kb.time_fwd_bwd_any(fn, inputs)
        flops, nbytes = (
            models(op, T)
            if op != "sdpa"
            else (kb.flops_sdpa(B, T, H, K, V), kb.bytes_moved(B, T, H, K, V, "none"))
        )
        row = dict(op=op, impl=impl, T=T, ms=ms, tflops=flops / ms / 1e9, gbs=nbytes / ms / 1e6)
        fla_ms = times.get((op, "fla", T))
        if impl != "fla" and fla_ms:
            row["vs_fla"] = fla_ms / ms
        if peak_tf:
            row["tflops_pct_peak"] = 100 * row["tflops"] / peak_tf
        if peak_gb:
            row["gbs_pct_peak"] = 100 * row["gbs"] / peak_gb
        times[(op, impl, T)] = ms
        s.rec.write("kernel_time", **row)
        say(f"[kernels] {op:<12}{impl:<7}T={T:<6}{ms:9.3f} ms{row['tflops']:8.1f} TFLOP/s{row['gbs']:8.0f} GB/s"
            + (f"  fla/ours {row['vs_fla']:.2f}x" if "vs_fla" in row else ""))  # fmt: skip

    def compare(op, T, inputs, impls, impl="triton"):
        """Ours against fla on the timed inputs: the output and every gradient (one fixed output gradient)."""
        o_ref, g_ref, _ = fwd_bwd(impls["fla"], inputs)
        o, g, _ = fwd_bwd(impls[impl], inputs)
        errs = {"o": rel_rms(o, o_ref)}
        names = ["dq", "dk", "dv", "dg"] if op in ("gla", "simple_gla") else ["dq", "dk", "dv", "dbeta", "dg"]
        errs.update({n: rel_rms(a, b) for n, a, b in zip(names, g, g_ref) if a is not None and b is not None})
        worst = max(errs.values(), key=lambda e: (math.isnan(e), e))  # NaN is the worst
        s.rec.write("kernel_check", op=op, impl=impl, T=T, against="fla", rel_rms=errs, max_rel_rms=worst)
        say(f"[kernels] {op} {impl} T={T}: ours vs fla, worst relative RMS {worst:.2e} ({errs})")

    def one_op(op, T):
        impls = impls_of(op)
        inputs = inputs_of(op, T)
        if isinstance(impls["fla"], str):
            s.rec.write("error", item=f"{op} fla", error=impls["fla"])
        ours = [x for x in our_impls(op) if x in impls]
        for impl in ("fla", *ours):
            if callable(impls[impl]):
                s.item(
                    f"{op} {impl} T={T}",
                    lambda impl=impl: timed_row(op, impl, impls[impl], inputs, T),
                    need=5,
                )
        if callable(impls["fla"]):
            for impl in ours:
                s.item(
                    f"{op} {impl} check T={T}", lambda impl=impl: compare(op, T, inputs, impls, impl), need=5
                )

    def sdpa_row(T):
        sdpa = kb.implementations("head")["sdpa"]
        qkv = [x.to(dtype) for x in kb.make_inputs(B, T, H, K, V, "head", device=s.device)[:3]]
        timed_row("sdpa", "sdpa", lambda q, k, v: sdpa(q, k, v, None), qkv, T)

    def torch_row(op, T):
        fn = impls_of(op)["torch"]
        if not callable(fn):
            raise RuntimeError(fn)
        timed_row(op, "torch", fn, inputs_of(op, T), T)

    # first pass: ours, fla and SDPA at every length (shortest first); then the PyTorch chunk forms
    for T in lengths:
        for op in ops:
            s.item(f"{op} T={T}", lambda op=op, T=T: one_op(op, T), need=10)
        s.item(f"sdpa T={T}", lambda T=T: sdpa_row(T), need=5)
    for T in lengths:
        for op in ops:
            s.item(f"{op} torch T={T}", lambda op=op, T=T: torch_row(op, T), need=10)


# ---- section: training throughput ------------------------------------------------------------------------


# The kernels' forms besides the shipped one, by name suffix: "-wy" the delta rule's WY part in Triton
# (EDGEATTN_DELTA_WY=triton), "-f32g" the cumulative gates as float32 sums (EDGEATTN_GATE_SUM=float32, fla's
# form), "-wy-f32g" both. Kernel impls are "triton" + suffix, training libs "edgeattn" + suffix.
FORMS = {
    "": {},
    "-wy": {"wy": "triton"},
    "-f32g": {"gate_sum": "float32"},
    "-wy-f32g": {"wy": "triton", "gate_sum": "float32"},
}
TRAIN_LIBS = ("fla", *(f"edgeattn{suffix}" for suffix in FORMS))


@contextlib.contextmanager
def kernel_forms(wy: str | None = None, gate_sum: str | None = None):
    """The delta rule's WY part (``wy``) and the cumulative gates' form (``gate_sum``) set while inside
    (opt-in forms until timed here); a backward runs the forms its forward ran (the gate sums' form is
    read off the saved sums)."""
    from edgeattn.kernels import delta_chunk, utils

    saved = delta_chunk.WY, utils.GATE_SUM
    delta_chunk.WY = wy or delta_chunk.WY
    utils.GATE_SUM = gate_sum or utils.GATE_SUM
    try:
        yield
    finally:
        delta_chunk.WY, utils.GATE_SUM = saved


def in_forms(fn, **forms):
    """``fn`` (edgeattn's kernel) called inside ``kernel_forms(**forms)``."""

    def run(*args):
        with kernel_forms(**forms):
            return fn(*args)

    return run


def fla_configs(z: dict) -> dict:
    """model name -> fla config kwargs (model_type first) of the train section's shape."""
    common = dict(hidden_size=z["d"], num_hidden_layers=z["layers"], num_heads=z["heads"], vocab_size=z["vocab"],
                  tie_word_embeddings=True, hidden_ratio=4)  # fmt: skip
    expand = z["head_dim"] * z["heads"] / z["d"]
    return {
        "gla": dict(model_type="gla", expand_k=expand, expand_v=expand, **common),
        "gated_deltanet": dict(model_type="gated_deltanet", head_dim=z["head_dim"], expand_v=1.0, **common),
    }


def section_train(s: Section) -> None:
    import tempfile

    torch = s.torch
    import torch.nn.functional as F

    z = s.size["train"]
    if s.args.train_batch:
        z = {**z, "batch": s.args.train_batch}
    if not s.cuda:  # the CPU check runs the Triton kernels in the interpreter, as they run on CUDA
        os.environ["EDGEATTN_KERNELS"] = "triton"
    lifted = lift_fla_hopper_guard()
    if lifted:
        s.note(lifted)
    import fla.models  # noqa: F401  (registers fla's model types with transformers' Auto classes)
    from transformers import AutoConfig, AutoModelForCausalLM

    from edgeattn.convert import load_source
    from edgeattn.train.loop import TrainConfig, make_optimizer

    tcfg = TrainConfig()

    def amp():
        dtype = z.get("autocast", "bfloat16")
        return torch.autocast(s.device, dtype=getattr(torch, dtype)) if dtype else contextlib.nullcontext()

    B, T = z["batch"], z["T"]
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, z["vocab"], (B, T + 1), generator=gen) for _ in range(4)]
    fla_tps: dict[str, float] = {}

    def steps(model, loss_of, n: int) -> list[float]:
        opt = make_optimizer(model, tcfg, fused=s.cuda)
        losses = []
        for i in range(n):
            x = batches[i % len(batches)].to(s.device)
            with amp():
                loss = loss_of(model, x)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip or 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss)
        return [float(x) for x in losses]

    def edge_loss(model, x):
        logits, _ = model(x[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())

    def fla_loss(model, x):
        return model(input_ids=x[:, :-1], labels=x[:, :-1]).loss  # fla shifts the labels itself

    def measure(name: str, lib: str, model, loss_of) -> None:
        model.to(s.device).train()
        params = sum(p.numel() for p in model.parameters())
        t0 = time.perf_counter()
        steps(model, loss_of, z["warmup"])  # compiles, autotunes
        s.sync()
        warm = time.perf_counter() - t0
        if s.cuda:
            torch.cuda.reset_peak_memory_stats()
        n = z["steps"]
        if warm > 0 and z["warmup"]:  # keep the timed steps inside what is left (a warm step is no slower)
            n = max(1, min(n, int((s.left() - 10) / max(warm / z["warmup"], 1e-3))))
        t0 = time.perf_counter()
        losses = steps(model, loss_of, n)
        s.sync()
        sec = time.perf_counter() - t0
        tps = B * T * n / sec
        row = dict(model=name, lib=lib, params=params, batch=B, T=T, steps=n, seconds=sec, tokens_per_s=tps,
                   warmup_s=warm, loss_first=losses[0], loss_last=losses[-1])  # fmt: skip
        if s.cuda:
            row["peak_mib"] = torch.cuda.max_memory_allocated() / MiB
        if lib == "fla":
            fla_tps[name] = tps
        elif name in fla_tps:
            row["vs_fla"] = tps / fla_tps[name]
        s.rec.write("train", **row)
        say(f"[train] {lib:<9}{name:<15}{params / 1e6:7.1f}M {tps:12.0f} tokens/s"
            + (f"  peak {row['peak_mib']:.0f} MiB" if "peak_mib" in row else "")
            + f"  loss {losses[0]:.3f} -> {losses[-1]:.3f}")  # fmt: skip

    libs = {x.strip() for x in s.args.train_libs.split(",") if x.strip()}
    with tempfile.TemporaryDirectory(prefix="gpu_check_train_") as tmp:
        for name, kw in fla_configs(z).items():
            if s.args.models and name not in s.args.models.split(","):
                continue
            kw = dict(kw)
            d = Path(tmp) / name

            def build_fla(kw=kw, d=d):
                torch.manual_seed(0)
                cfg = AutoConfig.for_model(kw.pop("model_type"), **kw, **z.get("fla", {}))
                model = AutoModelForCausalLM.from_config(cfg)
                model.save_pretrained(d, safe_serialization=True)
                return model

            fla_model = s.item(f"{name} fla build", build_fla, need=20)
            if fla_model is None:
                continue
            # fla first: the edgeattn row then carries the ratio
            if "fla" in libs:
                s.item(
                    f"{name} fla train", lambda n=name, m=fla_model: measure(n, "fla", m, fla_loss), need=20
                )
            del fla_model
            if s.cuda:
                torch.cuda.empty_cache()
            for lib in (x for x in TRAIN_LIBS if x in libs and x != "fla"):  # the shipped form first
                edge = s.item(f"{name} {lib} import", lambda d=d: load_source(d).model, need=20)
                if edge is None:
                    continue
                with kernel_forms(**FORMS[lib.removeprefix("edgeattn")]):
                    s.item(f"{name} {lib} train", lambda n=name, m=edge, lib=lib: measure(n, lib, m, edge_loss),
                           need=20)  # fmt: skip
                del edge
                if s.cuda:
                    torch.cuda.empty_cache()


# ---- section: decode on CUDA through the torch backend ---------------------------------------------------


def decode_config(z: dict):
    from edgeattn.models import EdgeConfig

    return EdgeConfig(d_model=z["d"], n_layers=z["layers"], n_heads=z["heads"], mixer="gla")


def prepare_decode(art: Path, tiny: bool) -> int:
    """Export the decode section's model to ``art`` (CPU only), then write ``art``.json with the outcome.
    The parent runs this in the background from the start: the export (tens of seconds of tracing on the
    CPU) overlaps the GPU sections before the decode section needs it."""
    t0 = time.perf_counter()
    try:
        import torch

        from edgeattn.export import export_model
        from edgeattn.models import EdgeLM

        torch.set_num_threads(min(4, os.cpu_count() or 1))
        torch.manual_seed(0)
        model = EdgeLM(decode_config(SIZES["tiny" if tiny else "gpu"]["decode"]))
        ckpt = model.save(art.parent / "decode_ckpt")
        export_model(ckpt, art, optimize=False)
        info = dict(status="ok", params=model.num_parameters())
    except Exception as e:  # noqa: BLE001 -- reported by the decode section
        traceback.print_exc()
        info = dict(status="failed", error=f"{type(e).__name__}: {str(e).strip()[:400]}")
    info["export_s"] = round(time.perf_counter() - t0, 1)
    tmp = art.with_name(art.name + ".json.tmp")
    tmp.write_text(json.dumps(info))
    tmp.replace(art.with_name(art.name + ".json"))
    return 0


def section_decode(s: Section) -> None:
    import numpy as np

    torch = s.torch
    from edgeattn.runtimes import open_session

    z = s.size["decode"]
    rng = np.random.default_rng(0)
    art = Path(s.args.decode_artifact)
    marker = art.with_name(art.name + ".json")
    while not marker.exists() and s.left() > 15:  # the parent's background export
        time.sleep(0.5)
    if not marker.exists():
        s.rec.write("error", item="export", error="the background export did not finish within the budget")
        return
    info = json.loads(marker.read_text())
    cfg = decode_config(z)
    s.rec.write("decode_model", d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads, **info)
    if info["status"] != "ok":
        s.rec.write("error", item="export", error=info.get("error"))
        return

    def step_times(fn, n):
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    # eager steps, and the session's own CUDA graph steps (the default on CUDA; TorchSession)
    sess = s.item("open", lambda: open_session(art, backend="torch", device=s.device, cuda_graph=False))
    if sess is None:
        return
    gsess = None
    if s.cuda:
        gsess = s.item("open (CUDA graph)", lambda: open_session(art, backend="torch", device=s.device))

    def prefill_to(session, ids):
        session.reset()
        t0 = time.perf_counter()
        session.prefill(ids)
        s.sync()
        return time.perf_counter() - t0

    def rows(session, path, ctx, ids):
        prefill_s = prefill_to(session, ids)
        tok = np.array([[1]], dtype=np.int64)
        step_times(lambda: session.step(tok), z["warmup"])
        if s.cuda:
            torch.cuda.reset_peak_memory_stats()
        times = step_times(lambda: session.step(tok), z["steps"])
        row = dict(path=path, context=ctx, ms_per_token=float(np.median(times)), ms_min=min(times),
                   prefill_s=prefill_s, steps=len(times))  # fmt: skip
        if s.cuda:
            row["allocated_mib"] = torch.cuda.memory_allocated() / MiB
            row["peak_mib"] = torch.cuda.max_memory_allocated() / MiB
        s.rec.write("decode", **row)
        say(f"[decode] {path:<34} ctx={ctx:<6}{row['ms_per_token']:8.3f} ms/token"
            + (f"  allocated {row['allocated_mib']:.1f} MiB, peak {row['peak_mib']:.1f}" if s.cuda else ""))  # fmt: skip

    def check_graph(ctx, ids):
        """Greedy decoding from the same prompt, the graph session against the eager one: every step's
        logits and token."""
        n = z["check_steps"]
        logs = {}
        for name, session in (("eager", sess), ("graph", gsess)):
            prefill_to(session, ids)
            tok, out = np.array([[1]], dtype=np.int64), []
            for _ in range(n):
                logits = session.step(tok)
                out.append(logits)
                tok = np.array([[int(logits[0].argmax())]], dtype=np.int64)
            logs[name] = np.stack(out)
        diff = float(np.abs(logs["graph"] - logs["eager"]).max())
        same = int((logs["graph"].argmax(-1) == logs["eager"].argmax(-1)).all(-1).sum())
        captured = not isinstance(gsess._graph, str) and gsess._graph is not None
        s.rec.write("decode_check", context=ctx, steps=n, max_abs_diff=diff, same_tokens=same, captured=captured,
                    capture_error=gsess._graph if isinstance(gsess._graph, str) else None)  # fmt: skip
        say(
            f"[decode] graph vs eager ctx={ctx}: {same}/{n} tokens the same, max |logits diff| {diff:.1e}"
            + ("" if captured else f" (not captured: {gsess._graph})")
        )

    for ctx in z["contexts"]:
        ids = rng.integers(0, cfg.vocab_size, size=(1, ctx)).astype(np.int64)
        if s.item(f"decode ctx={ctx}", lambda ctx=ctx, ids=ids: rows(sess, "torch backend (eager)", ctx, ids) or True,
                  need=10) and gsess is not None:  # fmt: skip
            s.item(f"CUDA graph check ctx={ctx}", lambda ctx=ctx, ids=ids: check_graph(ctx, ids), need=5)
            s.item(f"CUDA graph ctx={ctx}",
                   lambda ctx=ctx, ids=ids: rows(gsess, "torch backend (CUDA graph, default)", ctx, ids), need=5)  # fmt: skip
    if not s.cuda:
        s.rec.write("skipped", item="CUDA graph", reason="no CUDA device")


SECTION_FNS = {
    "tests": section_tests,
    "kernels": section_kernels,
    "train": section_train,
    "decode": section_decode,
}


# ---- the parent: environment, sections in subprocesses, the report ---------------------------------------


def environment(tiny: bool) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    env = dict(
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        python=platform.python_version(),
        torch=ver("torch"),
        triton=ver("triton"),
        fla_core=ver("fla-core"),
        flash_linear_attention=ver("flash-linear-attention"),
        transformers=ver("transformers"),
        tiny=tiny,
        triton_interpret=os.environ.get("TRITON_INTERPRET"),
        load=" ".join(f"{x:.2f}" for x in os.getloadavg()),
        cpus=os.cpu_count(),
    )
    try:
        q = "name,driver_version,memory.total"
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20)  # fmt: skip
        if smi.returncode == 0 and smi.stdout.strip():
            env["gpu"], env["driver"], env["gpu_memory"] = [
                x.strip() for x in smi.stdout.splitlines()[0].split(",")
            ]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        import torch

        env["cuda"] = torch.version.cuda
    except ImportError:
        pass
    try:
        cpu = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name"))
        env["cpu"] = cpu.split(":", 1)[1].strip()
    except (OSError, StopIteration):
        pass
    return env


def run_section(name: str, args, budget: float, log) -> dict:
    """Run one section in a child process (its own process group), its output teed to ``log``; kill it at
    ``budget`` seconds. Returns the section's status record."""
    cmd = [
        sys.executable,
        __file__,
        "--section",
        name,
        "--deadline",
        str(time.time() + budget),
        *args.passthrough,
    ]
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = _pythonpath()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip

    def pump():
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
            log.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        rc = proc.wait(timeout=budget + KILL_GRACE)  # the child watches its deadline; this is the backstop
        status = "ok" if rc == 0 else f"crashed (exit {rc})"
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        status = "timed out (killed)"
    reader.join(timeout=5)
    return {"section": name, "kind": "section", "status": status, "seconds": round(time.perf_counter() - t0, 1),
            "budget_s": budget}  # fmt: skip


def kill_tree(proc: subprocess.Popen) -> None:
    """Kill ``proc`` and every process under it (a section's pytest and its xdist workers)."""
    import psutil

    try:
        procs = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def markdown(records: list[dict]) -> str:
    by = lambda kind: [r for r in records if r.get("kind") == kind]  # noqa: E731
    lines = ["# edgeattn GPU check (benchmarks/gpu_check.py)", ""]
    for env in by("env"):
        keys = ("gpu", "driver", "gpu_memory", "cuda", "torch", "triton", "fla_core", "transformers", "python",
                "cpu", "cpus", "load", "date", "tiny")  # fmt: skip
        lines.append("; ".join(f"{k} {env[k]}" for k in keys if env.get(k) not in (None, "")))
        lines.append("")
    lines += ["| section | status | seconds | budget s |", "|---|---|---|---|"]
    lines += [f"| {r['section']} | {r['status']} | {r['seconds']} | {r['budget_s']} |" for r in by("section")]
    pre = by("precompile")
    if pre:
        done = sum(len(r["done"]) for r in pre)
        lines += ["", f"**precompile** (our kernels, in {len(pre)} background processes before the kernels section): "
                  f"{done} of {sum(len(r['jobs']) for r in pre)} op forms compiled in at most "
                  f"{max(r['seconds'] for r in pre)} s"]  # fmt: skip
    for r in by("tests_summary"):
        lines += ["", f"**tests** (compiled unless TRITON_INTERPRET): {r['passed']} passed, {r['failed']} failed, "
                  f"{r['error']} errors, {r['skipped']} skipped in {r['seconds']} s"
                  + (" (pytest killed at the budget)" if r.get("timed_out") else "")]  # fmt: skip
        bad = [t for t in by("test") if t["outcome"] in ("failed", "error")]
        lines += [f"- {t['outcome']}: `{t['test']}`: {t['message']}" for t in bad[:40]]
    rows = by("kernel_time")
    if rows:
        checks = {(c["op"], c.get("impl", "triton"), c["T"]): c["max_rel_rms"] for c in by("kernel_check")}
        lines += ["", "**kernels**, forward + backward, bfloat16 "
                  + "".join(f"B={r['B']}, H={r['H']}, K=V={r['K']}" for r in by("kernels_shape")[:1])
                  + "; vs fla = fla ms / ms (> 1: faster than fla); check = worst relative RMS of ours vs fla "
                  "(output and every gradient, same inputs)", "",
                  "| op | impl | T | ms | TFLOP/s | GB/s | vs fla | check |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            chk = checks.get((r["op"], r["impl"], r["T"]))
            lines.append(f"| {r['op']} | {r['impl']} | {r['T']} | {r['ms']:.3f} | {r['tflops']:.1f} | {r['gbs']:.0f} "
                         f"| {fmt(r.get('vs_fla'))} | {fmt(chk, '.1e')} |")  # fmt: skip
        fastest: dict[tuple, dict] = {}  # (op, T) -> the fastest of our forms' rows
        for r in rows:
            if (
                r["impl"].startswith("triton")
                and r["ms"] < fastest.get((r["op"], r["T"]), {"ms": math.inf})["ms"]
            ):
                fastest[(r["op"], r["T"])] = r
        if fastest:
            shipped = {(r["op"], r["T"]): r["ms"] for r in rows if r["impl"] == "triton"}
            lines += ["", "**the fastest form of ours** per op and length (what a default could be; its check "
                      "against fla is in the table above)", "",
                      "| op | T | fastest | ms | vs fla | vs shipped |", "|---|---|---|---|---|---|"]  # fmt: skip
            for (op, T), r in fastest.items():
                vs = shipped[(op, T)] / r["ms"] if (op, T) in shipped else None
                lines.append(
                    f"| {op} | {T} | {r['impl']} | {r['ms']:.3f} | {fmt(r.get('vs_fla'))} | {fmt(vs)} |"
                )
    rows = by("train")
    if rows:
        lines += ["", "**train**, bfloat16 autocast, tokens/s over the timed steps; vs fla = ours / fla's", "",
                  "| model | lib | params M | batch x T | tokens/s | peak MiB | vs fla | loss first -> last |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            lines.append(f"| {r['model']} | {r['lib']} | {r['params'] / 1e6:.1f} | {r['batch']} x {r['T']} "
                         f"| {r['tokens_per_s']:.0f} | {fmt(r.get('peak_mib'), '.0f')} | {fmt(r.get('vs_fla'))} "
                         f"| {r['loss_first']:.3f} -> {r['loss_last']:.3f} |")  # fmt: skip
    rows = by("decode")
    if rows:
        m = by("decode_model")
        lines += ["", "**decode**, GLA " + (f"{m[0]['params'] / 1e6:.1f}M" if m else "") + ", batch 1, fp32, "
                  "median ms/token (the logits copied to the host each step)", "",
                  "| path | context | ms/token | allocated MiB | peak MiB |", "|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            lines.append(f"| {r['path']} | {r['context']} | {r['ms_per_token']:.3f} | {fmt(r.get('allocated_mib'), '.1f')} "
                         f"| {fmt(r.get('peak_mib'), '.1f')} |")  # fmt: skip
        for r in by("decode_check"):
            lines.append(f"- CUDA graph against eager at {r['context']} tokens: {r['same_tokens']}/{r['steps']} greedy "
                         f"tokens the same, max |logits diff| {r['max_abs_diff']:.1e}"
                         + ("" if r["captured"] else f"; NOT captured: {r['capture_error']}"))  # fmt: skip
    other = [r for r in records if r.get("kind") in ("error", "skipped", "note")]
    if other:
        lines += ["", "**errors, skips and notes**", ""]
        for r in other:
            text = r.get("error") or r.get("reason") or r.get("text")
            lines.append(
                f"- {r['section']} {r['kind']}" + (f" ({r['item']})" if r.get("item") else "") + f": {text}"
            )
    return "\n".join(lines) + "\n"


def parse_budgets(text: str | None) -> dict[str, float]:
    budgets = dict(BUDGETS)
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, _, value = part.partition("=")
        if name.strip() not in SECTIONS:
            raise ValueError(f"--budgets: unknown section {name.strip()!r}; expected {', '.join(SECTIONS)}")
        try:
            budgets[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--budgets: {part.strip()!r} is not SECTION=SECONDS") from None
    return budgets


def build_parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-check", help="output folder ($OUT)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes: the CPU check (Triton's interpreter)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, in this order")
    ap.add_argument("--budgets", default=None, help="SECTION=SECONDS,... over the defaults " + str(BUDGETS))
    ap.add_argument("--tests-k", default=None, help="tests: a pytest -k expression (default: all on a GPU)")
    ap.add_argument("--test-workers", type=int, default=8, help="tests: pytest-xdist workers when installed")
    ap.add_argument("--test-timeout", type=int, default=120, help="tests: seconds per test (pytest-timeout)")
    ap.add_argument("--lengths", default=None, help="kernels: T values (default 2048,8192)")
    ap.add_argument("--batch", type=int, default=None, help="kernels: B (default 8)")
    ap.add_argument("--heads", type=int, default=None, help="kernels: H (default 16)")
    ap.add_argument("--head-dim", type=int, default=None, help="kernels: K = V (default 128)")
    ap.add_argument("--ops", default=None, help="kernels: some of " + ",".join(KERNEL_OPS))
    ap.add_argument("--models", default=None, help="train: gla and/or gated_deltanet")
    ap.add_argument("--train-batch", type=int, default=None, help="train: sequences per step (default 8)")
    ap.add_argument("--train-libs", default="fla,edgeattn",
                    help=f"train: some of {', '.join(TRAIN_LIBS)} (FORMS; default fla,edgeattn)")  # fmt: skip
    ap.add_argument(
        "--fla-autotune-configs",
        type=int,
        default=4,
        help="kernels, train: configs each autotuned (fla) kernel tries, 0 for all (default 4)",
    )
    ap.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child: run this section
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--decode-artifact", default=None, help=argparse.SUPPRESS)  # the background export's
    ap.add_argument("--prepare-decode", default=None, help=argparse.SUPPRESS)  # run that export, to this path
    ap.add_argument("--precompile", choices=("auto", "on", "off"), default="auto",
                    help="kernels: compile our kernels in background processes from the start (auto: on a GPU)")  # fmt: skip
    ap.add_argument("--child-precompile", default=None, help=argparse.SUPPRESS)  # OP:IMPL, one background job
    return ap


def pick_configs(configs: list, n: int) -> list:
    """At most ``n`` of an autotuner's configs: those with num_warps nearest 4 first, in their order."""
    if n <= 0 or len(configs) <= n:
        return list(configs)
    order = sorted(range(len(configs)), key=lambda i: (abs(math.log2(max(1, configs[i].num_warps)) - 2), i))
    return [configs[i] for i in sorted(order[:n])]


def cap_autotune(n: int) -> str | None:
    """Every Triton autotuner (fla's) tries at most ``n`` of the configs left after its own pruning.
    Compiling fla 0.6's full lists (up to 24 configs a kernel) took the whole kernels section's budget
    on an H100 before a single timing; edgeattn's kernels are not autotuned. Capping the lists before
    fla's ``early_config_prune`` left some kernels none (an H100 run): the cap comes after it. Returns
    the note."""
    if n <= 0:
        return None
    from triton.runtime import autotuner

    prune = autotuner.Autotuner.prune_configs
    if getattr(prune, "_capped", None) == n:
        return None

    def capped(self, *a, **kw):
        return pick_configs(prune(self, *a, **kw), n)

    capped._capped = n
    autotuner.Autotuner.prune_configs = capped
    return (f"fla's autotuning limited to {n} configs a kernel after its own pruning (those with num_warps "
            "nearest 4) so that it compiles within the section's budget; edgeattn's kernels have fixed "
            "configs")  # fmt: skip


def child(args) -> int:
    if args.section in ("kernels", "train") and os.environ.get("TRITON_INTERPRET") != "1" and _has_cuda():
        capped = cap_autotune(args.fla_autotune_configs)
    else:
        capped = None
    if os.environ.get("TRITON_INTERPRET") == "1":
        # fla's autotuned kernels keep their first config; its range() loop variables become tensors
        sys.path.insert(0, str(ROOT / "scripts"))
        from make_fla_fixtures import patch_triton_for_cpu

        patch_triton_for_cpu()
    s = Section(args.section, args, args.deadline or time.time() + BUDGETS[args.section])
    say(f"[{s.name}] start on {s.device}, {s.left():.0f} s budget")
    if capped:
        s.note(capped)
    try:
        SECTION_FNS[args.section](s)
    except Exception as e:  # noqa: BLE001 -- the section's own setup failed (an import, say)
        s.rec.write("error", item="section", error=f"{type(e).__name__}: {str(e).strip()[:400]}")
        traceback.print_exc(limit=8, file=sys.stdout)
    say(f"[{s.name}] done, {s.left():.0f} s of the budget left")
    return 0


def _pythonpath() -> str:
    """This checkout first (its edgeattn, not an installed one), then what PYTHONPATH held."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Our kernels' compile time counted inside the kernels section (fla's too): on the H200, 173 of its 200 s went by
# with 4 ops. Compiled in background processes from the start instead (Triton's on-disk cache is shared),
# while the tests section runs; at T = 256 (T is a runtime argument, specialised only on its
# divisibility by 16, as 2048 and 8192 are) and B = 1, the section's H and K.
PRECOMPILE_T = 256
PRECOMPILE_WAIT = 90  # seconds the kernels section waits for them at most (not counted in its budget)
PRECOMPILE_WORKERS = 4


def precompile_jobs(args) -> list[str]:
    """OP:IMPL of every form of ours the kernels section will time."""
    ops = [x for x in args.ops.split(",") if x] if args.ops else list(KERNEL_OPS)
    return [f"{op}:{impl}" for op in ops for impl in our_impls(op)]


def child_precompile(args) -> int:
    """One forward + backward of each OP:IMPL of ``args.child_precompile`` (comma-separated) at the kernels
    section's H and K, one after another."""
    import torch

    z = SIZES["tiny" if args.tiny else "gpu"]["kernels"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    H, K = args.heads or z["H"], args.head_dim or z["K"]
    T = z["lengths"][0] if args.tiny else PRECOMPILE_T
    for spec in args.child_precompile.split(","):
        op, impl = spec.split(":")
        t0 = time.time()
        fwd_bwd(kernel_impls(op)[impl], kernel_inputs(op, 1, T, H, K, getattr(torch, z["dtype"]), device))
        if device == "cuda":
            torch.cuda.synchronize()
        say(f"precompiled {spec} in {time.time() - t0:.1f} s")
    return 0


def start_precompile(args, work: Path) -> list[tuple[str, subprocess.Popen, float]]:
    """The background compile jobs, started now: PRECOMPILE_WORKERS processes (while the tests section's
    own workers run), the op-form pairs dealt out among them."""
    env = {**os.environ, "PYTHONPATH": _pythonpath()}
    specs = precompile_jobs(args)
    jobs = []
    for i in range(min(PRECOMPILE_WORKERS, len(specs))):
        mine = ",".join(specs[i::PRECOMPILE_WORKERS])
        cmd = [sys.executable, __file__, "--child-precompile", mine, *(["--tiny"] if args.tiny else [])]
        cmd += [f"--{k}={v}" for k, v in (("heads", args.heads), ("head-dim", args.head_dim)) if v]
        with open(work / f"precompile_{i}.log", "w") as plog:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=plog, stderr=subprocess.STDOUT)
        jobs.append((mine, proc, time.time()))
    return jobs


def finish_precompile(jobs, work: Path, rec, wait_s: float) -> None:
    """Wait up to ``wait_s`` for the background compiles (the kernels section compiles what is left itself),
    record each worker's outcome, and stop the rest."""
    deadline = time.time() + wait_s
    for i, (specs, proc, t0) in enumerate(jobs):
        try:
            rc = proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
        text = (work / f"precompile_{i}.log").read_text()
        done = [ln.split()[1] for ln in text.splitlines() if ln.startswith("precompiled ")]
        tail = text.strip().splitlines()[-1:] if rc else []
        rec.write("precompile", jobs=specs.split(","), done=done, rc=rc, seconds=round(time.time() - t0, 1),
                  tail=[t[-300:] for t in tail])  # fmt: skip
        say(f"gpu_check: precompile {specs}: {len(done)} done, " + ("stopped" if rc is None else f"rc {rc}")
            + (f" ({tail[0][-200:]})" if tail else ""))  # fmt: skip


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.prepare_decode is not None:
        return prepare_decode(Path(args.prepare_decode), args.tiny)
    if args.section is not None:
        return child(args)
    if args.child_precompile is not None:
        return child_precompile(args)
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    bad = [x for x in sections if x not in SECTIONS]
    if bad or not sections:
        ap.error(f"--sections: unknown {bad}; expected some of {', '.join(SECTIONS)}")
    if bad_out := check_out_dir(args.out):
        ap.error(bad_out)
    libs = {x.strip() for x in args.train_libs.split(",") if x.strip()}
    if not libs or libs - set(TRAIN_LIBS):
        ap.error(f"--train-libs: expected some of {', '.join(TRAIN_LIBS)}, got {args.train_libs!r}")
    try:
        budgets = parse_budgets(args.budgets)
    except ValueError as e:
        ap.error(str(e))
    cuda = _has_cuda()
    if not args.tiny and not cuda:
        ap.error(
            "no CUDA device here; run it on a GPU, or with --tiny (tiny shapes, Triton's interpreter) on a CPU"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("results.jsonl", "results.md", "gpu_check.log", "junit.xml"):
        (out / name).unlink(missing_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    art = work / "decode_art"
    args.passthrough = [*(argv if argv is not None else sys.argv[1:]), "--decode-artifact", str(art)]
    if not cuda:  # the children run Triton's interpreter (set before anything imports triton)
        os.environ["TRITON_INTERPRET"] = "1"
    env = environment(args.tiny)
    Recorder(out / "results.jsonl", "env").write("env", **env)
    say("gpu_check: " + json.dumps(env))
    statuses, prep, pre = [], None, []
    try:
        if "kernels" in sections and (args.precompile == "on" or (args.precompile == "auto" and cuda)):
            pre = start_precompile(args, work)
        if "decode" in sections:  # the export runs on the CPU while the GPU sections run
            cmd = [sys.executable, __file__, "--prepare-decode", str(art), *(["--tiny"] if args.tiny else [])]
            penv = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": _pythonpath()}
            with open(work / "decode_export.log", "w") as plog:
                prep = subprocess.Popen(cmd, cwd=ROOT, env=penv, stdout=plog, stderr=subprocess.STDOUT)
        with open(out / "gpu_check.log", "w") as log:
            for name in sections:
                if name == "kernels" and pre:
                    finish_precompile(pre, work, Recorder(out / "results.jsonl", "kernels"), PRECOMPILE_WAIT)
                    pre = []
                say(f"== {name} (budget {budgets[name]:.0f} s) ==")
                st = run_section(name, args, budgets[name], log)
                Recorder(out / "results.jsonl", name).write(**{k: v for k, v in st.items() if k != "section"})
                statuses.append(st)
                say(f"== {name}: {st['status']} in {st['seconds']} s ==")
            if prep is not None and (work / "decode_export.log").exists():
                log.write("---- the decode section's background export ----\n")
                log.write((work / "decode_export.log").read_text()[-20000:])
    finally:
        for _, proc, _ in pre:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if prep is not None and prep.poll() is None:
            prep.kill()
            prep.wait()
        shutil.rmtree(work, ignore_errors=True)
    md = markdown(read_records(out / "results.jsonl"))
    (out / "results.md").write_text(md)
    say("\n" + md)
    return 0 if all(st["status"] == "ok" for st in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
