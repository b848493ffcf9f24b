"""Peak memory and wall time of `edgeattn export HF_DIR`, stage by stage.

What it measures: one `edgeattn export HF_DIR --out OUT --precision P --no-checkpoint` of a transformers
Qwen3.5 model with random weights (the published Qwen3.5-0.8B text shape, ``benchmarks/imported.py``'s
``FULL``; ``--quick``: its tiny ``QUICK``), in a fresh process, its resident memory (RSS) sampled every
``--interval`` s. The child process wraps the export's stage functions (those of the code it runs: the
converter, tracing, the ONNX passes, precision, weight sharing, the manifest) so that it logs when each
starts; each RSS sample is counted to the stage running at its time. Why: the export of a 3 GB model
should peak near twice its fp32 weight bytes (the torch model and the ONNX graph), not more.

    python benchmarks/export_memory.py [--precision int4] [--workdir DIR] [--quick]

Prints a table (stage, first start, seconds, peak RSS in the stage) and ends with ONE JSON line:
``{"peak_rss_mib", "ru_maxrss_mib", "wall_s", "weights_fp32_mib", "stages": {...}}``. ``ru_maxrss`` is the
kernel's peak of the child (exact); the sampled peak may miss a short spike. Run it on a quiet machine: the
0.8B export holds several GiB.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Stage functions wrapped in the child (module, attribute path); absent ones are skipped, so the script
# measures the code before and after a refactoring alike.
STAGES = [
    ("edgeattn.convert", "convert_dir"),  # the converter (Hugging Face tensors -> EdgeLM)
    ("edgeattn.convert", "import_model"),  # before issue 21: a temporary checkpoint on disk
    ("edgeattn.convert", "Source.write_checkpoint"),  # after: the checkpoint written inside the artifact
    ("edgeattn.models.lm", "EdgeLM.load"),
    ("edgeattn.models.lm", "EdgeLM.save"),
    ("edgeattn.export.exporter", "_torch_logits"),  # the precision check's reference (torch model)
    ("edgeattn.export.exporter", "_export_graph"),  # torch.onnx.export of one graph
    ("edgeattn.export.exporter", "_write_weights"),  # the real weights into torch's placeholder files
    ("edgeattn.export.exporter", "_load_trace"),  # the traced graph into memory
    ("edgeattn.export.exporter", "_finish_graph"),  # before: optional inputs, optimizer, tied embedding
    ("edgeattn.export.exporter", "_graph_passes"),  # after: the same, in memory
    ("edgeattn.export.exporter", "_spill"),  # after: the passed graph through a scratch file
    ("edgeattn.export.precision", "convert_precision"),
    ("edgeattn.export.precision", "quantize_nbits"),
    ("edgeattn.export.precision", "graph_logits"),  # after: the converted graph's check logits
    ("edgeattn.export.precision", "logit_error"),  # before: the two sessions of the check
    ("edgeattn.export.weights", "share_weights"),  # before: weights.bin from the graph files
    ("edgeattn.export.package", "Package.graph"),  # after: a graph into weights.bin and its file
    ("edgeattn.export.package", "Package.manifest"),
    ("edgeattn.export.manifest", "write_manifest"),
    ("edgeattn.artifact.manifest", "write_manifest"),
]


def child(log: str, args: list[str]) -> None:
    """Run the CLI with each stage function wrapped to append ``time name`` to ``log``."""
    import functools

    f = open(log, "a", buffering=1)

    def wrap(fn, name):
        @functools.wraps(fn)
        def inner(*a, **k):
            f.write(f"{time.time()} {name}\n")
            try:
                return fn(*a, **k)
            finally:
                f.write(f"{time.time()} after {name}\n")

        return inner

    for mod, attr in STAGES:
        try:
            m = importlib.import_module(mod)
        except ImportError:
            continue
        owner, *rest = attr.split(".")
        obj = getattr(m, owner, None)
        if obj is None:
            continue
        if rest:
            fn = obj.__dict__.get(rest[0])
            if fn is None:
                continue
            is_cm = isinstance(fn, classmethod)
            target = fn.__func__ if is_cm else fn
            w = wrap(target, attr)
            setattr(obj, rest[0], classmethod(w) if is_cm else w)
        else:
            setattr(m, owner, wrap(obj, attr))
            # modules that imported the name before the wrap keep the original: patch them too
            for other in list(sys.modules.values()):
                if (
                    getattr(other, "__name__", "").startswith("edgeattn")
                    and getattr(other, owner, None) is obj
                ):
                    setattr(other, owner, wrap(obj, attr))
    from edgeattn.cli.main import app

    app(args, standalone_mode=True)


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except FileNotFoundError:
        pass
    return 0


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precision", default="int4")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/edgeattn-export-memory"))
    ap.add_argument("--quick", action="store_true", help="the tiny shape (seconds)")
    ap.add_argument("--layers", type=int, help="the published shape with this many layers (a smaller model)")
    ap.add_argument("--interval", type=float, default=0.05)
    ap.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1:])
        return
    import imported

    shape = dict(imported.QUICK if a.quick else imported.FULL)
    label = "quick" if a.quick else "full"
    if a.layers:
        shape["num_hidden_layers"], label = a.layers, f"{label}-{a.layers}-layers"
    root = a.workdir / label
    root.mkdir(parents=True, exist_ok=True)
    hf, params = imported.build_hf(root, shape, 4096)
    out, log = root / f"out-{a.precision}", root / "stages.log"
    log.write_text("")
    cmd = [sys.executable, __file__, "--child", str(log), "export", str(hf), "--out", str(out)]
    cmd += ["--precision", a.precision, "--no-checkpoint", "--force"]
    samples = []
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    while proc.poll() is None:
        samples.append((time.time(), rss_kib(proc.pid)))
        time.sleep(a.interval)
    wall = time.time() - t0
    output = proc.stdout.read()
    if proc.returncode != 0:
        sys.exit(f"error: the export failed (exit {proc.returncode}): {output.strip().splitlines()[-1:]}")
    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    events = [(float(t), n) for t, n in (line.split(" ", 1) for line in log.read_text().split("\n") if line)]
    # the stage running at time t: the innermost one entered and not yet left
    stages: dict[str, dict] = {}

    def stage_at(t: float) -> str:
        stack, seen = [], False
        for te, name in events:
            if te > t:
                break
            seen = True
            if name.startswith("after "):
                if name[6:] in stack:
                    stack.remove(name[6:])
            else:
                stack.append(name)
        return stack[-1] if stack else ("between stages" if seen else "startup (imports, CLI)")

    for t, kib in samples:
        s = stages.setdefault(stage_at(t), {"first_s": round(t - t0, 2), "seconds": 0.0, "peak_rss_mib": 0.0})
        s["seconds"] = round(s["seconds"] + a.interval, 2)
        s["peak_rss_mib"] = max(s["peak_rss_mib"], round(kib / 1024, 1))
    weights_mib = params * 4 / 2**20
    print(
        f"export {a.precision} of {label} ({params / 1e6:.0f} M parameters, "
        f"{weights_mib:.0f} MiB fp32), load {os.getloadavg()[0]:.2f}"
    )
    print(f"| {'stage':40s} | start s | seconds | peak RSS MiB |")
    print(f"|{'-' * 42}|---------|---------|--------------|")
    for name, s in sorted(stages.items(), key=lambda kv: kv[1]["first_s"]):
        print(f"| {name:40s} | {s['first_s']:7.1f} | {s['seconds']:7.1f} | {s['peak_rss_mib']:12.0f} |")
    peak = max((kib for _, kib in samples), default=0) / 1024
    print(
        f"peak RSS {peak:.0f} MiB sampled, {maxrss / 1024:.0f} MiB ru_maxrss "
        f"({maxrss / 1024 / weights_mib:.2f}x the fp32 weights), wall {wall:.1f} s"
    )
    print(
        json.dumps(
            with_cpu(
                {
                    "precision": a.precision,
                    "shape": label,
                    "peak_rss_mib": round(peak, 1),
                    "ru_maxrss_mib": round(maxrss / 1024, 1),
                    "weights_fp32_mib": round(weights_mib, 1),
                    "wall_s": round(wall, 1),
                    "loadavg": os.getloadavg()[0],
                    "stages": stages,
                }
            )
        )
    )


if __name__ == "__main__":
    main()
