"""Why greedy tokens change under quantization on the imported tests: the top-1 margins of a random model.

The imported tests' tiny Qwen3.5 (``tests/hf_helpers.qwen3_5_text``: random, perturbed weights) is exported at
fp32, int8, int4 block 32 and int4 block 128, and each export is compared with transformers (CPU, PyTorch
paths) on a few prompts:

- free-running: the first position where the export's greedy tokens (``generate_ids(temperature=0)``) part
  from ``transformers.generate(do_sample=False)`` (``n`` = all equal);
- teacher-forced along transformers' greedy path (one flip does not carry on): how many of the steps' argmax
  differ, on how many steps the reference's margin is under twice the export's logit error there (where that
  error could flip the token), the export's largest logit error ``max |export - transformers|`` over the steps, and for the flipped
  steps the reference's top-1 margin (top-1 minus top-2 logit) next to that step's logit error. A flip
  needs an error of at least half the margin there: where margins are that small (a near-tie), any change of
  rounding can flip the token, even fp32's.

    python benchmarks/greedy_margin.py [--tokens 50] [--prompts 8] [--workdir DIR]

Prints a table, then ONE JSON line.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from edgeattn.bench.args import ArgumentParser
from edgeattn.bench.machine import with_cpu

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VARIANTS = {
    "fp32": {},
    "int8": {"precision": "int8"},
    "int4 b32": {"precision": "int4", "quantization": {"block_size": 32}},
    "int4 b128": {"precision": "int4"},
}


def prompts(count: int, vocab: int) -> list[list[int]]:
    """The imported test's own prompt, then random ones of 4-24 tokens (seeded)."""
    out = [[5, 17, 260, 3, 99, 42, 7, 128, 64, 1, 300, 2, 8, 9, 10, 11, 12, 13, 14]]
    rng = np.random.default_rng(1)
    while len(out) < count:
        out.append(rng.integers(0, vocab, int(rng.integers(4, 25))).tolist())
    return out


def reference(model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and its logits at each of those n steps (teacher-forced), [n, V]."""
    import torch

    from tests.hf_helpers import hf_greedy

    toks = hf_greedy(model, prompt, n)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + toks])).logits[0].float().numpy()
    return toks, logits[len(prompt) - 1 : len(prompt) - 1 + len(toks)]


def forced(session, prompt: list[int], toks: list[int]) -> np.ndarray:
    """The export's logits along ``toks`` (the reference's tokens fed back), [n, V]."""
    session.reset()
    rows = [session.prefill(np.array([prompt], np.int64))[0]]
    for t in toks[:-1]:
        rows.append(session.step(np.array([[t]], np.int64))[0])
    return np.stack(rows)


def main() -> None:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()

    from edgeattn.convert import import_model
    from edgeattn.export import export_model
    from edgeattn.runtimes import open_session
    from tests.hf_helpers import qwen3_5_text

    root = Path(args.workdir or tempfile.mkdtemp(prefix="edgeattn-greedy-"))
    model = qwen3_5_text()
    model.save_pretrained(root / "hf")
    import_model(root / "hf", root / "ckpt", force=True)
    ps = prompts(args.prompts, model.config.vocab_size)
    refs = [reference(model, p, args.tokens) for p in ps]
    margins = np.concatenate([np.diff(np.sort(lg, axis=-1)[:, -2:], axis=-1)[:, 0] for _, lg in refs])

    rows = []
    for name, kw in VARIANTS.items():
        art = export_model(root / "ckpt", root / name.replace(" ", "_"), prefill_chunk=16, force=True, **kw)
        s = open_session(art)
        first, flips, steps, err, flipped, risky = [], 0, 0, 0.0, [], 0
        for p, (toks, ref) in zip(ps, refs):
            s.reset()  # generate_ids goes on from the session's state
            got = list(s.generate_ids(p, len(toks), temperature=0))
            first.append(next((i for i, (a, b) in enumerate(zip(got, toks)) if a != b), len(toks)))
            lg = forced(s, p, toks)
            e = np.abs(lg - ref).max(axis=-1)
            err = max(err, float(e.max()))
            top = np.sort(ref, axis=-1)
            risky += int(
                (top[:, -1] - top[:, -2] < 2 * e).sum()
            )  # steps where this error could flip the token
            for i in np.flatnonzero(lg.argmax(-1) != ref.argmax(-1)):
                flipped.append((float(top[i, -1] - top[i, -2]), float(e[i])))
            flips += int((lg.argmax(-1) != ref.argmax(-1)).sum())
            steps += len(toks)
        rows.append(
            {
                "export": name,
                "first_mismatch": first,
                "all_equal": sum(f == args.tokens for f in first),
                "flips": flips,
                "margin_under_2err": risky,
                "steps": steps,
                "max_logit_err": err,
                "flipped_margin_err": flipped,
            }
        )

    print(
        f"tiny Qwen3.5 (tests/hf_helpers), {len(ps)} prompts x {args.tokens} greedy tokens; reference top-1 "
        f"margins: median {np.median(margins):.3g}, 10th percentile {np.percentile(margins, 10):.3g}, "
        f"smallest {margins.min():.3g}; logits' largest |value| {max(np.abs(lg).max() for _, lg in refs):.3g}"
    )
    print(
        f"| export | prompts all {args.tokens} equal | first mismatch per prompt | teacher-forced flips | "
        "steps with margin < 2 x err | max logit err | flipped steps: margin / err |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        fl = ", ".join(f"{m:.2g}/{e:.2g}" for m, e in sorted(r["flipped_margin_err"])[:6])
        more = len(r["flipped_margin_err"]) - 6
        fl += f" (+{more})" if more > 0 else ""
        print(
            f"| {r['export']} | {r['all_equal']}/{len(ps)} | {r['first_mismatch']} | {r['flips']}/{r['steps']} | {r['margin_under_2err']} | "
            f"{r['max_logit_err']:.3g} | {fl or '-'} |"
        )
    summary = {
        "tokens": args.tokens,
        "prompts": len(ps),
        "margin_median": float(np.median(margins)),
        "margin_p10": float(np.percentile(margins, 10)),
        "rows": [{k: v for k, v in r.items() if k != "flipped_margin_err"} for r in rows],
    }
    print(json.dumps(with_cpu(summary)))


if __name__ == "__main__":
    main()
