"""Approximation error and cost of every attention method against exact softmax (``edgeattn analyze``).

- ``approximation_error``: ``|o - o_softmax|_F / |o_softmax|_F`` on the same q, k, v, the reference
  being causal softmax for causal methods and bidirectional softmax for Nystrom (which has no causal form).
- ``capture_qkv``: a checkpoint's real q, k, v at every layer, from forward hooks on its mixers.
- ``COST``: FLOPs and extra memory of each method's forward pass per head as functions of T (the
  complexity table), with K = V = d the head size; one multiply-add counts 2 FLOPs.
- ``measure``: median wall time of an op on this machine, and its peak of live tensor bytes from the
  PyTorch profiler's memory events (op granularity: temporaries freed inside one aten op are not seen).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from edgeattn._deps import require
from edgeattn.ops import attention

torch = require("torch")
F = torch.nn.functional
Tensor = torch.Tensor

# method -> the option its sweep varies (None: nothing to sweep)
SWEEP = {
    "linear": None,
    "performer": "n_features",
    "rff": "n_features",
    "lsh": "n_buckets",
    "nystrom": "n_landmarks",
}


def approximation_error(approx: Tensor, exact: Tensor) -> float:
    """Relative Frobenius error |approx - exact|_F / |exact|_F."""
    return ((approx.double() - exact.double()).norm() / exact.double().norm().clamp_min(1e-30)).item()


def method_options(method: str, value: int | None, lsh_rounds: int, bucket_size: int) -> dict:
    opts = {} if value is None else {SWEEP[method]: value}
    if method == "lsh":
        opts.update(n_rounds=lsh_rounds, bucket_size=bucket_size)
    return opts


def error_sweep(q, k, v, sweeps: dict[str, list], *, seeds: int, lsh_rounds: int, bucket_size: int):
    """Rows ``{method, param, value, error}``: the error of each method and swept value, averaged over
    ``seeds`` draws of the random features / rotations."""
    exact = {c: attention(q, k, v, method="softmax", causal=c) for c in (True, False)}
    rows = []
    for method, values in sweeps.items():
        causal = method != "nystrom"
        for value in values:
            if method == "nystrom" and value > q.shape[1]:
                continue
            opts = method_options(method, value, lsh_rounds, bucket_size)
            n = seeds if method in ("performer", "rff", "lsh") else 1
            errs = [
                approximation_error(
                    attention(q, k, v, method=method, causal=causal, seed=s, **opts), exact[causal]
                )
                for s in range(n)
            ]
            rows.append(
                {"method": method, "param": SWEEP[method], "value": value, "error": statistics.fmean(errs)}
            )
    return rows


def capture_qkv(model, input_ids) -> list[tuple[int, str, tuple | None]]:
    """Per layer ``(index, mixer name, (q, k, v) [B, T, H, Dh] or None)`` from one forward pass: a forward
    pre-hook on each mixer keeps its input, and the mixer's own projections give q, k, v (reformer:
    the shared qk, keys normalized; mixers without q/k/v projections, e.g. flash, give None)."""
    inputs: dict[int, Tensor] = {}
    handles = [
        m.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0].detach()))
        for i, m in enumerate(model.mixers)
    ]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in handles:
            h.remove()
    out = []
    with torch.no_grad():
        for i, m in enumerate(model.mixers):
            x = inputs[i]
            B, T, _ = x.shape
            H = model.cfg.n_heads
            if all(hasattr(m, n) for n in ("q_proj", "k_proj", "v_proj")):
                qkv = tuple(p(x).view(B, T, H, -1) for p in (m.q_proj, m.k_proj, m.v_proj))
            elif hasattr(m, "qk_proj"):
                qk = m.qk_proj(x).view(B, T, H, -1)
                qkv = (qk, F.normalize(qk, dim=-1), m.v_proj(x).view(B, T, H, -1))
            else:
                qkv = None
            out.append((i, m.mixer_name, qkv))
    return out


@dataclass(frozen=True)
class Cost:
    """Forward FLOPs and extra memory (floats beyond q, k, v, o) per head: T tokens, head size d."""

    flops: Callable[[int, int, dict], float]
    memory: Callable[[int, int, dict], float]
    formula: str


COST: dict[str, Cost] = {
    "softmax": Cost(lambda T, d, o: 4 * T * T * d, lambda T, d, o: T * T, "4 T^2 d flops, T^2 scores"),
    "linear": Cost(
        lambda T, d, o: 4 * T * d * d + 4 * T * d, lambda T, d, o: d * d + d, "4 T d^2 flops, d^2 state"
    ),
    "performer": Cost(
        lambda T, d, o: 8 * T * o["m"] * d,
        lambda T, d, o: 2 * T * o["m"] + o["m"] * d,
        "8 T m d, 2 T m + m d",
    ),
    "rff": Cost(
        lambda T, d, o: 12 * T * o["m"] * d,
        lambda T, d, o: 4 * T * o["m"] + 2 * o["m"] * d,
        "12 T m d, 4 T m + 2 m d",
    ),
    "lsh": Cost(
        lambda T, d, o: o["r"] * (T * d * o["b"] + 8 * T * o["c"] * d),
        lambda T, d, o: o["r"] * (2 * T * o["c"] + 2 * T),
        "R (T d b + 8 T c d), R (2 T c + 2 T)",
    ),
    "nystrom": Cost(
        lambda T, d, o: 8 * T * o["l"] * d + 48 * o["l"] ** 3 + 4 * o["l"] ** 2 * d,
        lambda T, d, o: 2 * T * o["l"] + 3 * o["l"] ** 2,
        "8 T l d + 48 l^3, 2 T l + 3 l^2",
    ),
}


def crossover(
    cheaper: Callable[[int], float], baseline: Callable[[int], float], t_max: int = 1 << 24
) -> int | None:
    """The smallest T (a power of two, then bisected) from which ``cheaper(T) < baseline(T)``."""
    t = 1
    while t <= t_max and not cheaper(t) < baseline(t):
        t *= 2
    if t > t_max:
        return None
    lo, hi = t // 2, t
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if cheaper(mid) < baseline(mid) else (mid, hi)
    return hi


@contextlib.contextmanager
def _quiet_fd2():
    """Silence file descriptor 2 for the block: torch's profiler prints two `USDT:` lines from C++ per
    profiled call, which Python's sys.stderr cannot intercept."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def measure(fn: Callable[[], Tensor], repeats: int) -> tuple[float, int]:
    """(median seconds over ``repeats`` calls after a warm-up, peak live bytes of one profiled call)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        with _quiet_fd2(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    events = []
    for e in prof.events():
        usage = e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage
        if usage:
            events.append((e.time_range.start, usage))
    live = peak = 0
    for _, usage in sorted(events):
        live += usage
        peak = max(peak, live)
    return statistics.median(times), peak
