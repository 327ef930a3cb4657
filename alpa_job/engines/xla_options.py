"""XLA compile options a strategy's step is compiled with, beside its sharding rules.

FSDP gathers every parameter before its use and reduce-scatters every gradient after. XLA combines
those collectives only up to a size threshold, by default well under one GPT layer's weights, so
each layer costs several NCCL calls, and each call takes SMs from the matmuls it overlaps. Combining
several layers' collectives into one (the combine thresholds JAX-Toolbox recommends setting to at least
a layer's weights) keeps the bytes and cuts both the calls and the matmuls' slowdown beside them.
Data parallelism with a sharded update (sharding_rules.UPDATE_SPLIT_LIKE) all-gathers its parameters
and reduce-scatters its gradients in the same way, and gets the same thresholds. Its replicated
update's all-reduce measured no faster with larger thresholds; these two leave all-reduces alone.

Options go to `jax.jit(compiler_options=...)` for that step alone, so auto's candidates each get their
own strategy's. A flag the user set in XLA_FLAGS is theirs: the kit leaves it alone.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Dict, Optional

_COMBINE_BYTES = 512 * 2 ** 20  # several GPT-24L layers' bf16 weights (about 100 MB each) per collective

_COMBINED_GATHERS = {"xla_gpu_all_gather_combine_threshold_bytes": _COMBINE_BYTES,
                     "xla_gpu_reduce_scatter_combine_threshold_bytes": _COMBINE_BYTES}
STRATEGY_OPTIONS: Dict[str, Dict[str, Any]] = {"fsdp": _COMBINED_GATHERS, "data": _COMBINED_GATHERS}


def compiler_options(strategy: str, xla_flags: Optional[str] = None) -> Dict[str, Any]:
    """The options for `strategy`'s step, less any the user set in `xla_flags` (default: $XLA_FLAGS),
    and none where this jax cannot pass options to jit."""
    if not jit_takes_options():
        return {}
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    user_set = {token.lstrip("-").split("=", 1)[0] for token in flags.split()}
    return {name: value for name, value in STRATEGY_OPTIONS.get(strategy, {}).items() if name not in user_set}


@functools.lru_cache(maxsize=None)  # asked for every engine: each auto candidate and copy builds one
def jit_takes_options() -> bool:
    """jax.jit(compiler_options=...) exists (jax 0.4.13, the Python 3.9 side, has no such argument)."""
    import jax

    return "compiler_options" in inspect.signature(jax.jit).parameters
