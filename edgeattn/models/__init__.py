from edgeattn.models.config import EdgeConfig
from edgeattn.models.lm import EdgeLM

__all__ = ["EdgeConfig", "EdgeLM"]
