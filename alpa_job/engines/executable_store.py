"""Compiled train steps kept beside the compile cache, found again without tracing the model.

JAX's persistent cache (compile_cache.py) must trace and lower the step before it can look the
executable up, because its key is the lowered program; a serialised executable loads with no
tracing or lowering at all, in less than half the time of a warm hit in JAX's cache. This store keys the
serialised step by everything that decides the program instead: the kit's own source (and the source of a
model the user brings), the job's settings that reach the step, the schedule's horizon, the batch's shapes,
the strategy and mesh, the devices, the versions of Python, jax, jaxlib, flax, optax and numpy, XLA's and
JAX's environment and the jax options that change lowering. Any change is a different key, so a stale
executable is never loaded; an entry that fails to load is deleted and the step compiled as before.

While the store is in use the step never goes through JAX's cache: re-serialising an executable
that JAX loaded from its own cache gives one that fails to run (XLA:CPU, jax 0.10.2: "Function
broadcast_multiply_fusion not found"). So the step is named after its key (`step_name`: no JAX entry
written for another key or by an older kit can match) and compiled without writing a JAX entry
(compile_cache.writes_skipped): a fresh compile is always what gets serialised.

A multi-process step is one program over every process's devices, but each process holds its own
executable: each one keeps and loads its own entry (`<key>.p<index>`), on a cache folder every node sees or
on each node's own. JAX's cache cannot do that for them: it writes entries from process 0 only, and on CPU
hosts each process's key differs (its topology's fingerprint does), so every process but the first compiled
the step again on every run. The step's name comes from the key every process shares.
Entries live in `<compile cache>/alpa_job-steps/<key>[.p<index>].{xla,json}`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import threading
from typing import Any, Dict, Optional, Tuple

from alpa_job import versions
from alpa_job.progress.events import note
from alpa_job.models import source_digest
from alpa_job.settings import catalog
from alpa_job import strict_json

FOLDER = "alpa_job-steps"
# The settings that never reach the compiled step are marked so in the catalogue (decides_step=False);
# the schedule's horizon (from epochs, steps and num_samples) is keyed on its own. Every other setting,
# a new one included, is in the key.
NOT_IN_STEP = catalog.NOT_IN_STEP
JAX_OPTIONS = (
    "jax_enable_x64",
    "jax_default_prng_impl",
    "jax_default_matmul_precision",
    "jax_threefry_partitionable",
    "jax_numpy_rank_promotion",
    "jax_use_shardy_partitioner",
)
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """The kit's source files, hashed once a process (they do not change under a running job)."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(_PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith((".py", ".yaml", ".json"))):
            path = os.path.join(root, name)
            digest.update(os.path.relpath(path, _PACKAGE).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


# The allocator's growth, which the kit itself may set (engines/device_pool.py), never reaches the program.
ALLOCATOR_GROWTH = "XLA_PYTHON_CLIENT_PREALLOCATE"


def step_settings(config) -> Dict[str, Any]:
    """The job's settings that reach the compiled step."""
    return {k: v for k, v in config.as_dict().items() if k not in NOT_IN_STEP}


def step_environment() -> Dict[str, str]:
    """XLA's and JAX's environment variables that reach the compiled step."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("XLA_", "JAX_")) and k != ALLOCATOR_GROWTH}


def step_key(config, horizon: Optional[int], strategy: str, mesh, example: Dict[str, Any]) -> Dict[str, Any]:
    """Everything the compiled step depends on, as plain data (its hash names the entry)."""
    import jax

    devices = mesh.devices.ravel().tolist()
    backend = devices[0].client
    return {
        "kit_source": _source_digest(),
        "model_source": source_digest(config),  # a model the user brings: its package's source
        "settings": step_settings(config),
        "schedule_steps": horizon,
        "strategy": strategy,
        "mesh": {"shape": list(mesh.devices.shape), "axes": list(mesh.axis_names), "ids": [d.id for d in devices]},
        "batch": {k: [list(v.shape), str(v.dtype)] for k, v in sorted(example.items())},
        "devices": {
            "platform": devices[0].platform,
            "kind": devices[0].device_kind,
            "platform_version": getattr(backend, "platform_version", None),
            "count": jax.device_count(),
            **({"processes": jax.process_count()} if jax.process_count() > 1 else {}),
        },
        "versions": versions.collect(),  # python, jax, jaxlib, flax, optax, numpy, CUDA, NCCL, ...
        "environment": step_environment(),
        "jax_options": {name: str(getattr(jax.config, name, None)) for name in JAX_OPTIONS},
    }


def store_for(cache_dir: str, config, horizon: Optional[int], strategy: str, mesh, example, per_layer: bool) -> "StepStore":
    """The store of one step, with or without fsdp's per-layer gathers (the key names the placement: under
    --fsdp-gather auto it is per layer once XLA's did not fit); each process of a job keeps its own entry."""
    import jax

    key = step_key(config.replace(fsdp_gather="layer") if per_layer else config, horizon, strategy, mesh, example)
    return StepStore(cache_dir, key, process=jax.process_index() if jax.process_count() > 1 else None)


def key_digest(key: Dict[str, Any]) -> str:
    """The name of the entry a key (step_key, or a search's key built on it) gets."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:40]


# Entries being loaded ahead (load_ahead), by path: what their StepStore.load then takes instead of loading.
_AHEAD: Dict[str, "concurrent.futures.Future"] = {}


def load_ahead(store: "StepStore") -> None:
    """Start loading `store`'s entry on a worker thread, if there is one: a run that starts from the store
    spends most of its start deserialising the step (XLA rebuilds the executable), which needs neither the
    model nor its abstract state, so it can run while they are built. The engine's own `load` for the same key
    takes the result, or loads as usual where this failed (a jax whose serialisation differs, say)."""
    if not store.present() or store.path in _AHEAD:
        return
    future: concurrent.futures.Future = concurrent.futures.Future()
    _AHEAD[store.path] = future

    def load() -> None:
        from alpa_job import jax_compat

        try:
            with open(store.path + ".json") as f:
                extra = json.load(f)
            with open(store.path + ".xla", "rb") as f:
                future.set_result((jax_compat.load_executable_parts(f.read()), extra))
        except Exception:  # noqa: BLE001 - load() tries again the public way and says what is wrong
            future.set_result(None)

    threading.Thread(target=load, name="step-load-ahead", daemon=True).start()


def drop_ahead() -> None:
    """Forget what load_ahead loaded and no store took (a key that differed): it holds an executable on the
    devices."""
    _AHEAD.clear()


class StepStore:
    """The store under one compile-cache folder; `load` and `save` for one step key."""

    def __init__(self, cache_dir: str, key: Dict[str, Any], process: Optional[int] = None):
        """`process`: this process's index in a multi-process job (each keeps its own executable)."""
        self.key = key
        self.folder = os.path.join(cache_dir, FOLDER)
        self.digest = key_digest(key)  # the same on every process of a job
        self.path = os.path.join(self.folder, self.digest + ("" if process is None else f".p{process}"))
        self._saving: Optional[threading.Thread] = None
        self.loaded_ahead = False  # whether load() took what load_ahead() loaded

    @property
    def step_name(self) -> str:
        """The compiled step's name (its XLA module is jit_<this>): unique to the key."""
        return f"train_step_{self.digest[:16]}"

    @staticmethod
    def supported() -> bool:

        from alpa_job.engines import compile_cache

        if not compile_cache.can_skip_writes():
            return False
        try:
            from jax.experimental import serialize_executable  # noqa: F401
        except ImportError:  # older jax: JAX's own cache only
            return False
        return True

    def present(self) -> bool:
        """Whether an entry is there to load (it may still fail to load: `load` says)."""
        return os.path.exists(self.path + ".xla") and os.path.exists(self.path + ".json")

    def load(self, in_tree, out_tree) -> Optional[Tuple[Any, Dict[str, Any]]]:
        """(the loaded executable, what was saved beside it), or None when there is no usable entry."""
        if not self.present():
            return None
        ahead = _AHEAD.pop(self.path, None)
        loaded = ahead.result() if ahead is not None else None
        if loaded is not None:
            from alpa_job import jax_compat

            parts, extra = loaded
            try:
                compiled = jax_compat.compiled_from_parts(parts, in_tree, out_tree)
                self.loaded_ahead = True
                return compiled, extra
            except Exception:  # noqa: BLE001 - the public way below
                pass
        from jax.experimental import serialize_executable

        try:
            with open(self.path + ".json") as f:
                extra = json.load(f)
            with open(self.path + ".xla", "rb") as f:
                payload = f.read()
            return serialize_executable.deserialize_and_load(payload, in_tree, out_tree), extra
        except Exception as error:  # noqa: BLE001 - any unusable entry: drop it and compile
            note(f"stored step {self.path}.xla could not be loaded ({type(error).__name__}: {error}); deleting it and compiling")
            self.remove()
            return None

    def save_in_background(self, compiled, extra: Dict[str, Any]) -> None:
        """Serialise and write the entry on a worker thread (a large step takes a while to
        serialise), so the run's first steps do not wait; `wait()` (or interpreter exit: not a
        daemon thread) finishes it."""
        if self._saving is not None:
            return
        self._saving = threading.Thread(target=self._save, args=(compiled, extra), name="store-step")
        self._saving.start()

    def wait(self) -> None:
        if self._saving is not None:
            self._saving.join()

    def _save(self, compiled, extra: Dict[str, Any]) -> None:
        from alpa_job import jax_compat

        try:
            payload = jax_compat.serialize_compiled(compiled)
            os.makedirs(self.folder, exist_ok=True)
            for suffix, data, mode in ((".xla", payload, "wb"), (".json", strict_json.dumps({**extra, "key": self.key}, default=str), "w")):
                tmp = f"{self.path}{suffix}.{os.getpid()}.tmp"
                with open(tmp, mode) as f:
                    f.write(data)
                os.replace(tmp, self.path + suffix)  # atomic: a reader never sees half an entry
        except Exception as error:  # noqa: BLE001 - a run must not fail because its step could not be kept
            note(f"could not store the compiled step under {self.folder} ({type(error).__name__}: {error})")

    def remove(self) -> None:
        for suffix in (".xla", ".json"):
            try:
                os.remove(self.path + suffix)
            except FileNotFoundError:
                pass
