"""The run's metrics log: TensorBoard event files in OUT/tensorboard (and --track mlflow|wandb), one writer.

The driver opens it once the run directory exists (`open_for_run`) and its display hands it every
"metrics" event of the process that speaks for the run (train/loop_metrics.py says what they hold).
So there is exactly one writer, on the machine that owns --out, whichever way the run trains: in this
process, in Ray actors (process 0's events come through the progress channel), or on the Alpa driver.
At the end (`finish`) it adds what only the report knows (the steady-state step, MFU, peak memory, the
status) and any loss or eval point the live events did not bring (a last batch of events still in
flight when the job ended, a failed run's losses), then flushes and closes; a failed or preempted run
gets the same.

Every sink is a `MetricsSink`: `scalars(step, values)`, `text(name, markdown)`, `close(status)`. A sink
that fails (a full disk, a tracking server gone) is named in one line and dropped: metrics never stop
training. TensorBoard's writer is tensorboardX (no TensorFlow); where it is not installed (the Alpa
image may lack it) the run says so in one line and goes on without event files.

Python 3.9.
"""

from __future__ import annotations

import numbers
import os
import threading
from typing import Any, Callable, Dict, List, Optional

from alpa_job.train.metrics_sink import FLUSH_S, MetricsSink
from alpa_job.train.rundir import TENSORBOARD

CLOSE_TIMEOUT_S = 20.0  # the writers' last flush never holds the run's exit longer


class TensorBoardSink(MetricsSink):
    """Event files in `directory` through tensorboardX's SummaryWriter (flushed every FLUSH_S seconds by its
    own thread)."""

    name = "TensorBoard"

    def __init__(self, directory: str):
        from tensorboardX import SummaryWriter

        self.directory = directory
        self.writer = SummaryWriter(logdir=directory, flush_secs=FLUSH_S)

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def text(self, name: str, body: str) -> None:
        self.writer.add_text(name, body, 0)

    def close(self, status: str = "ok") -> None:
        self.writer.close()


def tensorboard_sink(out: str, say: Callable[[str], None]) -> Optional[TensorBoardSink]:
    """OUT/tensorboard's writer; None (said in one line) where tensorboardX does not import."""
    try:
        return TensorBoardSink(os.path.join(out, TENSORBOARD))
    except ImportError as err:
        say(
            f"[alpa_job] no TensorBoard event files: tensorboardX does not import ({err}); pip install tensorboardX, "
            "or pass --no-tensorboard to silence this"
        )
    except Exception as err:  # noqa: BLE001 - metrics never stop the run (an unwritable folder is said here)
        say(f"[alpa_job] no TensorBoard event files: {_first_line(err)}")
    return None


class RunMetrics:
    """The run's sinks behind one object: the display's "metrics" events in, every sink out."""

    def __init__(self, sinks: List[MetricsSink], say: Callable[[str], None], tensorboard_dir: Optional[str] = None):
        self.sinks = list(sinks)
        self.say = say
        self.tensorboard_dir = tensorboard_dir
        self.last_loss_step = -1  # the newest step whose loss was logged (the report completes after it)
        self.eval_steps: set = set()
        self._lock = threading.Lock()

    # ----- in: events and calls
    def __call__(self, event: Dict[str, Any]) -> None:
        step = int(event.get("step") or 0)
        scalars = {k: v for k, v in (event.get("scalars") or {}).items() if _number(v)}
        if scalars:
            if "eval/loss" in scalars:
                self.eval_steps.add(step)
            self.scalars(step, scalars)
        for tag, values in (event.get("series") or {}).items():
            for i, value in enumerate(values):
                if _number(value):
                    self.scalars(step + i, {tag: value})
            if tag == "train/loss" and values:
                self.last_loss_step = max(self.last_loss_step, step + len(values) - 1)

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        self._each(lambda sink: sink.scalars(step, {k: float(v) for k, v in values.items()}))

    def text(self, name: str, body: str) -> None:
        self._each(lambda sink: sink.text(name, body))

    def _each(self, call: Callable[[MetricsSink], None]) -> None:
        with self._lock:
            for sink in list(self.sinks):
                try:
                    call(sink)
                except Exception as err:  # noqa: BLE001 - metrics never stop the run: this sink is dropped
                    self.sinks.remove(sink)
                    self.say(f"[alpa_job] {sink.name} metrics stopped: {_first_line(err)}")

    # ----- out: the end of the run
    def settings(self, config: Dict[str, Any]) -> None:
        self.text("settings", settings_table(config))

    def finish(self, record: Any) -> None:
        """The report's view (a RunRecord, any status), then every sink flushed and closed."""
        try:
            self._complete(record)
        except Exception as err:  # noqa: BLE001 - what was logged live stands; the sinks still close
            self.say(f"[alpa_job] metrics: the report's final numbers were not logged ({_first_line(err)})")
        finally:
            self.close(getattr(record, "status", "ok"))

    def _complete(self, record: Any) -> None:
        start = record.resumed_from_step or 0
        for i, loss in enumerate(record.losses or []):
            step = start + i + 1
            if step > self.last_loss_step and _number(loss):
                self.scalars(step, {"train/loss": loss})
        for point in record.evals or []:
            if point.step not in self.eval_steps:
                values = {"eval/loss": point.loss}
                if point.perplexity is not None:
                    values["eval/perplexity"] = point.perplexity
                self.scalars(point.step, {k: v for k, v in values.items() if _number(v)})
        last = start + (record.steps or 0)
        timing = record.timing or {}
        steady = timing.get("steady_step") or {}
        final = {
            "run/steady_step_s": steady.get("median_s"),
            "run/samples_per_s": record.throughput,
            "run/tflops_per_device": timing.get("tflops_per_device"),
            "run/mfu": timing.get("mfu"),
            "run/mfu_datasheet": timing.get("mfu_datasheet"),
            "run/tflops_per_device_full": timing.get("tflops_per_device_full"),
            "run/mfu_full": timing.get("mfu_full"),
            "run/mfu_datasheet_full": timing.get("mfu_datasheet_full"),
            "run/tokens_per_s_per_device": timing.get("tokens_per_s_per_device"),
            "run/peak_memory_bytes": timing.get("peak_memory_bytes"),
            "run/peak_estimate_bytes": timing.get("peak_estimate_bytes"),
        }
        final = {k: v for k, v in final.items() if _number(v)}
        if final:
            self.scalars(last, final)
        phases = {f"setup/{k}_s": v for k, v in (timing.get("phases_s") or {}).items() if _number(v)}
        if phases:
            self.text("phases", "| phase | seconds |\n|---|---|\n" + "\n".join(f"| {k[6:-2]} | {v} |" for k, v in phases.items()))
        status = f"**{record.status}** after {record.steps} step(s)" + (f": {record.error}" if record.error else "")
        self.text("status", status)

    def close(self, status: str = "ok") -> None:
        """Flush and close every sink, each within CLOSE_TIMEOUT_S (a writer that cannot finish is left)."""
        with self._lock:
            sinks, self.sinks = self.sinks, []
        for sink in sinks:
            done = threading.Thread(target=_quietly, args=(sink, status, self.say), name=f"close-{sink.name}", daemon=True)
            done.start()
            done.join(CLOSE_TIMEOUT_S)
            if done.is_alive():
                self.say(
                    f"[alpa_job] {sink.name} metrics did not finish writing in {CLOSE_TIMEOUT_S:.0f} s; the last points may be missing"
                )


def _quietly(sink: MetricsSink, status: str, say: Callable[[str], None]) -> None:
    try:
        sink.close(status)
    except Exception as err:  # noqa: BLE001 - the run's result stands; the line says what was lost
        say(f"[alpa_job] {sink.name} metrics could not be closed: {_first_line(err)}")


def open_for_run(config, say: Callable[[str], None]) -> Optional[RunMetrics]:
    """The run's metrics log for OUT (config.out must exist), or None when nothing is asked for: TensorBoard
    unless --no-tensorboard, and the --track tracker. Its first text is the run's settings."""
    sinks: List[MetricsSink] = []
    tensorboard_dir = None
    if getattr(config, "tensorboard", True):
        sink = tensorboard_sink(config.out, say)
        if sink is not None:
            sinks.append(sink)
            tensorboard_dir = os.path.abspath(sink.directory)
    track = getattr(config, "track", "none")
    if track and track != "none":
        from alpa_job.train.trackers import open_tracker

        tracker = open_tracker(track, config, say)
        if tracker is not None:
            sinks.append(tracker)
    if not sinks:
        return None
    metrics = RunMetrics(sinks, say, tensorboard_dir)
    metrics.settings(config.as_dict())
    return metrics


def settings_table(config: Dict[str, Any]) -> str:
    """The settings as a Markdown table (TensorBoard's text tab renders it)."""
    rows = [f"| {name} | {_cell(value)} |" for name, value in config.items()]
    return "| setting | value |\n|---|---|\n" + "\n".join(rows)


def _cell(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _number(value: Any) -> bool:
    """A value a scalar can hold (NaN and infinity too: a diverged loss is shown as what it was)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__
