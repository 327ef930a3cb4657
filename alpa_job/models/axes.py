"""Logical axis names for parameters: the only sharding vocabulary model code may use.

Models name what a dimension *is* (embed, mlp, heads, ...); the engine's rules (data, not code)
decide which mesh axis, if any, splits it. The names and `logical` are the public API's
(alpa_job/api.py), kept here under their old home for the kit's own modules.
"""

from __future__ import annotations

from alpa_job.api import BATCH, CHANNELS, CONV_IN, EMBED, HEADS, KV, MLP, SEQ, VOCAB, logical

__all__ = ["BATCH", "EMBED", "MLP", "HEADS", "KV", "VOCAB", "CHANNELS", "CONV_IN", "SEQ", "logical"]
