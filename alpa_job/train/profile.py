"""`--profile START:COUNT`: a JAX profiler trace of steps START..START+COUNT-1 in the run directory.

The trace goes to OUT/profile (TensorBoard's profile plugin / XProf read the `.xplane.pb`, Perfetto
reads the `.trace.json.gz`), and its communication share goes into the report's timing. In a job of several
processes each traces into OUT/profile/process-I: JAX names a trace after its host and the second it ends,
so processes sharing a host, or a run folder on shared storage, would otherwise write over each other's. Only the
named steps are traced: a trace of a whole run is gigabytes, and the first steps are compile and
warm-up, not the steady state anyone profiles for.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Dict, Optional

from alpa_job.settings.validate import parse_profile

PROFILE_DIR = "profile"


class StepProfile:
    """Starts the trace before step `start` is dispatched and stops it once step start+count-1 is done."""

    def __init__(self, start: int, count: int, out_dir: str):
        self.start, self.count = start, count
        self.directory = os.path.join(os.path.abspath(out_dir), PROFILE_DIR)
        self.tracing = False
        self.done = False

    @classmethod
    def from_config(cls, config) -> Optional["StepProfile"]:
        parsed = parse_profile(getattr(config, "profile", None))
        if parsed is None or not config.out:
            return None
        return cls(parsed[0], parsed[1], config.out)

    def before_step(self, step: int) -> None:
        """`step`: the global step about to be dispatched."""
        if not self.tracing and not self.done and step == self.start:
            import jax

            if jax.process_count() > 1:
                self.directory = os.path.join(self.directory, f"process-{jax.process_index()}")
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.tracing = True

    def after_step(self, step: int, engine: Any, state: Any) -> None:
        """`step`: the global step just dispatched; the trace ends when it has run."""
        if self.tracing and step >= self.start + self.count - 1:
            self.stop(engine, state)

    def stop(self, engine: Any, state: Any) -> None:
        if not self.tracing:
            return
        import jax

        engine.wait(state)  # the traced steps' kernels are in the trace, not cut off mid-step
        jax.profiler.stop_trace()
        self.tracing, self.done = False, True

    def summary(self) -> Optional[Dict[str, Any]]:
        """Where the trace is, the steps in it, and its communication share (record.trace_summary)."""
        if not self.done:
            return None
        from alpa_job.record.trace_summary import summarise_trace

        traces = sorted(glob.glob(os.path.join(self.directory, "plugins", "profile", "*", "*.trace.json.gz")))
        out: Dict[str, Any] = {
            "dir": self.directory,
            "steps": [self.start, self.start + self.count - 1],
            "trace": traces[-1] if traces else None,
        }
        if traces:
            try:
                out.update(summarise_trace(traces[-1], self.count))
            except (OSError, EOFError, ValueError, KeyError) as exc:  # the trace stays for a viewer; the run's result stands
                out["summary_error"] = f"{type(exc).__name__}: {exc}"
        return out
