"""Sampling from logits (temperature, top-k, top-p) and stateful generation with the PyTorch model.

    gen = torch.Generator().manual_seed(0)
    next_ids = sample_next(logits[:, -1], temperature=0.8, top_k=50, top_p=0.95, generator=gen)  # [B]
    for token in generate(model, prompt_ids, max_new_tokens=200, seed=0): ...

``generate`` prefills the prompt in one call, then feeds one token at a time with the recurrent state:
memory per generated token is constant for the linear-attention mixers.
"""

from __future__ import annotations

from collections.abc import Iterator

from edgeattn._deps import require
from edgeattn.runtimes.sampling import check_sampling, finite_logits

torch = require("torch")


def sample_next(logits, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, generator=None):
    """logits [B, V] -> next ids [B] (int64). ``temperature <= 0`` is greedy (so is one so small that
    ``logits / temperature`` overflows); ``top_k`` 0 and ``top_p`` 1 keep every token. Top-k applies first, then top-p keeps the smallest set of most likely tokens whose
    probability reaches ``top_p`` (always at least one)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape [B, V], got {tuple(logits.shape)}")
    check_sampling(temperature, top_k, top_p)
    if not bool(torch.isfinite(logits).all()):
        finite_logits(logits.float().cpu().numpy())  # the sessions' one-line refusal
    logits = logits.float()
    if temperature <= 0:
        return logits.argmax(-1)
    greedy = logits.argmax(-1)
    logits = logits / temperature
    # [B] rows where logits / temperature overflowed: the limit of temperature -> 0 is greedy
    overflow = torch.isnan(logits).any(-1) | ~torch.isfinite(logits.max(-1).values)
    logits = logits.masked_fill(overflow[:, None], 0.0)
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p (so the first one always stays).
        drop = (cum - sorted_logits.softmax(-1)) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.where(overflow, greedy, torch.multinomial(probs, 1, generator=generator).squeeze(-1))


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
) -> Iterator[int]:
    """Yield ``max_new_tokens`` ids after ``prompt_ids`` (a non-empty list of ints), one at a time."""
    if len(prompt_ids) == 0:
        raise ValueError("the prompt must hold at least one token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    limit = max_length(model)
    if limit is not None and len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(
            f"{len(prompt_ids)} prompt tokens + {max_new_tokens} new tokens exceed this softmax model's "
            f"maximum of {limit} (max_seq_len, as its export would record); generate at most "
            f"{max(limit - len(prompt_ids), 0)}, or train it with a larger --max-seq-len"
        )
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(0 if seed is None else seed)
    model.eval()
    ids = torch.tensor([list(prompt_ids)], dtype=torch.int64, device=device)
    logits, state = model(ids)  # prefill: the whole prompt in one call
    for _ in range(max_new_tokens):
        nxt = sample_next(logits[:, -1], temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
        yield int(nxt.item())
        logits, state = model(nxt.view(1, 1), state=state)
