"""EdgeConfig: the model's whole description, saved next to the weights as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from edgeattn import MIXERS


@dataclass
class EdgeConfig:
    vocab_size: int = 256  # byte-level by default: no tokenizer to download
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4  # head size d_model // n_heads for queries, keys and values
    mixer: str | list[str] = "gla"  # one name for every layer, or one name per layer (hybrid stacks)
    mlp_ratio: float = 8 / 3  # SwiGLU hidden size = mlp_ratio * d_model, rounded up to a multiple of 32
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    chunk_size: int = 64  # chunk of the chunkwise form used for training and prefill
    init_std: float = 0.02
    # family options (read only by the mixers that use them)
    feature_dim: int = 64  # performer: random features per head
    gate_low_rank: int = 16  # gla: rank of the gate projection x W1 W2
    gate_logit_normalizer: int = 16  # gla: alpha_t = sigmoid(x W1 W2 + b) ** (1 / 16)
    window: int = 64  # swa: attention window; aft_local: window-bias length W
    n_sinks: int = 4  # swa: first tokens always attended (attention sinks)
    flash_chunk: int = 64  # flash: group size of mixed-chunk attention
    flash_expansion: float = 2.0  # flash: GAU hidden size = expansion * d_model
    flash_qk_dim: int = 128  # flash: size s of the shared Z
    max_seq_len: int = 2048  # softmax: KV-cache bound of an exported baseline; aft_full: bias size
    num_v_heads: int = 0  # deltanet/gated_deltanet/kda: value heads HV, a multiple of n_heads (0: n_heads)
    expand_v: float = (
        1.0  # delta-rule families, linear/performer/retnet/gla: value head width = expand_v * head_dim
    )
    allow_neg_eigval: bool = False  # deltanet/gated_deltanet/kda: beta = 2 sigmoid(.) in (0, 2)
    conv_size: int = 4  # deltanet/gated_deltanet/kda/mamba2: short convolution width W (state W - 1)
    ssm_state_size: int = 16  # mamba2: N, the state size per head (B and C width per group)
    mamba_head_dim: int = 16  # mamba2: P, channels per head; heads = mamba_expand * d_model / P
    mamba_expand: int = 2  # mamba2: inner width I = mamba_expand * d_model
    mamba_n_groups: int = 1  # mamba2: G groups of B and C shared by the heads (and of the gated norm)
    # linear, performer: "elu1", "favor" (FAVOR+) or "rff" (random Fourier features, feature_dim
    # frequencies -> 2 * feature_dim features); "default" keeps each family's own (elu1, favor).
    # Imported fla models: linear also "hadamard" (fla's learned elementwise_product) or an elementwise
    # map "identity", "relu", "elu", "silu", "sigmoid"; retnet "default" (none) or an elementwise map.
    feature_map: str = "default"
    lsh_buckets: int = 8  # reformer: angular LSH buckets per round (1 or even)
    lsh_rounds: int = 2  # reformer: hashing rounds, averaged by their log-sum-exp
    # Imported models (edgeattn.convert); the defaults leave edgeattn's own models unchanged.
    head_size: int = 0  # softmax/swa, linear/performer/retnet/gla: (key) head width (0: d_model // n_heads)
    n_kv_heads: int = (
        0  # softmax, retnet, linear: grouped key/value heads, n_heads a multiple of it (0: n_heads)
    )
    rope_theta: float = 0.0  # softmax, retnet: rotary embeddings on q/k with this base (0: none, NoPE)
    rotary_dim: int = 0  # softmax, retnet: leading head dims rotated (partial rotary; 0: the whole head)
    qk_norm: bool = False  # softmax: RMSNorm over each q and k head (with weights) before the rotary
    attn_output_gate: bool = False  # softmax: o * sigmoid(x W_g) per head, W_g interleaved in q_proj
    intermediate_size: int = 0  # SwiGLU hidden size (0: from mlp_ratio); -1: no MLP (Mamba2 blocks)
    linear_n_heads: int = 0  # delta-rule layers of a hybrid stack: key heads (0: n_heads)
    linear_key_dim: int = 0  # delta-rule layers: key head width (0: d_model // n_heads)
    linear_value_dim: int = 0  # delta-rule layers: value head width (0: expand_v * key width)
    attn_normalize: bool = True  # linear: o / (q . z); False: o = K^-1/2 q S unnormalized (fla's linear_attn)
    qk_sum_norm: str = ""  # linear: "q", "k" or "qk" divided by their sum + 1e-4 after the feature map
    output_norm: bool = False  # linear: per-head RMSNorm (with weights) of the output before o_proj
    output_gate: bool = True  # retnet: swish(x W_g) times the normed output (False: the norm alone)
    norm: str = "rms"  # block and final norms: "rms" (RMSNorm) or "layer" (LayerNorm with bias, RWKV)
    embed_norm: bool = False  # a norm right after the embedding (RWKV's pre_ln)
    extra: dict = field(default_factory=dict)  # free-form, kept through save/load

    def __post_init__(self) -> None:
        names = self.mixers
        if len(names) != self.n_layers:
            raise ValueError(
                f"mixer must be one name or {self.n_layers} names (one per layer), got {len(names)}"
            )
        for name in names:
            if name not in MIXERS:
                raise ValueError(f"unknown mixer {name!r}; expected one of {', '.join(MIXERS)}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "chunk_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads and not self.head_size:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        key_heads = self.linear_n_heads or self.n_heads
        if self.num_v_heads % key_heads:
            raise ValueError(
                f"num_v_heads ({self.num_v_heads}) must be a multiple of the key heads ({key_heads})"
            )
        if self.conv_size < 2:
            raise ValueError(
                f"conv_size must be >= 2 (the conv state keeps conv_size - 1 inputs), got {self.conv_size}"
            )
        if self.norm not in ("rms", "layer"):
            raise ValueError(f"norm must be 'rms' or 'layer', got {self.norm!r}")
        if self.n_kv_heads and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.qk_sum_norm not in ("", "q", "k", "qk"):
            raise ValueError(f"qk_sum_norm must be '', 'q', 'k' or 'qk', got {self.qk_sum_norm!r}")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(
                f"rotary_dim must be even and <= the head width {self.head_dim}, got {self.rotary_dim}"
            )

    @property
    def mixers(self) -> list[str]:
        """One mixer name per layer."""
        if isinstance(self.mixer, str):
            return (
                [n.strip() for n in self.mixer.split(",")]
                if "," in self.mixer
                else [self.mixer] * self.n_layers
            )
        return list(self.mixer)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    def for_mixer(self, name: str) -> EdgeConfig:
        """The configuration one layer of mixer ``name`` is built from: in a hybrid stack the delta-rule
        layers may have their own head count and widths (``linear_*``), as Qwen3.5's have."""
        if name not in ("deltanet", "gated_deltanet", "kda") or not (
            self.linear_n_heads or self.linear_key_dim or self.linear_value_dim
        ):
            return self
        from dataclasses import replace

        H = self.linear_n_heads or self.n_heads
        K = self.linear_key_dim or self.d_model // H
        V = self.linear_value_dim or int(K * self.expand_v)
        view = replace(self, n_heads=H, head_size=K, expand_v=V / K, n_kv_heads=0, rotary_dim=0)
        if int(K * view.expand_v) != V:
            raise ValueError(f"linear_value_dim {V} is not representable as expand_v * {K}")
        return view

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> EdgeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown EdgeConfig fields: {', '.join(unknown)}")
        return cls(**d)
