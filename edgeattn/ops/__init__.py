"""Functional attention ops. Every op returns ``(o, final_state)``; see DESIGN.md "Functional ops"."""

from edgeattn.ops.common import gated_linear_attention

__all__ = ["gated_linear_attention"]
