"""Where the Triton kernels' time goes on a GPU, and what their launch settings are worth (issue 36).

benchmarks/gpu_check.py times edgeattn's kernels against fla's as a whole (forward + backward). This one
says why they are slower, in one call of a few minutes:

    sweep      every op (gla, simple_gla, gated_delta, kda; bfloat16, B=8, H=16, K=V=128, T=2048) under
               several launch settings WIDE-NARROW-STAGES: warps of the wide kernels ([BT, 64] tiles),
               warps of the narrow ones ([16, *] sub-chunk tiles) and pipeline stages
               (edgeattn.kernels.gated_chunk.LAUNCH, also read by delta_chunk). Each setting is compiled
               first, in parallel processes (one per setting, sharing Triton's on-disk cache), then timed
               here one after another; each setting's output and gradients are compared with the shipped
               setting's (a miscompile or a race shows as a difference, not only as a time).
    forms      every form of ours (gpu_check.FORMS): the shipped one, float32 gate sums
               (EDGEATTN_GATE_SUM=float32) and for gated_delta and kda the WY part in Triton
               (EDGEATTN_DELTA_WY=triton) and both: times, and each against the shipped form on the same
               inputs.
    breakdown  forward + backward of each op, ours (gla and kda also with float32 gate sums) and fla's, under
               torch.profiler: every GPU kernel's time per call of the op (Triton kernels by name, PyTorch's
               as cuBLAS / elementwise kernels), so that ours and fla's can be compared stage by stage.
               fla's ops are compiled (autotuned, capped as in gpu_check.py) in parallel processes too, while
               ours compile.
    --ncu OP   (a child run under Nsight Compute by scripts/gpu_profile.sh) one warm forward + backward of
               OP between cudaProfilerStart and cudaProfilerStop, so that ``ncu --profile-from-start off``
               profiles those kernels alone (the backward's too, launched from autograd's own thread).

Output in ``--out``: profile.jsonl (one JSON object a line, every figure and every error) and profile.md
(the tables). On this CPU ``--tiny`` runs the same code at tiny shapes in Triton's interpreter
(tests/test_gpu_profile.py): there the launch settings change nothing and the times say only that it runs.

    python benchmarks/gpu_profile.py --out DIR [--ops gla,kda] [--configs 8-4-2,4-4-2] [--no-fla]
    python benchmarks/gpu_profile.py --out DIR --tiny

Exit code 0 when it ran to its end (errors inside are results, in the files), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from edgeattn.bench.args import ArgumentParser

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import gpu_check  # noqa: E402  (benchmarks/gpu_check.py: the ops, their inputs, the records)
from gpu_check import Recorder, rel_rms, say  # noqa: E402

OPS = ("gla", "simple_gla", "gated_delta", "kda")
# The H200 sweep (RESULTS.md, 2026-11-28) timed 12 settings; 4-4-1 won and now ships for 16-bit inputs. These
# are its neighbours, the old 8-4-2 and the best per op there (4-2-1 for gla and kda, 4-4-3 for simple_gla);
# 16 warps gave wrong results. --configs takes any others.
CONFIGS = ((4, 4, 1), (8, 4, 2), (4, 2, 1), (4, 4, 2), (4, 4, 3), (8, 4, 3))
SIZES = {
    "gpu": dict(B=8, H=16, K=128, T=2048, dtype="bfloat16", top=14),
    # float32: fla's kernels in Triton's interpreter return garbage in bfloat16 (gpu_check.py)
    "tiny": dict(B=1, H=1, K=16, T=80, dtype="float32", top=8),
}


def parse_configs(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(","):
        bits = part.strip().split("-")
        try:
            w, n, st = (int(b) for b in bits)
        except ValueError:
            raise ValueError(f"--configs: {part.strip()!r} is not WIDE-NARROW-STAGES (e.g. 8-4-2)") from None
        if not (w in (1, 2, 4, 8, 16, 32) and n in (1, 2, 4, 8, 16, 32) and 1 <= st <= 6):
            raise ValueError(f"--configs: {part.strip()!r}: warps must be powers of two up to 32, stages 1-6")
        out.append((w, n, st))
    if not out:
        raise ValueError("--configs: none given")
    return out


def shipped() -> dict:
    """The launch settings as shipped (a copy of gated_chunk.LAUNCH: 16-bit and float32 inputs)."""
    from edgeattn.kernels import gated_chunk

    return dict(gated_chunk.LAUNCH)


def set_config(cfg) -> None:
    """Every launch of the gated-chunk and delta-rule kernels takes ``cfg`` (a tuple), or the settings of
    ``cfg`` (a dict, as ``shipped()`` returns)."""
    from edgeattn.kernels import gated_chunk

    if isinstance(cfg, dict):
        gated_chunk.LAUNCH.update(cfg)
    else:
        gated_chunk.LAUNCH["16bit"] = gated_chunk.LAUNCH["float32"] = tuple(cfg)


def cfg_name(cfg) -> str:
    return "-".join(str(x) for x in cfg)


class Bench:
    """Inputs and implementations of each op at the run's size (benchmarks/kernels.py's)."""

    def __init__(self, tiny: bool):
        import kernels as kb
        import torch

        self.torch, self.kb = torch, kb
        self.z = SIZES["tiny" if tiny else "gpu"]
        self.cuda = torch.cuda.is_available()
        self.device = "cuda" if self.cuda else "cpu"
        self.dtype = getattr(torch, self.z["dtype"])

    def impls(self, op):
        return gpu_check.kernel_impls(op)

    def inputs(self, op):
        z = self.z
        return gpu_check.kernel_inputs(op, z["B"], z["T"], z["H"], z["K"], self.dtype, self.device)

    fwd_bwd = staticmethod(gpu_check.fwd_bwd)  # (output, gradients, do) with a fixed output gradient

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()


# ---- children: compile one setting (or fla's op) so that the timing process finds it in the cache ------


def child_compile(args) -> int:
    b = Bench(args.tiny)
    if args.child_fla:
        gpu_check.lift_fla_hopper_guard()
        if b.cuda:
            gpu_check.cap_autotune(args.fla_autotune_configs)
        for op in args.child_fla.split(","):
            fn = b.impls(op)["fla"]
            if callable(fn):
                b.fwd_bwd(fn, b.inputs(op))
        b.sync()
        return 0
    cfg = parse_configs(args.child_config)[0]
    set_config(cfg)
    failed = []
    for op in args.ops.split(","):
        # at the shipped setting every form of ours (forms() times them), elsewhere the shipped form
        for impl in gpu_check.our_impls(op) if cfg == shipped()["16bit"] else ("triton",):
            try:
                b.fwd_bwd(b.impls(op)[impl], b.inputs(op))
                b.sync()
            except Exception as e:  # noqa: BLE001 -- out of shared memory, say: the timing process records it
                failed.append(f"{op} {impl}: {type(e).__name__}")
    if failed:
        say(f"[compile {args.child_config}] failed: {'; '.join(failed)}")
    return 0


def compile_all(args, ops, configs, fla_ops, deadline) -> list[dict]:
    """Every setting (and fla's ops) compiled in parallel processes; returns what each one did."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    base = [sys.executable, __file__, "--out", args.out, "--ops", ",".join(ops)]
    base += ["--tiny"] if args.tiny else []
    jobs = [(f"config {cfg_name(c)}", base + ["--child-config", cfg_name(c)]) for c in configs]
    jobs += [(f"fla {op}", base + ["--child-fla", op]) for op in fla_ops]

    def one(job):
        name, cmd = job
        t0 = time.time()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=max(5.0, deadline - time.time()))  # fmt: skip
            tail = (p.stdout + p.stderr).strip().splitlines()[-3:]
            return dict(job=name, rc=p.returncode, seconds=round(time.time() - t0, 1), tail=tail)
        except subprocess.TimeoutExpired:
            return dict(job=name, rc=None, seconds=round(time.time() - t0, 1), tail=["timed out"])

    workers = max(1, min(len(jobs), args.jobs or (os.cpu_count() or 2) - 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, jobs))


# ---- the timing process --------------------------------------------------------------------------------


def sweep(b: Bench, rec: Recorder, ops, configs, deadline) -> None:
    """Each setting's time, and its output and gradients against the shipped setting's."""
    default = shipped()
    for op in ops:
        fn = b.impls(op)["triton"]
        xs = b.inputs(op)
        ref_o, ref_g, do = b.fwd_bwd(fn, xs)
        for cfg in configs:
            if time.time() > deadline:
                rec.write("skipped", item=f"sweep {op} {cfg_name(cfg)}", reason="time budget")
                continue
            set_config(cfg)
            try:
                o, g, _ = b.fwd_bwd(fn, xs, do)
                diff = max([rel_rms(o, ref_o)] + [rel_rms(a, r) for a, r in zip(g, ref_g) if r is not None])
                ms = b.kb.time_fwd_bwd_any(fn, xs)
                row = rec.write("sweep", op=op, config=cfg_name(cfg), wide=cfg[0], narrow=cfg[1], stages=cfg[2],
                                ms=ms, max_rel_rms_vs_shipped=diff)  # fmt: skip
                say(f"[sweep] {op:<12}{cfg_name(cfg):<8}{ms:9.3f} ms  vs shipped {diff:.1e}")
            except Exception as e:  # noqa: BLE001
                row = rec.write(
                    "error", item=f"sweep {op} {cfg_name(cfg)}", error=f"{type(e).__name__}: {e}"[:300]
                )
                say(f"[sweep] {op:<12}{cfg_name(cfg):<8}ERROR {row['error']}")
            finally:
                set_config(default)


def forms(b: Bench, rec: Recorder, ops, deadline) -> None:
    """Every form of ours (gpu_check.FORMS: "triton" shipped; "triton-f32g" the cumulative gates as float32
    sums, EDGEATTN_GATE_SUM=float32; for the delta rules "triton-wy", the WY part in Triton,
    EDGEATTN_DELTA_WY=triton, and "triton-wy-f32g"): each op's forward + backward time, and each form's
    output and gradients against the shipped form's on the same inputs."""
    for op in ops:
        impls = b.impls(op)
        xs = b.inputs(op)
        ref = None
        for impl in gpu_check.our_impls(op):
            if time.time() > deadline:
                rec.write("skipped", item=f"form {op} {impl}", reason="time budget")
                continue
            try:
                o, g, do = b.fwd_bwd(impls[impl], xs, None if ref is None else ref[2])
                if ref is None:
                    ref = (o, g, do)
                diff = max([rel_rms(o, ref[0])] + [rel_rms(a, r) for a, r in zip(g, ref[1]) if r is not None])
                ms = b.kb.time_fwd_bwd_any(impls[impl], xs)
                rec.write("form", op=op, impl=impl, ms=ms, max_rel_rms_vs_shipped=diff)
                say(f"[forms] {op:<12}{impl:<15}{ms:9.3f} ms  vs shipped {diff:.1e}")
            except Exception as e:  # noqa: BLE001
                rec.write("error", item=f"form {op} {impl}", error=f"{type(e).__name__}: {e}"[:300])
                say(f"[forms] {op:<12}{impl:<15}ERROR {type(e).__name__}: {e}"[:300])


def device_time(evt) -> float:
    """An event's own time on the device (on the CPU for a CPU run), microseconds."""
    for attr in ("self_device_time_total", "self_cuda_time_total", "device_time_total", "cuda_time_total"):
        t = getattr(evt, attr, None)
        if t:
            return float(t)
    return 0.0


def breakdown(b: Bench, rec: Recorder, op: str, impl: str, fn, xs, top: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    b.fwd_bwd(fn, xs)  # warm: compiled, autotuned
    b.sync()
    reps = 3 if b.cuda else 1
    acts = [ProfilerActivity.CUDA] if b.cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        for _ in range(reps):
            b.fwd_bwd(fn, xs)
        b.sync()
    rows = []
    for evt in prof.key_averages():  # CUDA activity alone on a GPU: every event is a kernel (or a copy)
        us = device_time(evt) if b.cuda else float(evt.self_cpu_time_total)
        if us > 0:
            rows.append((evt.key, evt.count / reps, us / reps / 1e3))
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    for name, calls, ms in rows[:top]:
        rec.write(
            "kernel", op=op, impl=impl, name=name[:120], calls=calls, ms=ms, share=ms / total if total else 0
        )
    rest = rows[top:]
    if rest:
        rec.write("kernel", op=op, impl=impl, name=f"({len(rest)} others)", calls=sum(r[1] for r in rest),
                  ms=sum(r[2] for r in rest), share=sum(r[2] for r in rest) / total if total else 0)  # fmt: skip
    rec.write("breakdown_total", op=op, impl=impl, ms=total, kernels=len(rows))
    say(f"[breakdown] {op:<12}{impl:<7}{total:9.3f} ms in {len(rows)} kernels; top: "
        + "; ".join(f"{n[:48]} {m:.3f}" for n, _, m in rows[:4]))  # fmt: skip


def markdown(records: list[dict]) -> str:
    out = ["# Where the kernels' time goes (benchmarks/gpu_profile.py)", ""]
    env = next((r for r in records if r["kind"] == "env"), None)
    if env:
        out += ["; ".join(f"{k} {v}" for k, v in env.items() if k not in ("kind", "section")), ""]
    sw = [r for r in records if r["kind"] == "sweep"]
    if sw:
        out += ["**Launch settings** (WIDE-NARROW-STAGES warps/warps/stages; forward + backward ms; "
                "max rel. RMS of output and gradients against the shipped setting)", ""]  # fmt: skip
        ops = list(dict.fromkeys(r["op"] for r in sw))
        cfgs = list(dict.fromkeys(r["config"] for r in sw))
        by = {(r["op"], r["config"]): r for r in sw}
        out += ["| setting | " + " | ".join(ops) + " |", "|---" * (len(ops) + 1) + "|"]
        for c in cfgs:
            cells = []
            for op in ops:
                r = by.get((op, c))
                cells.append("-" if r is None else f"{r['ms']:.3f} ({r['max_rel_rms_vs_shipped']:.0e})")
            out.append(f"| {c} | " + " | ".join(cells) + " |")
        out.append("")
    fm = [r for r in records if r["kind"] == "form"]
    if fm:
        out += ["**Our forms** (triton shipped; -wy: the WY part in Triton; -f32g: float32 gate sums): forward + "
                "backward ms, max rel. RMS against the shipped form", "",
                "| op | impl | ms | vs shipped |", "|---|---|---|---|"]  # fmt: skip
        out += [
            f"| {r['op']} | {r['impl']} | {r['ms']:.3f} | {r['max_rel_rms_vs_shipped']:.0e} |" for r in fm
        ]
        out.append("")
    tot = {(r["op"], r["impl"]): r for r in records if r["kind"] == "breakdown_total"}
    for op in dict.fromkeys(r["op"] for r in records if r["kind"] == "kernel"):
        for impl in ("triton", "triton-f32g", "fla"):
            ks = [r for r in records if r["kind"] == "kernel" and r["op"] == op and r["impl"] == impl]
            if not ks:
                continue
            t = tot.get((op, impl), {}).get("ms", float("nan"))
            out += [f"**{op}, {impl}**: {t:.3f} ms of kernels per forward + backward", "",
                    "| kernel | calls | ms | share |", "|---|---|---|---|"]  # fmt: skip
            out += [
                f"| `{r['name']}` | {r['calls']:g} | {r['ms']:.3f} | {100 * r['share']:.0f}% |" for r in ks
            ]
            out.append("")
    errs = [r for r in records if r["kind"] in ("error", "skipped", "compile") and (r.get("rc") not in (0,))]
    if errs:
        out += ["**errors and skips**", ""]
        out += [
            f"- {json.dumps({k: v for k, v in r.items() if k not in ('kind', 'section')})[:300]}"
            for r in errs
        ]
        out.append("")
    return "\n".join(out)


def run_ncu(args) -> int:
    b = Bench(args.tiny)
    op = args.ncu
    fn = b.impls(op)[args.ncu_impl]
    xs = b.inputs(op)
    b.fwd_bwd(fn, xs)  # compile outside the profiled range
    b.sync()
    # cudaProfilerStart/Stop, not an NVTX range: NVTX push/pop ranges are per thread, and autograd launches
    # the backward from a thread of its own (an H200 run's range held the forward kernels alone)
    if b.cuda:
        b.torch.cuda.profiler.start()
    b.fwd_bwd(fn, xs)
    b.sync()
    if b.cuda:
        b.torch.cuda.profiler.stop()
    return 0


def build_parser():
    ap = ArgumentParser(prog="gpu_profile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-profile", help="output folder")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes in Triton's interpreter (this CPU)")
    ap.add_argument("--ops", default=",".join(OPS), help="some of " + ",".join(OPS))
    ap.add_argument(
        "--configs", default=",".join(cfg_name(c) for c in CONFIGS), help="WIDE-NARROW-STAGES,..."
    )
    ap.add_argument("--no-fla", action="store_true", help="no fla breakdown (and no fla compile)")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the whole run (default 200)")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile processes (default: CPUs - 1)")
    ap.add_argument("--fla-autotune-configs", type=int, default=4, help="fla's autotuner: configs a kernel")
    ap.add_argument(
        "--ncu",
        default=None,
        help="one warm forward + backward of this op between cudaProfilerStart/Stop (for ncu)",
    )
    ap.add_argument(
        "--ncu-impl", default="triton", help="--ncu: which of our forms (triton, triton-f32g, ...)"
    )
    ap.add_argument("--child-config", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-fla", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    ops = [x.strip() for x in args.ops.split(",") if x.strip()]
    bad = [x for x in ops if x not in OPS]
    if bad or not ops:
        ap.error(f"--ops: unknown {bad}; expected some of {', '.join(OPS)}")
    if args.ncu is not None and args.ncu not in OPS:
        ap.error(f"--ncu: unknown op {args.ncu!r}; expected one of {', '.join(OPS)}")
    if args.ncu is not None and args.ncu_impl not in gpu_check.our_impls(args.ncu):
        ours = ", ".join(gpu_check.our_impls(args.ncu))
        ap.error(f"--ncu-impl: {args.ncu_impl!r} is not a form of {args.ncu}; expected one of {ours}")
    try:
        configs = parse_configs(args.configs)
    except ValueError as e:
        ap.error(str(e))
    if not (args.budget > 0 and math.isfinite(args.budget)):
        ap.error("--budget must be a positive number of seconds")
    if bad_out := gpu_check.check_out_dir(args.out):
        ap.error(bad_out)
    import torch

    if not torch.cuda.is_available():
        if not args.tiny:
            ap.error("no CUDA device here; run it on a GPU, or with --tiny on a CPU")
        os.environ["TRITON_INTERPRET"] = "1"
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.path.insert(0, str(ROOT / "scripts"))
        from make_fla_fixtures import patch_triton_for_cpu

        patch_triton_for_cpu()
    if args.child_config or args.child_fla:
        return child_compile(args)
    if args.ncu:
        return run_ncu(args)

    t_start = time.time()
    deadline = t_start + args.budget
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("profile.jsonl", "profile.md"):
        (out / name).unlink(missing_ok=True)
    rec = Recorder(out / "profile.jsonl", "profile")
    rec.write("env", **gpu_check.environment(args.tiny))
    ship = shipped()["16bit"]
    if ship not in configs:
        configs = [ship, *configs]
    rec.write("shipped", launch=shipped())
    fla_ops = [] if args.no_fla else ops
    say(
        f"[compile] {len(configs)} settings x {len(ops)} ops"
        + (f", fla's {len(fla_ops)} ops" if fla_ops else "")
    )
    for r in compile_all(args, ops, configs, fla_ops, t_start + 0.45 * args.budget):
        rec.write("compile", **r)
        say(f"[compile] {r['job']}: rc {r['rc']} in {r['seconds']} s" + (f"  {r['tail']}" if r["rc"] else ""))

    b = Bench(args.tiny)
    if fla_ops:
        note = gpu_check.lift_fla_hopper_guard()
        if note:
            rec.write("note", text=note)
        if b.cuda:
            gpu_check.cap_autotune(args.fla_autotune_configs)
    top = b.z["top"]
    # ours at the default setting first (the why), then the settings, then fla's (compiled by now)
    # the per-key gate ops also with float32 gate sums: where the pairs' cost goes
    for op, impl in [(op, "triton") for op in ops] + [
        (op, "triton-f32g") for op in ops if op in ("gla", "kda")
    ]:
        try:
            breakdown(b, rec, op, impl, b.impls(op)[impl], b.inputs(op), top)
        except Exception as e:  # noqa: BLE001
            rec.write("error", item=f"breakdown {op} {impl}", error=f"{type(e).__name__}: {e}"[:300])
            traceback.print_exc(limit=4, file=sys.stdout)
    forms(b, rec, ops, t_start + 0.7 * args.budget)
    sweep(b, rec, ops, configs, t_start + 0.8 * args.budget)
    for op in fla_ops:
        if time.time() > deadline:
            rec.write("skipped", item=f"breakdown {op} fla", reason="time budget")
            continue
        try:
            fn = b.impls(op)["fla"]
            if not callable(fn):
                raise RuntimeError(fn)
            breakdown(b, rec, op, "fla", fn, b.inputs(op), top)
        except Exception as e:  # noqa: BLE001
            rec.write("error", item=f"breakdown {op} fla", error=f"{type(e).__name__}: {e}"[:300])
            traceback.print_exc(limit=4, file=sys.stdout)
    records = gpu_check.read_records(out / "profile.jsonl")
    md = markdown(records)
    (out / "profile.md").write_text(md)
    say("\n" + md)
    say(f"[gpu_profile] done in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
