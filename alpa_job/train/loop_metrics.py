"""What the training loop tells the run's metrics log (TensorBoard, --track), as progress events.

The loop hands over numbers it already has on the host: the losses it read back in its one sync per
timing window, that window's time, the setup phases, each evaluation. Nothing here touches the
device, and the learning rate is computed from the step in plain Python. The events travel like the
progress line's (progress/events.py's `metrics`): on the driver they go straight to its display, from
process 0's Ray actor through the progress channel, from the other processes nowhere; the driver's
display hands them to the run's metrics log (train/metrics_log.py), the one writer.

Tag names (one TensorBoard section each): train/ (loss, learning_rate), eval/ (loss, perplexity),
perf/ (step time, samples/s, tokens/s, TFLOP/s per device, MFU, peak device memory, one point per
timing window; TFLOP/s and MFU on MaxText's count, causal attention at half, `..._full` on the full count),
setup/ (the phases before the first step, in seconds, at the run's first step).

Python 3.9.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from alpa_job.progress.events import metrics, note
from alpa_job.engines.flops import matmul_dtype, maxtext_flops
from alpa_job.engines.optimizer import learning_rate_at, schedule_steps
from alpa_job.record.startup import startup_breakdown, startup_text
from alpa_job.train import timing


class LoopMetrics:
    """The loop's numbers for the metrics log, made into events (one per call)."""

    def __init__(
        self,
        peak_lr: Optional[float],
        horizon: Optional[int],
        seq_len: Optional[int],
        flops_per_step: Optional[float],
        device_kind: Optional[str],
        device_count: int,
        dtype: str,
        peak_memory: Optional[Callable[[], Optional[int]]] = None,
        causal_attention_flops: Optional[float] = None,
    ):
        self.peak_lr, self.horizon, self.seq_len = peak_lr, horizon, seq_len
        self.flops_per_step, self.device_kind, self.device_count, self.dtype = (flops_per_step, device_kind, device_count, dtype)
        self.mfu_flops_per_step = maxtext_flops(flops_per_step, causal_attention_flops)  # the report's MFU count
        self.peak_memory = peak_memory
        self.phases: Dict[str, Optional[float]] = {}  # setup()'s, for the first step's start-up line

    @classmethod
    def for_run(cls, config, engine, data, model_seq_len: Optional[int]) -> "LoopMetrics":
        """The run's: the default optimizer's schedule (both engines train with it), the engine's FLOP count
        and devices, `model_seq_len` tokens a sample when the model declares a seq_len (tokens/s)."""
        devices = engine.topology()["devices"]
        return cls(
            config.learning_rate,
            schedule_steps(config, data.epoch.steps),
            model_seq_len,
            engine.stats.flops_per_step,
            devices.get("kind"),
            devices.get("count") or 1,
            matmul_dtype(config),
            engine.peak_memory_bytes,
            engine.stats.causal_attention_flops_per_step,
        )

    def learning_rate(self, step: int) -> Optional[float]:
        """The rate of the update that made global step `step` (optax counts updates from 0)."""
        if self.peak_lr is None:
            return None
        return learning_rate_at(self.peak_lr, self.horizon, max(step - 1, 0))

    def setup(self, step: int, phases: Dict[str, Optional[float]]) -> None:
        """The phases before the loop (startup, opening the devices, compile, init or restore), in seconds."""
        self.phases = dict(phases)
        metrics(step, {f"setup/{name}_s": value for name, value in phases.items() if value is not None})

    def first_step(self, step: int, seconds: float, process_age: Optional[float] = None) -> None:
        """The first step took `seconds` and was done `process_age` seconds after the process started: one
        progress line says where the start-up went (record/startup.py)."""
        metrics(step, {"setup/first_step_s": seconds})
        breakdown = startup_breakdown({**self.phases, "first_step": seconds, "process_to_first_step": process_age})
        if breakdown is not None:
            note(f"[alpa_job] {startup_text(breakdown)}")

    def losses(self, first_step: int, values: List[float]) -> None:
        """The losses of steps first_step.. (as read back), with each step's learning rate."""
        if not values:
            return
        series: Dict[str, List[float]] = {"train/loss": list(values)}
        if self.peak_lr is not None:
            series["train/learning_rate"] = [self.learning_rate(first_step + i) for i in range(len(values))]
        metrics(first_step, series=series)

    def window(self, step: int, steps: int, seconds: float, samples: int) -> None:
        """A timing window of `steps` steps that ended at global step `step`, in `seconds`, over `samples`
        real rows (of the global batch)."""
        if steps <= 0 or seconds <= 0:
            return
        step_s = seconds / steps
        scalars: Dict[str, Optional[float]] = {"perf/step_time_s": step_s, "perf/samples_per_s": samples / seconds}
        if self.seq_len:
            scalars["perf/tokens_per_s"] = samples * self.seq_len / seconds
        for suffix, count in (("", self.mfu_flops_per_step), ("_full", self.flops_per_step)):
            tflops, mfu, mfu_datasheet = timing.device_rate(count, self.device_count, step_s, self.device_kind, self.dtype)
            scalars[f"perf/tflops_per_device{suffix}"] = tflops
            scalars[f"perf/mfu{suffix}"] = mfu
            scalars[f"perf/mfu_datasheet{suffix}"] = mfu_datasheet
        if self.seq_len:
            scalars["perf/tokens_per_s_per_device"] = samples * self.seq_len / seconds / max(self.device_count, 1)
        if self.peak_memory is not None:
            try:
                scalars["perf/peak_memory_bytes"] = self.peak_memory()
            except Exception:  # noqa: BLE001 - a runtime without allocator statistics: no memory point
                pass
        metrics(step, {k: v for k, v in scalars.items() if v is not None})

    def evaluation(self, point: Any) -> None:
        """An eval split's result (record.run_record.EvalPoint)."""
        scalars = {"eval/loss": point.loss}
        if point.perplexity is not None:
            scalars["eval/perplexity"] = point.perplexity
        metrics(point.step, scalars)
