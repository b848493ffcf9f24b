"""One benchmark configuration (one artifact on one backend) in a process of its own.

    python -m edgeattn.bench.worker --json '{"task": "bench", "artifact": "art/gla", "backend": "torch"}'

The parent (``edgeattn bench``) starts one worker per configuration and repeat, so every memory figure is
this process's alone: nothing else was loaded, nothing is left from another model. The worker prints one
JSON object as its last line of stdout; on failure it prints ``error: <one line>`` to stderr and exits 2.

Task ``bench``, in order:
1. load the session (``load_s``) and read the resident memory;
2. warm up (one prefill chunk and ``warmup`` steps, then reset: allocations of the first calls excluded);
3. for each context c (ascending, without resetting between them): fill the state to c tokens through the
   prefill graph (whole chunks, single steps for the rest); read the resident memory (and the device
   memory on a GPU) with c tokens in the state; save a copy of the state to a temporary file (not kept in
   memory, so it does not count in the next context's figures);
4. time ``steps`` single steps at every context, interleaved: in each of ``BLOCKS`` rounds every context's
   state is loaded (``set_state``), one untimed step runs, then its share of timed steps, one by one; the
   contexts take turns, so drift of the machine during the run falls on all of them alike;
5. prefill throughput from an empty state: ``prefill_tokens`` through the prefill graph, then
   ``step_tokens`` through single steps.

Task ``eval``: bits per byte of a text file through the same runtime, teacher-forced (prefill chunks, then
steps; the cross entropy of every next byte).

Imports numpy, psutil and the runtime only: no torch unless the backend is "torch".
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

BLOCKS = 8  # timed steps at each context come in this many blocks, interleaved across contexts


def rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """This process's high-water resident memory. On Linux VmHWM: getrusage's ru_maxrss survives exec, so in
    a freshly started worker it would report the parent's peak when that was larger."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return max(int(line.split()[1]) * 1024, rss_bytes())
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes
    return max(int(peak), rss_bytes())


class DeviceMemory:
    """GPU memory of this process: nvidia-smi's per-process figure where there is one (discrete GPUs);
    otherwise (Jetson: integrated GPU, no per-process figure) the growth of the device's used memory
    (cudaMemGetInfo, total - free) since this object was made, before the session was loaded. None on CPU."""

    def __init__(self, backend: str):
        self.smi, self.cudart, self.baseline = None, None, 0
        if not (backend == "tensorrt" or (backend == "onnxruntime" and _ort_has_cuda())):
            return
        self.smi = shutil.which("nvidia-smi")
        try:
            try:
                from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
            except ImportError:
                from cuda import cudart
        except ImportError:
            return
        self.cudart = cudart
        self.baseline = self._used() or 0

    def _smi(self) -> int | None:
        try:
            out = subprocess.run(
                [self.smi, "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        for line in out.strip().splitlines():
            pid, _, mem = line.partition(",")
            if pid.strip() == str(os.getpid()) and mem.strip().isdigit():
                return int(mem.strip()) * 2**20
        return None

    def _used(self) -> int | None:
        err, free, total = self.cudart.cudaMemGetInfo()
        return int(total) - int(free) if err == self.cudart.cudaError_t.cudaSuccess else None

    def __call__(self) -> int | None:
        got = self._smi() if self.smi else None
        if got is None and self.cudart is not None:
            used = self._used()
            got = None if used is None else max(0, used - self.baseline)
        return got


def _ort_has_cuda() -> bool:
    try:
        import onnxruntime

        return "CUDAExecutionProvider" in onnxruntime.get_available_providers()
    except ImportError:
        return False


def percentiles(ns: np.ndarray) -> dict[str, float]:
    s = ns.astype(np.float64) / 1e9
    return {
        "p50": float(np.percentile(s, 50)),
        "p90": float(np.percentile(s, 90)),
        "p99": float(np.percentile(s, 99)),
        "mean": float(s.mean()),
    }


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys against xs (bytes per token); None with fewer than two distinct xs."""
    if len(set(xs)) < 2:
        return None
    return float(np.polyfit(np.asarray(xs, np.float64), np.asarray(ys, np.float64), 1)[0])


def bench(cfg: dict) -> dict:
    from edgeattn.runtimes import open_session

    steps, warmup = int(cfg["steps"]), int(cfg.get("warmup", 8))
    contexts = sorted(int(c) for c in cfg["contexts"])
    device_bytes = DeviceMemory(cfg["backend"])
    t0 = time.perf_counter()
    sess = open_session(cfg["artifact"], backend=cfg["backend"], threads=cfg.get("threads"))
    load_s = time.perf_counter() - t0
    m = sess.manifest
    B, V, C, limit = m.batch_size, m.vocab_size, m.prefill_tokens, m.max_length
    device = str(getattr(sess, "device", "cpu"))
    blocks = min(BLOCKS, steps)
    span = 1 + -(-steps // blocks)  # tokens one block runs past its context: one untimed step, then its share
    need = max(
        contexts[-1] + span, int(cfg.get("prefill_tokens", 0)), int(cfg.get("step_tokens", 0)), C + warmup
    )
    ids = np.random.default_rng(int(cfg.get("seed", 0))).integers(0, V, (B, need), dtype=np.int64)
    rss_load = rss_bytes()

    # warm-up: first calls allocate buffers and pick kernels
    sess.reset()
    if limit is None or C + warmup <= limit:
        sess.prefill(ids[:, :C])
    for i in range(warmup):
        sess.step(ids[:, i : i + 1])
    sess.reset()
    # and the bookkeeping of a measurement, so its first use allocates nothing inside the sweep
    percentiles(np.ones(4, dtype=np.int64)), rss_bytes(), peak_rss_bytes(), device_bytes()
    with tempfile.TemporaryFile() as f:  # np.savez imports and sets up zipfile on first use
        np.savez(f, **sess.get_state())

    # 1. fill the state context by context: resident memory at each, and a copy of the state on disk
    out_contexts, xs, ys, measured = [], [], [], []
    pos = 0
    with tempfile.TemporaryDirectory(prefix="edgeattn-bench-state-") as tmp:
        for c in contexts:
            if limit is not None and c + span > limit:
                why = f"context {c} + {span} steps exceeds max_length {limit}"
                out_contexts.append({"context": c, "skipped": why})
                continue
            if pos > c:
                sess.reset()
                pos = 0
            if c > pos:
                sess.prefill(ids[:, pos:c])
            pos = c
            rss = rss_bytes()
            xs.append(c)
            ys.append(rss)
            entry = {"context": c, "skipped": None, "tokens": c, "rss_bytes": rss}
            entry.update(peak_rss_bytes=peak_rss_bytes(), device_bytes=device_bytes())
            out_contexts.append(entry)
            measured.append(c)
            np.savez(os.path.join(tmp, f"{c}.npz"), **sess.get_state())

        # 2. time single steps at every context, interleaved: blocks of steps go round the contexts, so
        # drift of the machine (other load, clocks) falls on all of them alike
        snapshots = {}
        for c in measured:
            with np.load(os.path.join(tmp, f"{c}.npz")) as f:
                snapshots[c] = {k: f[k] for k in f.files}
    times = {c: [] for c in measured}
    for b in range(blocks):
        n = steps // blocks + (1 if b < steps % blocks else 0)
        for j in range(len(measured)):
            c = measured[(b + j) % len(measured)]
            sess.set_state(snapshots[c], position=c)
            sess.step(ids[:, c : c + 1])  # untimed: the first step after a state load touches cold memory
            for i in range(1, n + 1):
                tok = ids[:, c + i : c + i + 1]
                t = time.perf_counter_ns()
                sess.step(tok)
                times[c].append(time.perf_counter_ns() - t)
    del snapshots
    for entry in out_contexts:
        if not entry["skipped"]:
            entry["latency_s"] = percentiles(np.asarray(times[entry["context"]], dtype=np.int64))

    # prefill throughput from an empty state
    cap = limit if limit is not None else need
    P = max(C, (min(int(cfg.get("prefill_tokens", 1024)), cap) // C) * C)
    S = max(1, min(int(cfg.get("step_tokens", 256)), cap))
    prefill_tps = step_tps = None
    if P <= cap:
        sess.reset()
        t = time.perf_counter()
        sess.prefill(ids[:, :P])
        prefill_tps = P / (time.perf_counter() - t)
    sess.reset()
    t = time.perf_counter()
    for i in range(S):
        sess.step(ids[:, i : i + 1])
    step_tps = S / (time.perf_counter() - t)

    return {
        "task": "bench",
        "artifact": str(cfg["artifact"]),
        "backend": cfg["backend"],
        "device": device,
        "threads": cfg.get("threads"),
        # which GroupQueryAttention and MatMulNBits kernels ran (edgeattn/runtimes/attention.py), and why not
        # edgeattn's
        "attention": getattr(sess, "attention", None),
        "matmul": getattr(sess, "matmul", None),
        "pid": os.getpid(),
        "load_s": load_s,
        "rss_after_load_bytes": rss_load,
        "contexts": out_contexts,
        "memory_slope_bytes_per_token": slope(xs, ys),
        "prefill_tokens": P if prefill_tps is not None else None,
        "prefill_tokens_per_s": prefill_tps,
        "step_tokens": S,
        "step_tokens_per_s": step_tps,
        "peak_rss_bytes": peak_rss_bytes(),
    }


def evaluate(cfg: dict) -> dict:
    from edgeattn.export.check import bits_per_byte, run_logits
    from edgeattn.runtimes import open_session

    sess = open_session(cfg["artifact"], backend=cfg["backend"], threads=cfg.get("threads"))
    m = sess.manifest
    tok = sess.tokenizer
    if m.vocab_size < 256 and tok.kind == "byte":
        raise ValueError(
            f"{cfg['artifact']} has a vocabulary of {m.vocab_size}: bits per byte needs byte-level ids"
        )
    n = int(cfg.get("eval_bytes", 8192))
    if m.max_length is not None:
        n = min(n, m.max_length)
    with open(cfg["eval_text"], "rb") as f:
        data = f.read(n + 1)
    if tok.kind == "byte":
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
        n_bytes = len(data) - 1
    else:  # the artifact's tokenizer: bits of the tokens over the bytes they cover
        ids = np.asarray(tok.encode(data)[: n + 1], dtype=np.int64)
        n_bytes = len(tok.decode(ids[1:].tolist()).encode("utf-8"))
    if len(ids) < 2:
        raise ValueError(f"{cfg['eval_text']} needs at least 2 tokens for bits per byte")
    ids = ids[None].repeat(m.batch_size, 0)
    got = run_logits(sess, ids[:, :-1])
    bits = bits_per_byte(got["logits"][0], ids[0, 1:]) * (ids.shape[1] - 1) / max(n_bytes, 1)
    return {
        "task": "eval",
        "artifact": str(cfg["artifact"]),
        "backend": cfg["backend"],
        "bytes": n_bytes,
        "bits_per_byte": bits,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgeattn.bench.worker", description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="the configuration, a JSON object")
    args = ap.parse_args(argv)
    try:
        cfg = json.loads(args.json)
        result = evaluate(cfg) if cfg.get("task") == "eval" else bench(cfg)
    except Exception as e:  # one line for the parent, which shows it to the user
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
