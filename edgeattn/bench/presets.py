"""Fresh artifacts for ``edgeattn bench --mixers a,b,c --size small``: one model per family, of equal size.

Each preset fixes width, depth and heads. The families' mixers differ in parameters (GLA's gate and output
gate, FLASH's expanded GAU, ...), so each family's SwiGLU hidden size is chosen to bring its parameter count
closest to the reference, a GLA model of the preset with the default MLP ratio (8/3). The hidden size moves
in steps of 32, so counts agree to within about ``3 * 32 * d_model * n_layers`` parameters.

Needs the ``train`` extra (torch) to build and export the models; weights are random (speed and memory
do not depend on them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from edgeattn import MIXERS

REFERENCE = "gla"
DEFAULT_MLP_RATIO = 8 / 3

# name -> EdgeConfig fields; the rest are EdgeConfig's defaults
PRESETS: dict[str, dict] = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=2, feature_dim=32, flash_qk_dim=32, window=32, n_sinks=4),
    "small": dict(d_model=256, n_layers=4, n_heads=4, feature_dim=64, flash_qk_dim=64, window=64, n_sinks=4),
    "medium": dict(
        d_model=512, n_layers=8, n_heads=8, feature_dim=64, flash_qk_dim=128, window=128, n_sinks=4
    ),
}
EXPORTABLE = tuple(m for m in MIXERS if m != "aft_full")


@dataclass
class Planned:
    mixer: str
    config: object | None  # EdgeConfig, or None when the family is missing
    params: int | None
    reason: str | None = None  # why the family is missing


def parse_mixers(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("--mixers needs at least one mixer name")
    for n in names:
        if n == "aft_full":
            raise ValueError(
                "mixer 'aft_full' has no fixed-size state and cannot be exported; use 'aft' or 'aft_local'"
            )
        if n not in MIXERS:
            raise ValueError(f"unknown mixer {n!r}; expected some of {', '.join(EXPORTABLE)}")
    return list(dict.fromkeys(names))


def _hidden(d_model: int, ratio: float) -> int:
    return 32 * -(-int(d_model * ratio) // 32)  # SwiGLU's rounding (edgeattn.models.lm)


def _params(cfg) -> int:
    from edgeattn.models import EdgeLM

    return EdgeLM(cfg).num_parameters()


def plan(mixers: list[str], size: str, max_seq_len: int) -> list[Planned]:
    """An EdgeConfig per family with its parameter count; families this install lacks come back missing."""
    from edgeattn._deps import require

    require("torch")
    from edgeattn.models import EdgeConfig

    if size not in PRESETS:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(PRESETS)}")
    base = dict(PRESETS[size], max_seq_len=max_seq_len)
    D, L = base["d_model"], base["n_layers"]
    target = _params(EdgeConfig(mixer=REFERENCE, **base))
    h0 = _hidden(D, DEFAULT_MLP_RATIO)
    out = []
    for m in mixers:
        try:
            p0 = _params(EdgeConfig(mixer=m, **base))
        except ValueError as e:  # EdgeLM refuses a family whose layer is not registered in this install
            out.append(Planned(m, None, None, str(e).splitlines()[0]))
            continue
        per_step = 3 * D * 32 * L  # SwiGLU: three D x hidden matrices per layer
        h = max(32, h0 + 32 * round((target - p0) / per_step))
        cfg = EdgeConfig(mixer=m, mlp_ratio=h / D, **base)  # int(D * h / D) rounds up to h again
        out.append(Planned(m, cfg, _params(cfg)))
    return out


def export_planned(
    planned: list[Planned], root: Path, *, target: str, precision: str, prefill_chunk: int = 64
) -> dict[str, Path]:
    """Export every available family to ``root/<mixer>``; mixer -> artifact directory. The checkpoints
    are written to a temporary directory (each artifact keeps a copy of its own)."""
    import tempfile

    import torch

    from edgeattn.export import export_model
    from edgeattn.models import EdgeLM

    arts = {}
    with tempfile.TemporaryDirectory(prefix="edgeattn-ckpt-") as tmp:
        for p in planned:
            if p.config is None:
                continue
            torch.manual_seed(0)
            ckpt = EdgeLM(p.config).save(Path(tmp) / p.mixer)
            arts[p.mixer] = export_model(
                ckpt,
                root / p.mixer,
                target=target,
                precision=precision,
                prefill_chunk=prefill_chunk,
                force=True,
            )
    return arts


def max_seq_len_for(contexts: list[int], steps: int, extra: int = 0) -> int:
    """The softmax baseline's KV-cache bound: the largest context plus the timed steps, rounded up."""
    need = max(contexts) + steps + extra
    return max(2048, 1024 * math.ceil(need / 1024))


def rerun_command(mixers: list[str], size: str, argv_rest: str = "") -> str:
    return f"edgeattn bench --mixers {','.join(mixers)} --size {size}{argv_rest}"
