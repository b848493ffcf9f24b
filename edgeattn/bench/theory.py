"""Analytic cost of one decoded token, and the floor it implies on the machine under test.

For an artifact at context ``t`` (tokens already in the state):

- FLOPs: ``2 x`` every weight-matrix element (each is one multiply-add per token; the embedding is a row
  gather, the output head a full matmul) plus each mixer's own work on its state (``MIXER_FLOPS``);
- state bytes: the manifest's state tensors (float32), a dynamic ``past_length`` dimension set to ``t``;
- weight bytes: the size of ``step.onnx`` (graphs are self-contained, so this is what one step reads);
- floor: ``max((weight bytes + state bytes) / read bandwidth, FLOPs / matmul rate)``: no step can beat
  streaming its weights and state once, or doing its arithmetic at the machine's BLAS rate.

The bandwidth is DRAM's (a 512 MiB array). A model whose weights and state fit in the CPU's last-level
cache can run below this floor (a multiple under 1): its bytes come from cache, not memory. On devices
(a Jetson Orin's CPU caches hold a few MiB, its models tens of MiB) the DRAM floor is the one that binds.

Everything here reads the manifest and the checkpoint's safetensors header only (no torch, no onnx).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

from edgeattn.artifact.manifest import Manifest

BYTES_PER_PARAM = {"fp32": 4, "fp16": 2, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class Complexity:
    """Big-O cost of a family per layer; T tokens, d = d_model, H heads, C chunk, W window."""

    parallel: str  # training over T tokens at once
    chunk: str  # chunkwise training / prefill over T tokens
    decode: str  # one token
    state: str  # what decode keeps


_LINEAR = Complexity("O(T^2 d)", "O(T C d + T d^2/H)", "O(d^2/H)", "O(d^2/H)")
COMPLEXITY: dict[str, Complexity] = {
    "linear": _LINEAR,
    "performer": Complexity("O(T^2 F H)", "O(T C F H + T F d)", "O(F d)", "O(F d)"),
    "retnet": _LINEAR,
    "gla": _LINEAR,
    "aft": Complexity("O(T^2 d)", "O(T C d)", "O(d)", "O(d)"),
    "aft_local": Complexity("O(T^2 d)", "O(T C d + T W d)", "O(W d)", "O(W d)"),
    "flash": Complexity("O(T^2 s)", "O(T C (s + e) + T s e)", "O(C (s + e) + s e)", "O(C (s + e) + s e)"),
    "softmax": Complexity("O(T^2 d)", "O(T^2 d)", "O(T d)", "O(T d)"),
    "swa": Complexity("O(T W d)", "O(T W d)", "O(W d)", "O(W d)"),
    "deltanet": _LINEAR,
    "gated_deltanet": _LINEAR,
    "kda": _LINEAR,
    "mamba2": Complexity("O(T^2 e)", "O(T C e + T e N)", "O(e N)", "O(e N)"),  # e = expand * d, N state size
    "reformer": Complexity("O(R T^2 d)", "O(R T^2 d)", "O(R T d b)", "O(T d)"),  # whole buckets, masked
}
UNKNOWN = Complexity("?", "?", "?", "?")


def _gated(key_dim: Callable[[dict], int], normalized: bool, extra: Callable[[dict], int] = lambda c: 0):
    """Gated linear recurrence, per state element: decay (1), outer product k^T v (2), readout q S (2)."""

    def flops(c: dict, t: int) -> float:
        H, Dh = c["n_heads"], c["d_model"] // c["n_heads"]
        K = key_dim(c)
        return 5 * H * K * Dh + (4 * H * K if normalized else 0) + extra(c)

    return flops


def _softmax(c: dict, t: int) -> float:
    D, H = c["d_model"], c["n_heads"]
    n = t + 1  # keys attended, the new one included
    return 4 * n * D + 3 * H * n  # q . k and p . v (2 each per element), exp/sum/divide per score


def _swa(c: dict, t: int) -> float:
    D, H = c["d_model"], c["n_heads"]
    n = min(t + 1, c.get("window", 64)) + min(t + 1, c.get("n_sinks", 0))
    return 4 * n * D + 3 * H * n


def _flash(c: dict, t: int) -> float:
    e, s, C = (
        int(c.get("flash_expansion", 2.0) * c["d_model"]),
        c.get("flash_qk_dim", 128),
        c.get("flash_chunk", 64),
    )
    # linear part: readout q_lin S and the (amortized) chunk update k_lin^T v; quadratic part over the chunk
    return 4 * s * e + 2 * C * (s + e) + 4 * C


def _delta(c: dict, t: int) -> float:
    """Delta rule per state element: decay (1), recall k S (2), rank-one update (2), readout q S (2);
    plus the short conv over the q|k|v channels (2 W each)."""
    H = c["n_heads"]
    K = c["d_model"] // H
    HV = c.get("num_v_heads") or H
    V = int(K * c.get("expand_v", 1.0))
    return 7 * HV * K * V + 2 * c.get("conv_size", 4) * (2 * H * K + HV * V)


def _mamba2(c: dict, t: int) -> float:
    """Gated recurrence over [Hm, N, P] (5 per element), D skip, and the short conv over x|B|C."""
    inner = c.get("mamba_expand", 2) * c["d_model"]
    N, G = c.get("ssm_state_size", 16), c.get("mamba_n_groups", 1)
    return 5 * inner * N + 2 * inner + 2 * c.get("conv_size", 4) * (inner + 2 * G * N)


def _reformer(c: dict, t: int) -> float:
    """Hash the query and every cached key (R rounds, b/2 rotations each), then softmax over the cache."""
    D, H = c["d_model"], c["n_heads"]
    R, b = c.get("lsh_rounds", 2), c.get("lsh_buckets", 8)
    n = t + 1
    return R * (n * D * b + 4 * n * D + 3 * H * n)


# Mixer work per layer per token beyond its weight matmuls: name -> f(model config, context) -> FLOPs.
MIXER_FLOPS: dict[str, Callable[[dict, int], float]] = {
    "linear": _gated(lambda c: c["d_model"] // c["n_heads"], normalized=True),
    "performer": _gated(
        lambda c: c.get("feature_dim", 64),
        normalized=True,
        extra=lambda c: 4 * c["d_model"] * c.get("feature_dim", 64),  # random-feature maps of q and k
    ),
    "retnet": _gated(lambda c: c["d_model"] // c["n_heads"], normalized=False),
    "gla": _gated(lambda c: c["d_model"] // c["n_heads"], normalized=False),
    "aft": lambda c, t: 10 * c["d_model"],  # running max, two exp, numerator/denominator update, divide
    "aft_local": lambda c, t: 10 * c["d_model"] + 4 * c.get("window", 64) * c["d_model"],
    "flash": _flash,
    "softmax": _softmax,
    "swa": _swa,
    "deltanet": _delta,
    "gated_deltanet": _delta,
    "kda": _delta,
    "mamba2": _mamba2,
    "reformer": _reformer,
}


def family(manifest: Manifest) -> str:
    """The mixer name, or ``hybrid(a,b,...)`` for a stack of several."""
    names = layer_mixers(manifest)
    uniq = list(dict.fromkeys(names))
    return uniq[0] if len(uniq) == 1 else f"hybrid({','.join(uniq)})"


def layer_mixers(manifest: Manifest) -> list[str]:
    model = manifest.data.get("model", {})
    mixer, n = model.get("mixer", "?"), int(model.get("n_layers", 1))
    if isinstance(mixer, list):
        return list(mixer)
    return [m.strip() for m in mixer.split(",")] if "," in mixer else [mixer] * n


def checkpoint_tensors(manifest: Manifest) -> dict[str, list[int]] | None:
    """Tensor name -> shape from the artifact's checkpoint (safetensors header only), or None without one."""
    ckpt = manifest.data.get("checkpoint")
    path = manifest.root / ckpt / "model.safetensors" if ckpt else None
    if path is None or not path.is_file():
        return None
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: list(v["shape"]) for k, v in header.items()}


def _file_bytes(manifest: Manifest, rel: str) -> int:
    info = manifest.data.get("files", {}).get(rel, {})
    return int(info.get("bytes") or (manifest.root / rel).stat().st_size)


def shared_weight_bytes(manifest: Manifest) -> int:
    """Bytes of the weights file the graphs share (0 when each graph holds its own initializers)."""
    weights = manifest.data.get("weights")
    return _file_bytes(manifest, weights["path"]) if weights else 0


def graph_bytes(manifest: Manifest, graph: str) -> int:
    """Bytes one graph reads: its file plus the shared weights file, if any."""
    return _file_bytes(manifest, manifest.data["graphs"][graph]["path"]) + shared_weight_bytes(manifest)


def artifact_bytes(manifest: Manifest) -> int:
    """Bytes of the graphs a runtime loads, shared weights counted once (the checkpoint copy is left out)."""
    own = sum(_file_bytes(manifest, info["path"]) for info in manifest.data["graphs"].values())
    return own + shared_weight_bytes(manifest)


@dataclass
class Cost:
    """One artifact's analytic cost; ``at(t)`` gives the per-token figures at context t."""

    params: int
    matrix_params: int
    weight_bytes: int
    mixers: list[str]
    model: dict
    state: list  # manifest state entries: (layer, shape)

    def flops(self, t: int) -> float:
        extra = sum(MIXER_FLOPS.get(m, lambda c, t: 0.0)(self.model, t) for m in self.mixers)
        return 2.0 * self.matrix_params + extra

    def state_bytes(self, t: int) -> int:
        total = 0
        for shape in self.state:
            total += 4 * math.prod(t if isinstance(d, str) else int(d) for d in shape)
        return total

    def at(self, t: int, bandwidth: float, matmul_rate: float) -> dict:
        flops, state = self.flops(t), self.state_bytes(t)
        memory_s = (self.weight_bytes + state) / bandwidth
        compute_s = flops / matmul_rate
        return {
            "context": t,
            "flops": flops,
            "state_bytes": state,
            "weight_bytes": self.weight_bytes,
            "memory_floor_s": memory_s,
            "compute_floor_s": compute_s,
            "floor_s": max(memory_s, compute_s),
            "bound": "memory" if memory_s >= compute_s else "compute",
        }


def cost(manifest: Manifest) -> Cost:
    model = manifest.data.get("model", {})
    weight = graph_bytes(manifest, "step")
    tensors = checkpoint_tensors(manifest)
    if tensors is not None:
        params = sum(math.prod(s) for s in tensors.values())
        tied = model.get("tie_embeddings", True) or "lm_head.weight" not in tensors
        # Matrices are multiplied once per token; the embedding is a gather unless it is also the tied head.
        matrix = sum(
            math.prod(s) for k, s in tensors.items() if len(s) == 2 and (tied or not k.startswith("embed."))
        )
    else:  # exported without its checkpoint: estimate from the step graph's size
        params = matrix = int(weight // BYTES_PER_PARAM.get(manifest.precision, 4))
    return Cost(
        params=int(params),
        matrix_params=int(matrix),
        weight_bytes=weight,
        mixers=layer_mixers(manifest),
        model=model,
        state=[e.shape for e in manifest.state],
    )


def complexity(mixer: str) -> dict:
    names = [m for m in mixer.removeprefix("hybrid(").removesuffix(")").split(",")]
    if len(names) == 1:
        c = COMPLEXITY.get(names[0], UNKNOWN)
        return dict(parallel=c.parallel, chunk=c.chunk, decode=c.decode, state=c.state)
    # a hybrid stack costs the sum of its layers: the largest term dominates
    parts = [COMPLEXITY.get(n, UNKNOWN) for n in names]
    return {
        f: " + ".join(dict.fromkeys(getattr(p, f) for p in parts))
        for f in ("parallel", "chunk", "decode", "state")
    }
