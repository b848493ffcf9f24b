"""Sampling and stateful generation with the PyTorch model, through the runtimes' one sampler.

    gen = torch.Generator().manual_seed(0)
    next_ids = sample_next(logits[:, -1], temperature=0.8, top_k=50, top_p=0.95, generator=gen)  # [B]
    for token in generate(model, prompt_ids, max_new_tokens=200, seed=0, stop_ids=eos): ...

Both use ``edgeattn.runtimes.sampling.sample_next`` (numpy) and ``generate`` the runtimes' per-stream
``Decoder``: the same defaults (temperature 1, every token kept, a fresh generator without ``seed``), the
same tokens for the same logits and seed as ``Session.generate_ids``, and a stop before a token of
``stop_ids``. ``generate`` prefills the prompt in one call, then feeds one token at a time with the
recurrent state: memory per generated token is constant for the linear-attention mixers.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from edgeattn._deps import require
from edgeattn.runtimes import sampling
from edgeattn.runtimes.decode import Decoder

torch = require("torch")


def sample_next(logits, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, generator=None):
    """logits [B, V] -> next ids [B] (int64), each row by ``edgeattn.runtimes.sampling.sample_next``.
    ``generator`` (a ``torch.Generator``) seeds the rows' numpy generator, so a seeded generator repeats."""
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape [B, V], got {tuple(logits.shape)}")
    sampling.check_sampling(temperature, top_k, top_p)
    seed = None if generator is None else int(torch.randint(2**62, (1,), generator=generator))
    rng = np.random.default_rng(seed)
    rows = logits.detach().float().cpu().numpy()
    ids = [sampling.sample_next(r, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng) for r in rows]
    return torch.tensor(ids, dtype=torch.int64, device=logits.device)


def max_length(model) -> int | None:
    """Tokens a model may hold: ``max_seq_len`` where the state grows with the context (a softmax KV
    cache; what an export records as ``max_length``), None for a fixed-size state."""
    try:
        specs = model.state_spec(1)
    except ValueError:  # aft_full has no recurrent state at all; generating says so itself
        return None
    grows = any(isinstance(d, str) for layer in specs for s in layer for d in s.shape)
    return model.cfg.max_seq_len if grows else None


@torch.no_grad()
def generate(
    model,
    prompt_ids,
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_ids=(),
) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` ids after ``prompt_ids`` (a non-empty list of ints), one at a time,
    stopping before a token of ``stop_ids`` (an imported model's end-of-sequence ids), as
    ``Session.generate_ids`` does."""
    if len(prompt_ids) == 0:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    dec = Decoder(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop_ids=stop_ids,
        max_new_tokens=max_new_tokens,
    )
    limit = max_length(model)
    if limit is not None and len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(
            f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new tokens exceed this softmax model's "
            f"maximum of {limit} (max_seq_len, as its export would record); generate at most "
            f"{max(limit - len(prompt_ids), 0)}, or train it with a larger --max-seq-len"
        )
    device = next(model.parameters()).device
    model.eval()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.int64, device=device)
    logits, state = model(ids)  # prefill: the whole prompt in one call
    while (nxt := dec.next(logits[0, -1].float().cpu().numpy())) is not None:
        yield nxt
        if dec.done:
            return
        logits, state = model(torch.tensor([[nxt]], dtype=torch.int64, device=device), state=state)
