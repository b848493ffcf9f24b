"""The per-stream decisions of generation, shared by ``Session.generate_ids``, ``Streams`` and training's
``generate``: sample the next token from the last logits with the stream's own generator
(``sampling.sample_next``, with the repetition penalty over the stream's context), stop before a stop token (which the runtimes still feed to the graph, so the
state holds it) or after ``max_new_tokens``. numpy only.

    dec = Decoder(temperature=0.8, top_k=50, seed=0, stop_ids=tok.eos_token_ids)
    tok = dec.next(logits)        # None once the stream stopped
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from edgeattn.runtimes.sampling import (
    check_sampling,
    check_seed,
    logit_bias_arrays,
    next_distribution,
    sample_next,
)


@dataclass
class Decoder:
    """One stream's sampling parameters, generator, stop ids and the tokens it produced."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: frozenset = frozenset()
    max_new_tokens: int | None = None
    repetition_penalty: float = 1.0  # over the context's tokens (1: none)
    repetition_window: int = 0  # the last this many tokens of the context (0: all, as transformers)
    logit_bias: dict | tuple | None = (
        None  # OpenAI's {token id: bias in [-100, 100]} (sampling.apply_logit_bias)
    )
    vocab_size: int | None = None  # checks logit_bias's ids at once where given
    context: list = field(default_factory=list)  # the prompt and the generated tokens (for the penalty)
    # logits processors of the serving layer (a grammar's mask, a logprobs recorder): each has
    # ``process(logits) -> logits`` (before sampling) and ``accept(token, raw_logits)`` (after, a stop token too)
    processors: list = field(default_factory=list)
    generated: list = field(default_factory=list)
    done: bool = False
    last: int | None = None  # the last sampled token, a stop token included (the graph consumes it)

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p, self.repetition_penalty)
        check_seed(self.seed)
        self.logit_bias = logit_bias_arrays(self.logit_bias, self.vocab_size)
        w = self.repetition_window
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"repetition_window must be an integer >= 0 (0: every token), got {w!r}")
        if self.max_new_tokens is not None and (
            isinstance(self.max_new_tokens, bool) or int(self.max_new_tokens) < 0
        ):
            raise ValueError(f"max_new_tokens must be None or an integer >= 0, got {self.max_new_tokens!r}")
        if self.max_new_tokens is not None:
            self.max_new_tokens = int(self.max_new_tokens)
        self.stop_ids = frozenset(int(i) for i in self.stop_ids)
        self.rng = np.random.default_rng(self.seed)
        self.done = self.max_new_tokens == 0

    @property
    def sampling(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}

    def _previous(self) -> list:
        return self.context[-self.repetition_window :] if self.repetition_window else self.context

    def next(self, logits) -> int | None:
        """The next token from ``logits: [vocab]``, or None when it is a stop token (then ``last`` holds
        it) or the stream had already stopped. Marks the stream done at a stop token or at
        ``max_new_tokens``."""
        if self.done:
            return None
        raw = logits
        for p in self.processors:
            logits = p.process(logits)
        tok = sample_next(
            logits,
            rng=self.rng,
            repetition_penalty=self.repetition_penalty,
            previous=self._previous(),
            logit_bias=self.logit_bias,
            **self.sampling,
        )
        return self.take(tok, raw)

    def distribution(self, logits) -> tuple[np.ndarray, np.ndarray | None]:
        """``(logits, p)`` as ``next`` would sample from them now (``sampling.next_distribution``; ``p`` None:
        greedy, the argmax of ``logits``)."""
        for p in self.processors:
            logits = p.process(logits)
        return next_distribution(
            logits,
            repetition_penalty=self.repetition_penalty,
            previous=self._previous(),
            logit_bias=self.logit_bias,
            **self.sampling,
        )

    def take(self, tok: int, raw=None) -> int | None:
        """Record ``tok`` as the stream's next token, chosen elsewhere (``next`` samples it; speculative
        decoding's rejection rule may choose it): None when it is a stop token, as ``next``. ``raw``: the
        logits it was chosen from, before the processors (which ``accept`` it with them)."""
        self.last = tok = int(tok)
        if self.repetition_penalty != 1:
            self.context.append(tok)
        for p in self.processors:
            p.accept(tok, raw)
        if tok in self.stop_ids:
            self.done = True
            return None
        self.generated.append(tok)
        if self.max_new_tokens is not None and len(self.generated) >= self.max_new_tokens:
            self.done = True
        return tok
