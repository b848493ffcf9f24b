"""Training: byte-level data, the training loop, distributed launch and sampling.

Usage::

    from edgeattn.train import TrainConfig, train
    result = train(EdgeConfig(mixer="gla"), TrainConfig(time_budget=600), out="runs/gla")
"""

from edgeattn.train.data import Corpus, load_corpus
from edgeattn.train.loop import TrainConfig, TrainResult, train
from edgeattn.train.sampling import generate, sample_next

__all__ = ["Corpus", "TrainConfig", "TrainResult", "generate", "load_corpus", "sample_next", "train"]
