"""What differs between the jax versions the kit runs on, in one place (imported where jax is installed)."""

from __future__ import annotations

import functools


def shard_map():
    """jax.shard_map (jax >= 0.6) or its experimental predecessor (the Python 3.9 side's jax 0.4), with the
    replication check off (the kit's bodies psum what they must themselves)."""
    import jax

    if hasattr(jax, "shard_map"):
        return functools.partial(jax.shard_map, check_vma=False)
    from jax.experimental.shard_map import shard_map as experimental

    return functools.partial(experimental, check_rep=False)
