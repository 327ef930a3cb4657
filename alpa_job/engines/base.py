"""The one interface every engine implements, so one loop (alpa_job/train/loop.py) drives them all.

An engine owns what differs between JAX and Alpa: how the step is built and compiled for a
model, strategy and device set, where state and batches live, how a loss comes back to the
host, and what it can tell about its plan. The loop owns everything else: data, the ragged-batch
policy, checkpoints, progress, timing, evaluation, the loop statistics and the result.

Python 3.9 and engine-free: nothing here imports jax or alpa (the Alpa image imports this too).
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple, runtime_checkable

from alpa_job.record.hlo import count_collectives, merge_counts
from alpa_job.record.plan import ParallelPlan


@dataclasses.dataclass
class CompileStats:
    """What compiling the step cost and produced."""

    compiles: int = 0  # distinct executables of the train step (1 = never recompiled)
    compile_seconds: float = 0.0
    hlo_texts: Optional[List[str]] = None  # one per executable/stage; None: could not be read
    memory: Optional[Dict[str, int]] = None
    init_compile_seconds: Optional[float] = None  # the state initialiser's own compile (None: not separate)
    compile_cache_dir: Optional[str] = None  # the persistent compile cache in use (None: off)
    compile_cache_hits: int = 0  # executables (step, init) loaded from that cache instead of compiled
    flops_per_step: Optional[float] = None  # XLA's cost analysis of the whole (unpartitioned) step
    step_source: Optional[str] = None  # JAX: "compiled", or "stored" (engines/executable_store.py)
    # Seconds of the engine's setup phases, for the report's timing.phases_s (JAX: open_devices,
    # abstract_state); empty where the engine does not break its setup down.
    setup_phases: Dict[str, float] = dataclasses.field(default_factory=dict)

    def cache_report(self) -> Optional[Dict[str, Any]]:
        """The report's timing.compile_cache: where, how many executables came from it, and whether
        the step itself was loaded; None when the cache is off."""
        if not self.compile_cache_dir:
            return None
        return {"dir": self.compile_cache_dir, "hits": self.compile_cache_hits, "step": self.step_source}

    @property
    def hlo_text(self) -> str:
        return "\n".join(self.hlo_texts or [])

    def collectives(self) -> Optional[Dict[str, Dict[str, int]]]:
        if self.hlo_texts is None:
            return None
        return merge_counts(*(count_collectives(t) for t in self.hlo_texts))


@runtime_checkable
class Engine(Protocol):
    """A compiled train step on a device set, and what it knows about itself.

    Built and compiled by its factory (`train.build_jax_engine`, `alpa_engine.AlpaEngine.build`);
    `train.train_process` then drives it through these members only.
    """

    name: str  # "jax" | "alpa" (the report's `engine`)
    strategy: str  # the strategy or method actually used (auto search may pick one)
    checkpoints: bool  # whether `init_state`/`abstract_state` round-trip through orbax checkpoints

    @property
    def stats(self) -> CompileStats:
        """Compile statistics; `compiles` is up to date after the loop."""

    @property
    def abstract_state(self) -> Any:
        """The state's shapes/dtypes (and shardings), what a checkpoint restores into."""

    def compile(self) -> CompileStats:
        """Build and compile the step for the pipeline's one batch shape."""

    def init_state(self, seed: int) -> Any:
        """A fresh train state, placed where the step wants it."""

    def put_batch(self, batch: Dict[str, Any]) -> Any:
        """A host batch (numpy, fixed shape, with `mask`) ready for `step`; refuses another shape."""

    def step(self, state: Any, batch: Any) -> Tuple[Any, Any]:
        """One training step: (new state, loss). The loss may stay on device."""

    def to_floats(self, values: List[Any]) -> List[float]:
        """Bring a list of step losses to the host (one sync for the lot where the engine can)."""

    def wait(self, state: Any) -> None:
        """Block until `state` is computed (so the loop's wall time is honest)."""

    def watch_compiles(self) -> Callable[[], int]:
        """Start counting compiles of the step; the returned function says how many happened since."""

    def plan(self) -> ParallelPlan:
        """Where every state leaf and the batch live (engine-neutral, for the report and inspect)."""

    def topology(self) -> Dict[str, Any]:
        """{"mesh": {"shape", "axes"}, "process": {...}, "devices": {...}} of this engine's step."""

    # ----- hooks (EngineHooks gives the defaults) ------------------------------------------------
    def eval_loss(self, state: Any, batch: Dict[str, Any]) -> Optional[float]:
        """Masked mean loss of `batch` without training; None when the engine does not evaluate."""

    def finish(self, out_dir: str) -> None:
        """Write engine-specific artefacts under `out_dir` after training (Alpa: its debug dump)."""

    def extra_report(self) -> Dict[str, Any]:
        """Engine-specific result fields (JAX: the auto-search table; Alpa: method, stages, plan cache)."""

    def peak_memory_bytes(self) -> Optional[int]:
        """Measured peak device memory of this process; None where the runtime does not say."""


class EngineHooks:
    """Defaults for the optional members of `Engine`."""

    checkpoints = True

    def eval_loss(self, state: Any, batch: Dict[str, Any]) -> Optional[float]:
        return None

    def finish(self, out_dir: str) -> None:
        return None

    def extra_report(self) -> Dict[str, Any]:
        return {}

    def peak_memory_bytes(self) -> Optional[int]:
        """Measured peak device memory of this process (the largest over its devices); None: unknown."""
        return None


def interface_members() -> List[str]:
    """The names `Engine` requires (methods, properties and attributes)."""
    names = [n for n in vars(Engine) if not n.startswith("_")]
    names += [n for n in getattr(Engine, "__annotations__", {}) if n not in names]
    return sorted(names)


def missing_members(engine: Any) -> List[str]:
    """The interface members an engine instance lacks. Unlike isinstance(engine, Engine), which on
    Python < 3.12 reads every property (AlpaEngine.abstract_state traces the model's init), this
    looks members up statically."""
    return [n for n in interface_members() if inspect.getattr_static(engine, n, None) is None]


def interface_gaps(cls: type) -> List[str]:
    """How `cls` falls short of `Engine`, checked on the class (no instance, so no engine runtime):
    every member present; methods take the same parameters by name; properties stay properties
    or attributes; annotated attributes exist on the class or are assigned in its __init__."""
    gaps: List[str] = []
    init_source = ""
    try:
        init_source = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        pass
    for name in interface_members():
        want = inspect.getattr_static(Engine, name, None)
        have = inspect.getattr_static(cls, name, None)
        if want is None:  # an annotated attribute (name, strategy, checkpoints)
            if have is None and f"self.{name} =" not in init_source and f"self.{name}," not in init_source:
                gaps.append(f"{name}: attribute missing")
            continue
        if isinstance(want, property):
            if have is None and f"self.{name} =" not in init_source:
                gaps.append(f"{name}: property missing")
            elif have is not None and callable(have) and not isinstance(have, property):
                gaps.append(f"{name}: is a method, the interface reads it as a property")
            continue
        if have is None:
            gaps.append(f"{name}(): method missing")
            continue
        if not callable(have):
            gaps.append(f"{name}: not a method")
            continue
        wanted = list(inspect.signature(want).parameters)
        got = list(inspect.signature(have).parameters)
        if wanted != got:
            gaps.append(f"{name}{tuple(got)}: the interface has {name}{tuple(wanted)}")
    return gaps
