"""Nystromformer attention (Xiong et al. 2021): softmax attention through m landmarks. Bidirectional only.

    Q~, K~ = segment means of Q, K over m contiguous segments (landmarks)          [m, K]
    F = softmax(s Q K~^T)  [T, m],   A = softmax(s Q~ K~^T)  [m, m],   B = softmax(s Q~ K^T)  [m, T]
    o = F A^+ (B V)  (+ depthwise conv of V over time, the paper's skip)

``A^+`` is the iterative Moore-Penrose pseudo-inverse of the paper (Razavi et al. 2014), 6 iterations:

    Z_0 = A^T / (max_j sum_i |A_ij| * max_i sum_j |A_ij|),
    Z_{n+1} = Z_n (13 I - A Z_n (15 I - A Z_n (7 I - A Z_n))) / 4

With m = T the landmarks are the tokens themselves and o = A A^+ A V = softmax attention.
Segments: token i belongs to segment floor(i m / T), so T need not be a multiple of m.

Every output mixes the whole sequence through the landmarks, so there is no causal form and no
recurrent state: ``causal=True`` is refused.
"""

from __future__ import annotations

from edgeattn._deps import require
from edgeattn.ops.utils import check_dims, check_rank

torch = require("torch")
F = torch.nn.functional
Tensor = torch.Tensor

__all__ = ["iterative_pinv", "nystrom_attention", "segment_means"]

CAUSAL_ERROR = (
    "nystrom attention is bidirectional (every landmark averages the whole sequence), so it has no causal "
    "or recurrent form; use causal=False (an encoder), or a causal method such as softmax, linear or lsh"
)


def segment_means(x: Tensor, m: int) -> Tensor:
    """x [..., T, D] -> [..., m, D], the mean of each of m contiguous segments (token i in floor(i m / T))."""
    T = x.shape[-2]
    seg = torch.arange(T, device=x.device) * m // T  # [T]
    onehot = (seg[None, :] == torch.arange(m, device=x.device)[:, None]).to(x.dtype)  # [m, T]
    return (onehot / onehot.sum(-1, keepdim=True)) @ x


def iterative_pinv(a: Tensor, n_iter: int = 6) -> Tensor:
    """Approximate Moore-Penrose pseudo-inverse of a: [..., m, m] (the paper's iteration, per matrix)."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    col = a.abs().sum(-2).amax(-1)  # max column sum, [...]
    row = a.abs().sum(-1).amax(-1)  # max row sum
    z = a.transpose(-1, -2) / (col * row)[..., None, None]
    for _ in range(n_iter):
        az = a @ z
        z = 0.25 * z @ (13 * eye - az @ (15 * eye - az @ (7 * eye - az)))
    return z


def nystrom_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    n_landmarks: int = 32,
    causal: bool = False,
    scale: float | None = None,
    n_iter: int = 6,
    pinv: str = "iterative",
    conv_weight: Tensor | None = None,
):
    """Nystrom attention over ``q, k: [B, T, H, K]``, ``v: [B, T, H, V]``; ``causal=True`` is a ValueError.

    ``n_landmarks`` (1 <= m <= T) segment-mean landmarks; ``scale`` defaults to ``K ** -0.5``;
    ``pinv="iterative"`` (the paper's ``n_iter`` iterations) or ``"exact"`` (``torch.linalg.pinv``, SVD);
    ``conv_weight: [H, W]`` (odd W) adds the paper's depthwise convolution of V over time per head
    (zero-padded, centred). Returns ``(o [B, T, H, V], None)``.
    """
    if causal:
        raise ValueError(CAUSAL_ERROR)
    check_rank("q", q, 4, "[B, T, H, K]")
    B, T, H, K = q.shape
    check_dims("k", k, (B, T, H, K), "[B, T, H, K] (as q)")
    check_rank("v", v, 4, "[B, T, H, V]")
    check_dims("v", v, (B, T, H, None), "[B, T, H, V] (B, T, H as q)")
    m = n_landmarks
    if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= max(T, 1):
        raise ValueError(f"n_landmarks must be an int in [1, T = {T}], got {m!r}")
    if isinstance(n_iter, bool) or not isinstance(n_iter, int) or n_iter < 0:
        raise ValueError(f"n_iter must be an int >= 0, got {n_iter!r}")
    if pinv not in ("iterative", "exact"):
        raise ValueError(f"pinv must be 'iterative' or 'exact', got {pinv!r}")
    if conv_weight is not None:
        check_rank("conv_weight", conv_weight, 2, "[H, W]")
        if conv_weight.shape[0] != H or conv_weight.shape[1] % 2 == 0:
            raise ValueError(
                f"conv_weight must have shape [H, W] with H = {H} and W odd, got {tuple(conv_weight.shape)}"
            )
    if scale is None:
        scale = K**-0.5
    acc = torch.promote_types(q.dtype, torch.float32)
    qh, kh, vh = (x.to(acc).transpose(1, 2) for x in (q, k, v))  # [B, H, T, D]
    q_l, k_l = segment_means(qh, m), segment_means(kh, m)  # [B, H, m, K]
    f = torch.softmax(scale * qh @ k_l.transpose(-1, -2), -1)  # [B, H, T, m]
    a = torch.softmax(scale * q_l @ k_l.transpose(-1, -2), -1)  # [B, H, m, m]
    b = torch.softmax(scale * q_l @ kh.transpose(-1, -2), -1)  # [B, H, m, T]
    a_pinv = iterative_pinv(a, n_iter) if pinv == "iterative" else torch.linalg.pinv(a)
    o = f @ (a_pinv @ (b @ vh))  # [B, H, T, V]
    if conv_weight is not None:
        W = conv_weight.shape[1]
        Vd = vh.shape[-1]
        x = vh.permute(0, 3, 1, 2).reshape(B * Vd, H, T)  # [B V, H, T]: one channel per head
        y = F.conv1d(x, conv_weight.to(acc).unsqueeze(1), padding=W // 2, groups=H)
        o = o + y.reshape(B, Vd, H, T).permute(0, 2, 3, 1)
    return o.transpose(1, 2).to(q.dtype), None
