"""``attention(q, k, v, *, method, causal=True, seed=0, **options)``: one entry point over every mechanism.

In the spirit of xFormers' ``memory_efficient_attention``: same ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``
in, ``o: [B, T, H, V]`` out, whatever the method. Random projections (performer, rff, lsh) are drawn
from ``seed``, so two calls with the same seed use the same features. Families that have learned
parameters in their mixer use fixed stand-ins here, listed in ``METHODS``' comments.

The ``hybrid`` method is the notes' length switch: exact softmax when ``T <= switch_length``, a
linear method above. It is for whole sequences only. A recurrent deployment cannot switch mechanism
in the middle of a sequence: once past the threshold it would need the softmax KV cache of every
earlier token to compute the linear state, or the linear state of tokens it had only cached, so its
state would be the KV cache after all and memory would grow with the context. edgeattn offers
instead fixed per-layer hybrids (``EdgeConfig(mixer="gla,gla,swa,gla")``) and sliding-window
softmax with attention sinks (``swa``), both with a fixed-size state.
"""

from __future__ import annotations

from collections.abc import Callable

from edgeattn._deps import require
from edgeattn.ops.aft import aft
from edgeattn.ops.common import gated_linear_attention
from edgeattn.ops.linear import elu1
from edgeattn.ops.lsh import lsh_attention
from edgeattn.ops.nystrom import nystrom_attention
from edgeattn.ops.performer import favor_features, orthogonal_random_features
from edgeattn.ops.retnet import retention
from edgeattn.ops.rff import gaussian_projection, rff_attention
from edgeattn.ops.softmax import softmax_attention
from edgeattn.ops.utils import check_dims, check_rank

torch = require("torch")
F = torch.nn.functional
Tensor = torch.Tensor

METHODS: tuple[str, ...] = (
    "softmax",  # exact; options: scale, window, sink (causal only with a window)
    "linear",  # Linear Transformer, elu+1 features, normalized; options: eps
    "performer",  # FAVOR+ orthogonal positive random features; options: n_features (64), eps
    "rff",  # random Fourier features, clamped normalizer; options: n_features (64), eps
    "lsh",  # Reformer; options: n_buckets (8), n_rounds (1), bucket_size (64), shared_qk (False), exclude_self
    "nystrom",  # Nystromformer, causal=False only; options: n_landmarks (32), n_iter (6), pinv, conv_weight
    "hybrid",  # softmax when T <= switch_length (512), else long_method ("linear", "performer" or "rff")
    "retnet",  # retention with RetNet's fixed per-head decays; causal only
    "gla",  # gated linear attention; the mixer's learned gate is absent: option g (log gates) or no decay
    "swa",  # sliding-window softmax; options: window (64), sink (0); causal only
    "aft",  # AFT over the heads flattened to [B, T, H K] (needs K == V); options: decay, window_bias (none)
)


def _non_causal_linear(fq: Tensor, fk: Tensor, v: Tensor, eps: float) -> Tensor:
    """o_t = fq_t (sum_i fk_i^T v_i) / (fq_t . sum_i fk_i + eps): every token sees the whole sequence."""
    kv = torch.einsum("bthm,bthv->bhmv", fk, v)  # [B, H, m, V]
    num = torch.einsum("bthm,bhmv->bthv", fq, kv)
    den = torch.einsum("bthm,bhm->bth", fq, fk.sum(1)).unsqueeze(-1)
    return num / (den + eps)


def _feature_linear(fq, fk, v, causal, eps):
    if not causal:
        acc = torch.promote_types(fq.dtype, torch.float32)
        return _non_causal_linear(fq.to(acc), fk.to(acc), v.to(acc), eps).to(v.dtype)
    return gated_linear_attention(fq, fk, v, None, normalize=True, eps=eps)[0]


def _softmax(q, k, v, causal, seed, scale=None, window=None, sink=0):
    if causal or window is not None:
        if not causal:
            raise ValueError("softmax with a window is causal only (causal=True)")
        return softmax_attention(q, k, v, scale=scale, window=window, sink=sink)[0]
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    return F.scaled_dot_product_attention(qh, kh, vh, scale=scale).transpose(1, 2)


def _linear(q, k, v, causal, seed, eps=1e-6):
    return _feature_linear(elu1(q), elu1(k), v, causal, eps)


def _generator(seed: int):
    return torch.Generator().manual_seed(seed)


def _check_features(n_features) -> None:
    if isinstance(n_features, bool) or not isinstance(n_features, int) or n_features < 1:
        raise ValueError(f"n_features must be an int >= 1, got {n_features!r}")


def _performer(q, k, v, causal, seed, n_features=64, eps=1e-6):
    _check_features(n_features)
    w = orthogonal_random_features(n_features, q.shape[-1], _generator(seed)).to(q.device)
    return _feature_linear(favor_features(q, w, is_query=True), favor_features(k, w), v, causal, eps)


def _rff(q, k, v, causal, seed, n_features=64, eps=1e-6):
    _check_features(n_features)
    w = gaussian_projection(n_features, q.shape[-1], _generator(seed)).to(q.device)
    return rff_attention(q, k, v, w, causal=causal, eps=eps)[0]


def _lsh(q, k, v, causal, seed, shared_qk=False, **kw):
    return lsh_attention(q, None if shared_qk else k, v, causal=causal, seed=seed, **kw)[0]


def _nystrom(q, k, v, causal, seed, **kw):
    return nystrom_attention(q, k, v, causal=causal, **kw)[0]


_LONG = {"linear": _linear, "performer": _performer, "rff": _rff}


def _hybrid(q, k, v, causal, seed, switch_length=512, long_method="linear", **kw):
    if isinstance(switch_length, bool) or not isinstance(switch_length, int) or switch_length < 0:
        raise ValueError(f"switch_length must be an int >= 0, got {switch_length!r}")
    if long_method not in _LONG:
        raise ValueError(f"long_method must be one of {', '.join(_LONG)}, got {long_method!r}")
    if q.shape[1] <= switch_length:
        return _softmax(q, k, v, causal, seed)
    return _LONG[long_method](q, k, v, causal, seed, **kw)


def _causal_only(name: str, causal: bool) -> None:
    if not causal:
        raise ValueError(f"method {name!r} is a causal recurrence: it needs causal=True")


def _retnet(q, k, v, causal, seed):
    _causal_only("retnet", causal)
    return retention(q, k, v)[0]


def _gla(q, k, v, causal, seed, g=None):
    _causal_only("gla", causal)
    return gated_linear_attention(q, k, v, g)[0]


def _swa(q, k, v, causal, seed, window=64, sink=0):
    _causal_only("swa", causal)
    return softmax_attention(q, k, v, window=window, sink=sink)[0]


def _aft(q, k, v, causal, seed, decay=None, window_bias=None):
    _causal_only("aft", causal)
    B, T, H, K = q.shape
    if v.shape[-1] != K:
        raise ValueError(f"method 'aft' needs v's head size V equal to K = {K}, got {v.shape[-1]}")
    flat = (x.reshape(B, T, H * K) for x in (q, k, v))  # [B, T, H K]
    return aft(*flat, decay=decay, window_bias=window_bias)[0].reshape(B, T, H, K)


_DISPATCH: dict[str, Callable] = {
    "softmax": _softmax,
    "linear": _linear,
    "performer": _performer,
    "rff": _rff,
    "lsh": _lsh,
    "nystrom": _nystrom,
    "hybrid": _hybrid,
    "retnet": _retnet,
    "gla": _gla,
    "swa": _swa,
    "aft": _aft,
}
assert tuple(_DISPATCH) == METHODS


def attention(q: Tensor, k: Tensor, v: Tensor, *, method: str, causal: bool = True, seed: int = 0, **options):
    """Attention of ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]`` by ``method`` (one of ``METHODS``).

    ``options`` go to the method (see ``METHODS``); an option the method does not take is a TypeError
    naming it. Returns ``o: [B, T, H, V]`` in q's dtype.
    """
    if method not in _DISPATCH:
        raise ValueError(f"unknown attention method {method!r}; expected one of {', '.join(METHODS)}")
    check_rank("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    check_dims("k", k, (B, T, H, K), "[B, T, H, K] (as q)")
    check_rank("v", v, 4, "[B, T, H, V]")
    check_dims("v", v, (B, T, H, None), "[B, T, H, V] (B, T, H as q)")
    return _DISPATCH[method](q, k, v, bool(causal), seed, **options)


__all__ = ["METHODS", "attention"]
