"""EdgeLM: pre-norm blocks (RMSNorm, mixer, RMSNorm, SwiGLU MLP) over byte embeddings.

    logits, state = model(input_ids)              # [B, T] int64 -> [B, T, vocab]
    logits, state = model(next_ids, state=state)  # continues exactly

The state is a list with one dict of named tensors per layer (see ``Mixer.state_spec``).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

from edgeattn._atomic import make_temp_dir, replace_dir
from edgeattn._deps import require
from edgeattn.artifact.sources import CONFIG, WEIGHTS  # a checkpoint's two files
from edgeattn.layers import build_mixer
from edgeattn.models.config import EdgeConfig

torch = require("torch")
nn = torch.nn
F = torch.nn.functional


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ratio: float, hidden: int = 0):
        super().__init__()
        hidden = hidden or 32 * -(-int(dim * ratio) // 32)  # rounded up to a multiple of 32
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


def make_norm(cfg: EdgeConfig):
    return (
        RMSNorm(cfg.d_model, cfg.norm_eps) if cfg.norm == "rms" else nn.LayerNorm(cfg.d_model, cfg.norm_eps)
    )


class Block(nn.Module):
    def __init__(self, cfg: EdgeConfig, layer_idx: int, mixer: str):
        super().__init__()
        self.norm1 = make_norm(cfg)
        self.mixer = build_mixer(mixer, cfg.for_mixer(mixer), layer_idx)
        self.has_mlp = cfg.intermediate_size >= 0  # -1: mixer-only blocks (Mamba2)
        # A mixer with a stateful feed-forward part of its own (RWKV's channel mixing) fills the MLP slot.
        self.own_mlp = hasattr(self.mixer, "channel_mix")
        if self.has_mlp:
            self.norm2 = make_norm(cfg)
            if not self.own_mlp:
                self.mlp = SwiGLU(cfg.d_model, cfg.mlp_ratio, cfg.intermediate_size)

    def forward(self, x, state):
        y, state = self.mixer(self.norm1(x), state)
        x = x + y
        if not self.has_mlp:
            return x, state
        if self.own_mlp:
            y, state = self.mixer.channel_mix(self.norm2(x), state)
            return x + y, state
        return x + self.mlp(self.norm2(x)), state


_META_LOCK = threading.Lock()


@contextmanager
def _parameters_on_meta():
    """Modules built inside register their parameters on the meta device (no memory, no initialisation) and
    their buffers as usual (what accelerate's ``init_empty_weights(include_buffers=False)`` does): the
    parameters are then adopted from a state dict (``EdgeLM.from_state_dict``, which holds ``_META_LOCK``
    around it and the adoption: it patches ``nn.Module.register_parameter`` for its duration, process-wide,
    so two interleaved callers would leave the patch installed or adopt meta tensors; modules that other
    threads build in that window are affected too)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _owned(t):
    """``t`` itself when it is contiguous and alone in its storage, else a compact copy (a slice of a larger
    source tensor would keep the whole source alive, and safetensors refuses tensors that share memory)."""
    whole = t.untyped_storage().nbytes() == t.numel() * t.element_size()
    return t if whole and t.is_contiguous() and t.storage_offset() == 0 else t.contiguous().clone()


class EdgeLM(nn.Module):
    def __init__(self, cfg: EdgeConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.embed_norm:
            self.embed_norm = make_norm(cfg)
        self.blocks = nn.ModuleList(Block(cfg, i, name) for i, name in enumerate(cfg.mixers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # Residual projections start small so that deep stacks begin close to the identity (GPT-2).
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "w_down.weight")):
                nn.init.normal_(p, std=cfg.init_std / (2 * cfg.n_layers) ** 0.5)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=self.cfg.init_std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=self.cfg.init_std)

    @property
    def mixers(self):
        return [b.mixer for b in self.blocks]

    def init_state(self, batch_size: int = 1, device=None) -> list[dict]:
        return [m.init_state(batch_size, device) for m in self.mixers]

    def set_kv_buffers(self, length: int | None, layers=None) -> list[int]:
        """The declared option that switches the softmax layers' KV cache: with ``length``, the layers that
        support it (those in ``layers``, default all) keep a preallocated buffer of ``length`` tokens, past
        and present in one tensor (ONNX Runtime's GroupQueryAttention; the exporter's onnxruntime target and
        the torch backend of such an artifact); None: the growing cache. Returns the buffered layers."""
        used = []
        for i, block in enumerate(self.blocks):
            if getattr(block.mixer, "supports_kv_buffer", False):
                on = length is not None and (layers is None or i in layers)
                block.mixer.kv_buffer = length if on else None
                if on:
                    used.append(i)
        return used

    def kv_buffer_layers(self) -> list[int]:
        """The layers that keep a preallocated KV buffer (``set_kv_buffers``)."""
        return [i for i, b in enumerate(self.blocks) if getattr(b.mixer, "kv_buffer", None)]

    def state_spec(self, batch_size: int = 1):
        return [m.state_spec(batch_size) for m in self.mixers]

    def check_input_ids(self, input_ids) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            shape = (
                tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            )
            raise ValueError(f"input_ids must have shape [B, T], got {shape}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids must be int64 token ids, got {input_ids.dtype}")
        # while a CUDA graph is captured (the torch backend's steps) the ids cannot be read on the host
        capturing = input_ids.is_cuda and torch.cuda.is_current_stream_capturing()
        if not (torch.compiler.is_compiling() or torch.jit.is_tracing() or capturing) and input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise ValueError(
                    f"input_ids must lie in [0, {self.cfg.vocab_size}), got values in [{lo}, {hi}]"
                )

    def forward(self, input_ids, state=None):
        """input_ids: [B, T] -> (logits [B, T, vocab], new state). ``state=None`` starts from zeros."""
        self.check_input_ids(input_ids)
        if state is not None and (not isinstance(state, list | tuple) or len(state) != len(self.blocks)):
            raise ValueError(f"state must be a list of {len(self.blocks)} per-layer dicts (from this model)")
        x = self.embed(input_ids)
        if self.cfg.embed_norm:
            x = self.embed_norm(x)
        new_state = []
        for i, block in enumerate(self.blocks):
            x, s = block(x, None if state is None else state[i])
            new_state.append(s)
        return self.lm_head(self.norm(x)), new_state

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- checkpoints: a directory with safetensors weights and a JSON config, written atomically ----

    def save(self, path: str | os.PathLike) -> Path:
        """Write the checkpoint directory ``path`` whole (a temporary beside it, swapped into place)."""
        path = Path(path)
        tmp = make_temp_dir(path)
        try:
            self.save_files(tmp)
            replace_dir(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return path

    def save_files(self, directory: str | os.PathLike) -> None:
        """Write model.safetensors and config.json into the existing ``directory`` (not atomic: ``save``
        and the trainer's checkpoints call it on a temporary directory)."""
        from safetensors.torch import save_file

        directory = Path(directory)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        if self.cfg.tie_embeddings:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(directory / WEIGHTS), metadata={"format": "pt"})
        (directory / CONFIG).write_text(self.cfg.to_json())

    @classmethod
    def from_state_dict(cls, cfg: EdgeConfig, state_dict: dict) -> tuple[EdgeLM, list[str], list[str]]:
        """The model of ``cfg`` holding the tensors of ``state_dict`` themselves (each taken over, not
        copied; the dict is emptied), its parameters never randomly initialised: one copy of the weights in
        memory where ``cls(cfg)`` plus ``load_state_dict`` held two. Returns (model, missing, unexpected) as
        ``load_state_dict`` does; a missing parameter stays on the meta device (the caller refuses it)."""
        with _META_LOCK:
            with _parameters_on_meta():
                model = cls(cfg)
            owned = {}
            for name in list(state_dict):
                owned[name] = _owned(state_dict.pop(name))
            missing, unexpected = model.load_state_dict(owned, strict=False, assign=True)
            del owned
            if cfg.tie_embeddings:  # the head shares the adopted table (load_state_dict replaced the object)
                model.lm_head.weight = model.embed.weight
        missing = [m for m in missing if not (cfg.tie_embeddings and m == "lm_head.weight")]
        return model, missing, list(unexpected)

    @classmethod
    def load(cls, path: str | os.PathLike, map_location: str = "cpu") -> EdgeLM:
        """The checkpoint directory ``path``; ValueError when it is incomplete, corrupt, does not match its
        config or holds a NaN or infinite weight."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
            raise ValueError(f"{path} is not an edgeattn checkpoint (needs {CONFIG} and {WEIGHTS})")
        try:
            cfg = EdgeConfig.from_dict(json.loads((path / CONFIG).read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path / CONFIG} is not a valid config: {e}") from e
        try:
            tensors = load_file(str(path / WEIGHTS), device=map_location)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path / WEIGHTS} is corrupt: {e}") from e
        for name, t in tensors.items():  # a NaN weight would export and run, sampling from NaN logits
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"{path / WEIGHTS}: weight {name} holds non-finite values (NaN or infinity)")
        model, missing, unexpected = cls.from_state_dict(cfg, tensors)
        if missing or unexpected:
            raise ValueError(
                f"{path} does not match its config: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        return model
