"""Functional attention ops. Every op returns ``(o, final_state)``; see DESIGN.md "Functional ops"."""

from edgeattn.ops.aft import aft, aft_full
from edgeattn.ops.common import gated_linear_attention
from edgeattn.ops.conv import short_conv, short_conv_step
from edgeattn.ops.delta import delta_rule, delta_rule_step
from edgeattn.ops.dispatch import METHODS, attention
from edgeattn.ops.flash import mixed_chunk_attention
from edgeattn.ops.linear import elu1, linear_attention
from edgeattn.ops.lsh import lsh_attention
from edgeattn.ops.nystrom import nystrom_attention
from edgeattn.ops.performer import favor_features, performer_attention
from edgeattn.ops.retnet import retention
from edgeattn.ops.rff import rff_attention, rff_features
from edgeattn.ops.softmax import softmax_attention

__all__ = [
    "aft",
    "aft_full",
    "delta_rule",
    "delta_rule_step",
    "elu1",
    "favor_features",
    "gated_linear_attention",
    "linear_attention",
    "mixed_chunk_attention",
    "performer_attention",
    "retention",
    "short_conv",
    "short_conv_step",
    "softmax_attention",
    "METHODS",
    "attention",
    "lsh_attention",
    "nystrom_attention",
    "rff_attention",
    "rff_features",
]
