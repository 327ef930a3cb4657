"""Logical axis names for parameters: the only sharding vocabulary model code may use.

Models name what a dimension *is* (embed, mlp, heads, ...); the engine's rules (data, not code)
decide which mesh axis, if any, splits it. On an old flax without logical partitioning (the Alpa
image's 0.6.2 may lack it) the initializers are returned unchanged: Alpa plans sharding itself.
"""
from __future__ import annotations

from typing import Callable, Tuple

import flax.linen as nn

BATCH = "batch"
EMBED = "embed"  # model width (d_model / hidden_dim)
MLP = "mlp"  # feed-forward inner width
HEADS = "heads"
KV = "kv"  # per-head width
VOCAB = "vocab"
CHANNELS = "channels"  # conv output channels
CONV_IN = "conv_in"  # conv input channels
SEQ = "seq"


def logical(init: Callable, axes: Tuple[str, ...]) -> Callable:
    """Attach logical axis names to a parameter initializer."""
    with_partitioning = getattr(nn, "with_logical_partitioning", None)
    return init if with_partitioning is None else with_partitioning(init, axes)
