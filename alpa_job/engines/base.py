"""The one interface every engine implements, so one loop (alpa_job/train/loop.py) drives them all.

An engine owns what differs between JAX and Alpa: how the step is built and compiled for a
model, strategy and device set, where state and batches live, how a loss comes back to the
host (the running part, `EngineRunner`), and what it can tell about its step: compiles, plan,
topology, memory (the reporting part, `EngineReport`). `Engine` is both; every engine subclasses
it. The loop owns everything else: data, the ragged-batch policy, checkpoints, progress, timing,
evaluation, the loop statistics and the result.

Python 3.9 and engine-free: nothing here imports jax or alpa (the Alpa image imports this too).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

from alpa_job.errors import KitError
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
    flops_per_step: Optional[float] = None  # the whole step's model FLOPs, every product whole (engines/flops.py)
    # Of those, what causal attention's products make (MaxText's count, the MFU's, takes half of it); 0: none.
    causal_attention_flops_per_step: Optional[float] = None
    step_source: Optional[str] = None  # JAX: "compiled", or "stored" (engines/executable_store.py)
    step_loaded_ahead: bool = False  # a stored step loaded while the engine was built (executable_store.load_ahead)
    # Seconds of the engine's setup phases, for the report's timing.phases_s (JAX: open_devices,
    # abstract_state); empty where the engine does not break its setup down.
    setup_phases: Dict[str, float] = dataclasses.field(default_factory=dict)

    def cache_report(self) -> Optional[Dict[str, Any]]:
        """The report's timing.compile_cache: where, how many executables came from it, and whether
        the step itself was loaded; None when the cache is off."""
        if not self.compile_cache_dir:
            return None
        report = {"dir": self.compile_cache_dir, "hits": self.compile_cache_hits, "step": self.step_source}
        return {**report, "loaded_ahead": self.step_loaded_ahead} if self.step_source == "stored" else report

    @property
    def hlo_text(self) -> str:
        return "\n".join(self.hlo_texts or [])

    def collectives(self) -> Optional[Dict[str, Dict[str, int]]]:
        if self.hlo_texts is None:
            return None
        return merge_counts(*(count_collectives(t) for t in self.hlo_texts))


def check_supported(config, engine: Any) -> None:
    """Refuse flags an engine (class or instance) cannot honour, before any time is spent."""
    if (config.checkpoint_every or config.resume) and not getattr(engine, "checkpoints", True):
        raise KitError(
            f"--checkpoint-every/--resume: the {getattr(engine, 'name', '?')} engine does not checkpoint "
            "(its state lives in the engine's own distributed arrays); drop the flags or use --engine jax"
        )


class EngineRunner(abc.ABC):
    """The running part: what the loop calls to build the state and step it.

    Built and compiled by its factory (`train.loop.build_jax_engine`, `alpa_engine.AlpaEngine.factory`);
    `train.loop.train_process` then drives it through these members and those of `EngineReport`.
    """

    checkpoints: bool = True  # whether `init_state`/`abstract_state` round-trip through orbax checkpoints
    strategy: str  # the strategy or method actually used (auto search may pick one); set by Engine.__init__

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The engine's name, "jax" or "alpa" (the report's `engine`): a class attribute of each engine."""

    @property
    @abc.abstractmethod
    def abstract_state(self) -> Any:
        """The state's shapes/dtypes (and shardings), what a checkpoint restores into."""

    @abc.abstractmethod
    def compile(self) -> CompileStats:
        """Build and compile the step for the pipeline's one batch shape."""

    @abc.abstractmethod
    def init_state(self, seed: int) -> Any:
        """A fresh train state, placed where the step wants it."""

    @abc.abstractmethod
    def put_batch(self, batch: Dict[str, Any]) -> Any:
        """A host batch (numpy, fixed shape, with `mask`) ready for `step`; refuses another shape."""

    @abc.abstractmethod
    def step(self, state: Any, batch: Any) -> Tuple[Any, Any]:
        """One training step: (new state, loss). The loss may stay on device."""

    @abc.abstractmethod
    def to_floats(self, values: List[Any]) -> List[float]:
        """Bring a list of step losses to the host (one sync for the lot where the engine can)."""

    @abc.abstractmethod
    def wait(self, state: Any) -> None:
        """Block until `state` is computed (so the loop's wall time is honest)."""

    def wait_for_every_process(self) -> None:
        """Block until every process of the job is ready to run its first program (the default: no wait)."""

    def eval_loss(self, state: Any, batch: Dict[str, Any]) -> Optional[float]:
        """The report's eval loss when the run has no eval split: a host batch's masked mean loss, from
        engines that evaluate it anyway; None (the default) spares the others a second compile."""
        return None

    def eval_sums(self, state: Any, batch: Any) -> Optional[Tuple[Any, Any]]:
        """(sum of the loss over the real rows, real rows) of a batch from `put_batch`, without training,
        as engine values (`to_floats` reads them); None (the default) when the engine does not evaluate."""
        return None


class EngineReport(abc.ABC):
    """The reporting part: what the engine tells about its step, for the result and the report."""

    stats: CompileStats  # compile statistics; `compiles` is up to date after the loop. Set by Engine.__init__

    @abc.abstractmethod
    def watch_compiles(self) -> Callable[[], int]:
        """Start counting compiles of the step; the returned function says how many happened since."""

    @abc.abstractmethod
    def plan(self) -> ParallelPlan:
        """Where every state leaf and the batch live (engine-neutral, for the report and inspect)."""

    @abc.abstractmethod
    def topology(self) -> Dict[str, Any]:
        """{"mesh": {"shape", "axes"}, "process": {...}, "devices": {...}} of this engine's step."""

    def extra_report(self) -> Dict[str, Any]:
        """Engine-specific result fields (JAX: the auto-search table; Alpa: method, stages, plan cache)."""
        return {}

    def notes(self) -> List[str]:
        """Lines that stay true of the run, for the report (a choice the engine made for the user's model)."""
        return []

    def peak_memory_bytes(self) -> Optional[int]:
        """Measured peak device memory of this process (the largest over its devices); None: unknown."""
        return None

    def finish(self, out_dir: str) -> None:
        """Write engine-specific artefacts under `out_dir` after training (Alpa: its debug dump)."""
        return None


class Engine(EngineRunner, EngineReport):
    """A compiled train step on a device set (the running part), and what it knows about itself (the
    reporting part). Subclass it and implement every abstract member: Python refuses to make an
    engine that lacks one (TypeError naming them)."""

    def __init__(self, strategy: str):
        self.strategy = strategy
        self.stats = CompileStats()
