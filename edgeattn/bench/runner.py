"""Run a benchmark: every (artifact, backend) configuration in worker processes, repeats round-robin.

    settings = Settings(backends=["onnxruntime"], contexts=[128, 4096])
    doc = run(load_targets(["art/gla", "art/softmax"]), settings)

The returned document is what ``results.json`` holds (``edgeattn.bench.schema``): the machine, the theory
of each artifact next to its measurements, and every measured figure as a stat over the repeats.
Repeat r runs the configurations in the order rotated by r, so slow drift of the machine (heat, other
load) does not always land on the same configuration. Base install only: no torch in this process.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from edgeattn.artifact.manifest import Manifest
from edgeattn.bench import machine, schema, theory

BACKENDS = ("onnxruntime", "torch", "tensorrt")


@dataclass
class Settings:
    backends: list[str]
    contexts: list[int]
    repeats: int = 3
    steps: int = 128  # timed single steps at each context
    warmup: int = 16  # untimed steps after loading
    threads: int | None = None
    prefill_tokens: int = 1024  # prefill throughput: tokens through the prefill graph from an empty state
    step_tokens: int = 256  # ... and through single steps
    eval_text: Path | None = None
    eval_bytes: int = 8192
    bandwidth_mib: int = 512  # array size of the read-bandwidth measurement
    worker_timeout_s: float | None = None


@dataclass
class Target:
    name: str
    artifact: Path
    manifest: Manifest = field(repr=False)


class WorkerError(RuntimeError):
    pass


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma-separated list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return sorted(set(values))


def parse_backends(text: str) -> list[str]:
    """Comma list -> backend names, refusing unknown ones and ones this machine lacks (one-line errors)."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise ValueError("--backend needs at least one backend")
    for name in names:
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
        if name == "torch" and importlib.util.find_spec("torch") is None:
            raise ValueError(
                "backend 'torch' needs PyTorch, which is not installed: pip install 'edgeattn[train]'"
            )
        if name == "tensorrt":
            if importlib.util.find_spec("tensorrt") is None:
                raise ValueError(
                    "backend 'tensorrt' is not installed here: pip install 'edgeattn[tensorrt]' "
                    "(NVIDIA GPU or Jetson with JetPack 6)"
                )
            if importlib.util.find_spec("edgeattn.runtimes.tensorrt") is None:
                raise ValueError("this edgeattn has no TensorRT runtime (edgeattn.runtimes.tensorrt)")
    return names


def load_targets(paths: list[Path]) -> list[Target]:
    """Verify every artifact (manifest and file hashes) before anything runs; names are directory names."""
    targets = []
    for p in paths:
        m = Manifest.load(p)  # ValueError with one line for anything that is not a valid artifact
        targets.append(Target(Path(p).name or str(p), Path(p), m))
    seen: dict[str, int] = {}
    for t in targets:  # two artifacts called "gla" in different folders keep their paths apart
        seen[t.name] = seen.get(t.name, 0) + 1
    for t in targets:
        if seen[t.name] > 1:
            t.name = str(t.artifact)
    return targets


def run_worker(cfg: dict, timeout: float | None = None) -> dict:
    """Run ``python -m edgeattn.bench.worker`` on one configuration; its JSON result or WorkerError."""
    cmd = [sys.executable, "-m", "edgeattn.bench.worker", "--json", json.dumps(cfg)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise WorkerError(f"{cfg['artifact']} on {cfg['backend']}: no result within {timeout:g} s") from None
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        why = next((ln.removeprefix("error: ") for ln in reversed(lines) if ln.startswith("error: ")), None)
        why = why or (lines[-1] if lines else f"exit code {proc.returncode}")
        raise WorkerError(f"{cfg['artifact']} on {cfg['backend']}: {why}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def stat(values) -> dict | None:
    """Median and spread (min, max) over repeats; None when nothing was measured."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return {"median": float(np.median(vals)), "min": min(vals), "max": max(vals), "values": vals}


def _worker_config(t: Target, backend: str, s: Settings, repeat: int) -> dict:
    return {
        "task": "bench",
        "artifact": str(t.artifact),
        "backend": backend,
        "threads": s.threads,
        "contexts": s.contexts,
        "steps": s.steps,
        "warmup": s.warmup,
        "prefill_tokens": s.prefill_tokens,
        "step_tokens": s.step_tokens,
        "seed": repeat,
    }


def aggregate(
    t: Target, backend: str, runs: list[dict], errors: list[str], s: Settings, mach: dict, bpb: dict | None
) -> dict:
    m = t.manifest
    cost = theory.cost(m)
    rows = [cost.at(c, mach["bandwidth_bytes_per_s"], mach["matmul_flops_per_s"]) for c in s.contexts]
    contexts = []
    for c, th in zip(s.contexts, rows):
        got = [next(x for x in r["contexts"] if x["context"] == c) for r in runs]
        done = [x for x in got if not x["skipped"]]
        if not done:
            reason = got[0]["skipped"] if got else "failed (the error is listed below the tables)"
            contexts.append({"context": c, "skipped": reason})
            continue
        lat = {q: stat(x["latency_s"][q] for x in done) for q in ("p50", "p90", "p99", "mean")}
        entry = {
            "context": c,
            "skipped": None,
            "tokens": int(done[0]["tokens"]),
            "latency_s": lat,
            "floor_s": th["floor_s"],
            "floor_multiple": stat(x["latency_s"]["p50"] / th["floor_s"] for x in done),
            "rss_bytes": stat(x["rss_bytes"] for x in done),
            "peak_rss_bytes": stat(x["peak_rss_bytes"] for x in done),
            "device_bytes": stat(x.get("device_bytes") for x in done),
        }
        contexts.append(entry)
    mixer = theory.family(m)
    return {
        "name": t.name,
        "artifact": str(t.artifact),
        "backend": backend,
        "device": runs[0]["device"] if runs else None,
        "mixer": mixer,
        "mixers": theory.layer_mixers(m),
        "target": m.target,
        "precision": m.precision,
        "params": cost.params,
        "weight_bytes": cost.weight_bytes,
        "artifact_bytes": theory.artifact_bytes(m),
        "max_length": m.max_length,
        "prefill_chunk": m.prefill_tokens,
        "complexity": theory.complexity(mixer),
        "theory": rows,
        "contexts": contexts,
        "load_s": stat(r["load_s"] for r in runs),
        "rss_after_load_bytes": stat(r["rss_after_load_bytes"] for r in runs),
        "memory_slope_bytes_per_token": stat(r["memory_slope_bytes_per_token"] for r in runs),
        "prefill_tokens_per_s": stat(r["prefill_tokens_per_s"] for r in runs),
        "step_tokens_per_s": stat(r["step_tokens_per_s"] for r in runs),
        "bits_per_byte": None if bpb is None else bpb["bits_per_byte"],
        "eval_bytes": None if bpb is None else bpb["bytes"],
        "errors": errors,
    }


def run(
    targets: list[Target],
    s: Settings,
    *,
    missing: list[dict] | None = None,
    progress: Callable[[str], None] | None = None,
    command: list[str] | None = None,
) -> dict:
    """Measure the machine, run every configuration ``s.repeats`` times (round-robin), aggregate.

    ``progress(label)`` is called before each worker starts. Raises ValueError when no configuration
    produced a single result (the first worker error is the message)."""
    tick = progress or (lambda label: None)
    tick("measuring memory bandwidth and matmul rate")
    mach = machine.describe()
    mach["bandwidth_bytes_per_s"] = machine.measure_bandwidth(s.bandwidth_mib)
    mach["matmul_flops_per_s"] = machine.measure_matmul()
    configs = [(t, b) for t in targets for b in s.backends]
    runs: list[list[dict]] = [[] for _ in configs]
    errors: list[list[str]] = [[] for _ in configs]
    n = len(configs)
    for r in range(s.repeats):
        for i in [(r + j) % n for j in range(n)]:
            t, b = configs[i]
            tick(f"{t.name} on {b}, repeat {r + 1}/{s.repeats}")
            if errors[i] and not runs[i]:  # failed before: do not spend the other repeats on it
                continue
            try:
                runs[i].append(run_worker(_worker_config(t, b, s, r), s.worker_timeout_s))
            except WorkerError as e:
                errors[i].append(str(e))
    bpb: list[dict | None] = [None] * n
    if s.eval_text is not None:
        for i, (t, b) in enumerate(configs):
            tick(f"{t.name} on {b}, bits per byte")
            if not runs[i]:
                continue
            cfg = {
                "task": "eval",
                "artifact": str(t.artifact),
                "backend": b,
                "threads": s.threads,
                "eval_text": str(s.eval_text),
                "eval_bytes": s.eval_bytes,
            }
            try:
                bpb[i] = run_worker(cfg, s.worker_timeout_s)
            except WorkerError as e:
                errors[i].append(str(e))
    if not any(runs):
        raise ValueError(next(e for errs in errors for e in errs))
    mach["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(s).items()}
    return {
        "format": schema.FORMAT,
        "version": schema.VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": list(command if command is not None else sys.argv),
        "settings": settings,
        "machine": mach,
        "results": [aggregate(t, b, runs[i], errors[i], s, mach, bpb[i]) for i, (t, b) in enumerate(configs)],
        "missing": list(missing or []),
        "comparison": None,
        "files": [],
    }
