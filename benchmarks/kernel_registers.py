"""Registers, shared memory and tensor-core instructions of the gated chunk kernels compiled for sm_90a
on a machine without a GPU: Triton compiles to PTX here and the ptxas it ships reports the registers
(``ptxas -v``). bfloat16, K = V = 128, BT = 64, the launch settings of gated_chunk.py (``LAUNCH``: its
"wide" and "narrow" kernels' warps and stages for 16-bit inputs). A static hint about
occupancy for the kernels' speed against fla (RESULTS.md, GPU check); not a measurement on a GPU. Each
kernel that reads the cumulative gates twice: as float32 pairs (gate sums "pair", GS 2, shipped) and as
float32 sums ("float32", GS 1, EDGEATTN_GATE_SUM=float32).

    python benchmarks/kernel_registers.py
"""

import json
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from edgeattn.kernels import gated_chunk as gc

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas-blackwell")
K = V = 128
BT = 64
BK = BV = 64
BC = 16
low = {"q", "k", "v", "do", "o"}


def sig(fn, c, dt="bf16"):
    return {
        n: "constexpr" if n in c else "i32" if n == "T" else f"*{dt}" if n in low else "*fp32"
        for n in fn.arg_names
    }


cases = [
    (gc.chunk_fwd_A_gk_kernel, dict(H=16, K=K, BT=BT, BC=BC, BK=BK, PREC="tf32"), "narrow"),
    (gc.chunk_fwd_A_kernel, dict(H=16, K=K, BT=BT, BK=BK, GATE=1, PREC="tf32"), "wide"),
    (
        gc.chunk_fwd_h_kernel,
        dict(H=16, K=K, V=V, BT=BT, BK=BK, BV=BV, GATE=2, USE_H0=True, PREC="tf32"),
        "wide",
    ),
    (gc.chunk_fwd_o_kernel, dict(H=16, K=K, V=V, BT=BT, BK=BK, BV=BV, GATE=2, PREC="tf32"), "wide"),
    (
        gc.chunk_bwd_dh_kernel,
        dict(H=16, K=K, V=V, BT=BT, BK=BK, BV=BV, GATE=2, USE_DHT=True, PREC="tf32"),
        "wide",
    ),
    (gc.chunk_bwd_dA_kernel, dict(H=16, V=V, BT=BT, BV=BV, PREC="tf32"), "wide"),
    (gc.chunk_bwd_dv_kernel, dict(H=16, K=K, V=V, BT=BT, BK=BK, BV=BV, GATE=2, PREC="tf32"), "wide"),
    (gc.chunk_bwd_dqk_intra_gk_kernel, dict(H=16, K=K, BT=BT, BC=BC, BK=BK, PREC="tf32"), "narrow"),
    (gc.chunk_bwd_dqk_kernel, dict(H=16, K=K, V=V, BT=BT, BK=BK, BV=32, GATE=2, PREC="tf32"), "wide"),
]


def main() -> None:
    rows = []
    print(f"| kernel | gate sums | warps | stages | registers | spill bytes | shared KB | wgmma | mma.sync |"
          f"  (triton {triton.__version__})")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    runs = [
        (fn, {**c, "GS": gs} if gs else c, kind, form)
        for fn, c, kind in cases
        for gs, form in (((2, "pair"), (1, "float32")) if "gc" in fn.arg_names else ((None, "-"),))
    ]
    for fn, c, kind, form in runs:
        launch = (gc.wide if kind == "wide" else gc.narrow)(gc.torch.bfloat16)
        warps = launch["num_warps"]
        src = ASTSource(fn, sig(fn, c), constexprs={(fn.arg_names.index(n),): v for n, v in c.items()})
        out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=launch)
        ptx = out.asm["ptx"]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "k.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            r = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                               capture_output=True, text=True)  # fmt: skip
        text = r.stderr + r.stdout
        regs = re.search(r"Used (\d+) registers", text)
        spill = re.search(r"(\d+) bytes spill stores", text)
        row = dict(kernel=fn.__name__, gate_sums=form, warps=warps, stages=launch["num_stages"],
                   registers=int(regs.group(1)) if regs else None,
                   spill_bytes=int(spill.group(1)) if spill else None, shared_kb=out.metadata.shared / 1024,
                   wgmma=ptx.count("wgmma.mma_async"), mma_sync=len(re.findall(r"\bmma\.sync", ptx)))  # fmt: skip
        rows.append(row)
        print(f"| {row['kernel']} | {form} | {warps} | {row['stages']} | {row['registers']} | {row['spill_bytes']} "
              f"| {row['shared_kb']:.1f} | "
              f"{row['wgmma']} | {row['mma_sync']} |", flush=True)  # fmt: skip
    print(
        json.dumps(
            {"bench": "kernel_registers", "target": "sm_90a", "triton": triton.__version__, "rows": rows}
        )
    )


if __name__ == "__main__":
    main()
