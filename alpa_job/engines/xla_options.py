"""XLA compile options a strategy's step is compiled with: its record's (alpa_job/strategies.py says
which and why), less what the user set.

Options go to `jax.jit(compiler_options=...)` for that step alone, so auto's candidates each get their
own strategy's. A flag the user set in XLA_FLAGS is theirs: the kit leaves it alone.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Any, Dict, Optional, Set

from alpa_job import strategies


def compiler_options(strategy: str, xla_flags: Optional[str] = None) -> Dict[str, Any]:
    """The options for `strategy`'s step, less any the user set in `xla_flags` (default: $XLA_FLAGS),
    and none where this jax cannot pass options to jit."""
    if not jit_takes_options():
        return {}
    user_set = user_set_flags(xla_flags)
    own = strategies.get(strategy).compiler_options
    return {name: value for name, value in own.items() if name not in user_set}


def user_set_flags(xla_flags: Optional[str] = None) -> Set[str]:
    """The names of the flags in `xla_flags` (default: $XLA_FLAGS)."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    return {token.lstrip("-").split("=", 1)[0] for token in flags.split()}


@functools.lru_cache(maxsize=None)  # asked for every engine: each auto candidate and copy builds one
def jit_takes_options() -> bool:
    """jax.jit(compiler_options=...) exists (jax 0.4.13, the Python 3.9 side, has no such argument)."""
    import jax

    return "compiler_options" in inspect.signature(jax.jit).parameters
