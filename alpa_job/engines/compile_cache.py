"""JAX's persistent compilation cache, on by default: a second identical run loads its executables.

`--compile-cache DIR` picks the folder (on a cluster: one every node sees, or each node keeps its
own); by default it is `$XDG_CACHE_HOME/alpa_job/jax` (`~/.cache/alpa_job/jax`); `none` turns it
off. Every executable is cached, however quick its compile (jax's default skips compiles under
1 s, which would leave a small model's run uncached). With the cache on, XLA's GPU autotuning
results are cached there too (jax's `jax_persistent_cache_enable_xla_caches` default).

Why on by default: a large model's first step is mostly compiling, and a warm cache turns that into
a load, so a rerun of the same job reaches its first step several times sooner.

`resolve` is plain Python (the CLI and config may call it); `enable` imports jax.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

OFF = ("none", "off")
_UNSUPPORTED = object()


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "alpa_job", "jax")


def resolve(setting: Optional[str]) -> Optional[str]:
    """The cache folder for a --compile-cache value: '' or None = the default, 'none'/'off' = no cache."""
    if setting is None or setting == "":
        return default_dir()
    if setting.strip().lower() in OFF:
        return None
    return os.path.abspath(os.path.expanduser(setting))


def enable(directory: Optional[str]) -> Optional[str]:
    """Point this process's JAX at `directory` (created if missing); returns it, or None when off.

    Safe to call more than once and after earlier compiles: jax decides once per process whether
    the cache is used (at its first compile), so a later change is applied by resetting that
    decision.
    """
    if directory is None:
        return None
    import jax

    current = getattr(jax.config, "jax_compilation_cache_dir", _UNSUPPORTED)
    if current is _UNSUPPORTED:
        # Older jax (the Alpa image's 0.3.22, jax 0.4.13 on Python 3.9) has no such option: those
        # runs compile as before, without a persistent cache, rather than fail.
        return None
    os.makedirs(directory, exist_ok=True)
    if current == directory:
        return directory
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:  # private, but the only way to re-decide after a compile already happened in this process
        from jax._src import compilation_cache

        compilation_cache.reset_cache()
    except (ImportError, AttributeError):
        pass
    return directory


_hits = [0]
_listening = [False]


def hits() -> int:
    """Persistent-cache hits in this process so far (a monotonically growing counter)."""
    if not _listening[0]:
        import jax

        def listener(event: str, *_args, **_kwargs) -> None:
            if event == "/jax/compilation_cache/cache_hits":
                _hits[0] += 1

        jax.monitoring.register_event_listener(listener)
        _listening[0] = True
    return _hits[0]


def _min_compile_time_state():
    """jax's thread-local setter for the cache's write threshold; None where this jax has none."""
    try:
        from jax._src import config as jax_config
    except ImportError:
        return None
    state = getattr(jax_config, "persistent_cache_min_compile_time_secs", None)
    return state if callable(state) else None


def can_skip_writes() -> bool:
    return _min_compile_time_state() is not None


@contextlib.contextmanager
def writes_skipped() -> Iterator[None]:
    """Compiles in this thread (only) are not written to JAX's cache: for the train step, which the
    kit's own store keeps (engines/executable_store.py says why)."""
    state = _min_compile_time_state()
    if state is None:
        yield
        return
    with state(float("inf")):
        yield
