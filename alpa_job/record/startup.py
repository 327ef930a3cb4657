"""Where a run's start-up went: the report's `timing.startup_breakdown`, made from its `timing.phases_s`, and
the one line the report and the progress output word it in.

The phases are those of the thread that trains, in order, so they add up to the time from the process's
start to its first step; what ran beside them on other threads (the state initialiser's compile, the state
made while the step loaded) is listed apart. Plain Python (Python 3.9): the record's readers use it too.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

# The phases of a process's start on the thread that trains, in order (timing.phases_s's names), and how the
# report words them. "engine" and "loop_setup" are what is left between the measured ones.
STARTUP_SEQUENCE = (
    ("before_train", "python, CLI, checks, imports"),
    ("startup", "model and data"),
    ("open_devices", "waiting for the devices"),
    ("engine", "engine setup"),
    ("compile", "step compile or load"),
    ("init_or_restore", "state init or restore"),
    ("loop_setup", "loop setup"),
    ("first_step", "first step"),
)
# Work on other threads meanwhile: the state initialiser's compile, the state made beside the step's load.
STARTUP_BESIDE = (("init_compile", "initialiser compile"), ("init_run_ahead", "state made"))


def startup_breakdown(phases: Dict[str, Optional[float]]) -> Optional[Dict[str, Any]]:
    """Where the time from the process's start to its first step went: the phases in order
    (STARTUP_SEQUENCE, summing to `process_to_first_step_s`) and the work beside them. None without a first
    step or a process age (off Linux)."""
    total, before = phases.get("process_to_first_step"), phases.get("before_train")
    if total is None or before is None:
        return None
    seconds = {name: phases.get(name) or 0.0 for name in ("startup", "open_devices", "compile", "init_or_restore", "first_step")}
    seconds["before_train"] = before
    setup = phases.get("setup_and_compile")
    seconds["engine"] = max(0.0, setup - seconds["startup"] - seconds["open_devices"] - seconds["compile"]) if setup is not None else 0.0
    seconds["loop_setup"] = max(0.0, total - sum(seconds.values()))
    return {
        "process_to_first_step_s": round(total, 3),
        "sequence_s": {name: round(seconds[name], 3) for name, _ in STARTUP_SEQUENCE},
        "beside_s": {name: round(phases[name], 3) for name, _ in STARTUP_BESIDE if phases.get(name) is not None},
    }


def startup_text(start: Dict[str, Any]) -> str:
    """One line: the time to the first step, then each phase (those under 0.05 s left out) and the work beside."""
    words = dict(STARTUP_SEQUENCE + STARTUP_BESIDE)
    parts = [f"{words[name]} {value:.2f}" for name, value in start["sequence_s"].items() if value >= 0.05]
    beside = [f"{words[name]} {value:.2f}" for name, value in start["beside_s"].items()]
    return (
        f"{start['process_to_first_step_s']:.2f} s from the process's start to the first step: "
        + "; ".join(parts)
        + (f" (beside: {', '.join(beside)})" if beside else "")
    )
