"""The driver's display: what the user sees of a run, and the run's train.log.

On a TTY a rich progress bar (step, loss, samples/s, ETA) with phase lines printed above it; elsewhere
plain lines every `every` steps with the same fields. Every line also goes to the run's train.log (no
ANSI codes). Verbosity: QUIET (-q: only the final summary and errors), DEFAULT, VERBOSE (-v: Ray's own
logs come back too; see ray_logs.py).

rich is optional (the Alpa image may lack it: plain lines then) and imported only when a bar or a
spinner starts, so the processes that import the event bus (which falls back to a display) never load it.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Dict, Optional

# One event as the producers make it (a small dict with a "kind"). Defined here rather than beside the
# producers: the bus imports the display (its sink when none is set), never the other way round.
Event = Dict[str, Any]
QUIET, DEFAULT, VERBOSE = -1, 0, 1


def _is_tty(stream=None) -> bool:
    stream = stream or sys.stderr
    return hasattr(stream, "isatty") and stream.isatty()


class Display:
    """Renders events for the user; remembers the last step (a failed run's report says how far it got)."""

    def __init__(self, verbosity: int = DEFAULT, tty: Optional[bool] = None, every: int = 0, stream=None, log_path: Optional[str] = None):
        self.verbosity = verbosity
        self._stream = stream  # None: whatever sys.stderr is when a line is printed (pytest's capsys too)
        self.tty = _is_tty(self.stream) if tty is None else tty
        self.every = every  # 0: about 10 lines per run
        self.last_step = 0
        self.total: Optional[int] = None
        self.last: Event = {}
        self._log = None
        self._rich = None
        self._task = None
        self._status = None  # a TTY spinner while a phase ("compiling ... ...") runs
        # The run's metrics log (train/metrics_log.py) when the driver opened one: "metrics" events go there.
        self.metrics: Optional[Callable[[Event], None]] = None
        if log_path:
            self.open_log(log_path)

    @property
    def stream(self):
        return self._stream if self._stream is not None else sys.stderr

    # ----- train.log
    def open_log(self, path: str) -> None:
        self.close_log()
        self._log = open(path, "a", buffering=1)

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def _log_line(self, text: str) -> None:
        if self._log is not None:
            stamp = time.strftime("%H:%M:%S")
            self._log.write(f"{stamp} {text}\n")

    # ----- output
    def log(self, text: str) -> None:
        """A line for train.log only: what the driver did, kept with the run, not shown on screen."""
        self._log_line(text)

    def line(self, text: str, important: bool = False) -> None:
        """One line for the user (above the bar on a TTY) and for train.log."""
        self._log_line(text)
        if self.verbosity <= QUIET and not important:
            return
        if self._rich is not None:
            self._rich.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def __call__(self, event: Event) -> None:
        self.handle(event)

    def handle(self, event: Event) -> None:
        kind = event.get("kind")
        if kind == "step":
            self._step(event)
        elif kind == "start":
            self.total = event.get("total")
            self.last_step = event.get("first", 0)
            self._log_line(f"[{event.get('desc', 'train')}] {self.total} steps from step {self.last_step}")
            self._start_bar(event)
        elif kind == "end":
            self.stop_bar()
        elif kind in ("phase", "note"):
            self._phase(event["text"], important=event.get("important", False))
        elif kind == "metrics" and self.metrics is not None:
            self.metrics(event)

    def _phase(self, text: str, important: bool) -> None:
        """A phase that starts ("... ...") spins on a TTY until the next line; everything else is a line."""
        self._stop_status()
        if self.tty and self.verbosity > QUIET and self._rich is None and text.endswith(" ..."):
            try:
                self._status = _rich_console(self.stream).status(text)
                self._status.start()
                self._log_line(text)
                return
            except ImportError:
                self._status = None
        self.line(text, important=important)

    def _stop_status(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None

    def _start_bar(self, event: Event) -> None:
        self._stop_status()
        if not self.tty or self.verbosity <= QUIET:
            return
        try:
            from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn
        except ImportError:
            return
        self.stop_bar()
        self._rich = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} steps"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[eval]}"),
            TextColumn("{task.fields[rate]} samples/s"),
            # the ETA the training process computed (rich's own would time the events' arrival on the driver)
            TimeElapsedColumn(),
            TextColumn("ETA {task.fields[eta]}"),
            transient=False,
            console=_rich_console(self.stream),
        )
        self._rich.start()
        self._task = self._rich.add_task(
            event.get("desc", "train"), total=event.get("total"), loss="-", rate="-", eval="", eta="-", completed=0
        )

    def stop_bar(self) -> None:
        """End the progress bar (the lines after it print below it); nothing when there is none."""
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
            self._task = None

    def _step(self, event: Event) -> None:
        self.last_step = event.get("step", self.last_step)
        self.total = event.get("total", self.total)
        self.last = event
        loss = event.get("loss")
        rate = event.get("rate")
        if self._rich is not None:
            self._rich.update(
                self._task,
                completed=event.get("done", 0),
                loss="-" if loss is None else f"{loss:.4g}",
                eval="  ".join(t for t in (format_eval(event), event.get("alert")) if t),
                rate="-" if rate is None else f"{rate:,.0f}",
                eta="-" if event.get("eta") is None else _duration(event["eta"]),
            )
        every = self.every or max(1, (self.total or 10) // 10)
        due = event.get("done", 0) % every == 0 or event.get("last")
        if due:  # formatted only when shown: in-process runs call this every training step
            text = format_step(event)
            self._log_line(text)
            if self._rich is None and self.verbosity > QUIET:
                print(text, file=self.stream, flush=True)

    def close(self) -> None:
        self._stop_status()
        self.stop_bar()
        self.close_log()


def format_step(event: Event) -> str:
    """`[train] step 40/210  loss 0.8123  5,120 samples/s  ETA 12 s` (the fields known so far)."""
    parts = [f"[{event.get('desc', 'train')}] step {event.get('step')}/{event.get('total_step', '?')}"]
    if event.get("loss") is not None:
        parts.append(f"loss {event['loss']:.4g}")
    if format_eval(event):
        parts.append(format_eval(event))
    if event.get("rate") is not None:
        parts.append(f"{event['rate']:,.0f} samples/s")
    if event.get("tokens_per_s_device") is not None:
        parts.append(f"{event['tokens_per_s_device']:,.0f} tokens/s a device")
    if event.get("eta") is not None:
        parts.append(f"ETA {_duration(event['eta'])}")
    if event.get("alert"):
        parts.append(event["alert"])
    return "  ".join(parts)


def format_eval(event: Event) -> str:
    """`eval 2.31 (ppl 10.1)`: the latest evaluation, or nothing before the first."""
    if event.get("eval_loss") is None:
        return ""
    ppl = event.get("eval_perplexity")
    return f"eval {event['eval_loss']:.4g}" + (f" (ppl {ppl:.4g})" if ppl is not None else "")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _rich_console(stream):
    from rich.console import Console

    return Console(file=stream, stderr=stream is sys.stderr)
