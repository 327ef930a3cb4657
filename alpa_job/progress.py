"""Progress a trainer can watch: events from the training process, one display on the driver.

Producers (train.run_loop, the auto search, compile timers) call `Progress`, `phase`, `note`,
`timed` and `metrics` (numbers for the run's metrics log, which the driver's display hands on); each
makes an event (a small dict) and hands it to this process's sink:
  - on the driver (in-process training, the Alpa engine): the `Display` itself;
  - in process 0's Ray actor: the driver's `ProgressChannel` (see its docstring: the one public way
    across Ray), fed in batches (a fire-and-forget call at most every 0.5 s, plus one per phase). No
    per-step host sync: the loss shown is the newest one the loop has read back (it syncs once per
    timing window), or else the previous step's, converted at most once per display interval (that
    step has long finished);
  - in the other processes: nothing (process 0 speaks for the run).

The `Display` renders on the driver: on a TTY a rich progress bar (step, loss, samples/s, ETA) with
phase lines printed above it; elsewhere plain lines every `every` steps with the same fields. Every
line also goes to the run's train.log (no ANSI codes). Verbosity: -1 quiet (only the final summary
and errors), 0 default, 1 verbose (Ray's own logs come back too; see `ray_noise_env`).

Python 3.9-compatible, rich optional (the Alpa image may lack it: plain lines then).
"""
from __future__ import annotations

import functools
import logging
import os
import sys
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

Event = Dict[str, Any]
FLUSH_INTERVAL_S = 0.5  # actor -> driver batching
LOSS_INTERVAL_S = 1.0  # how often a loss is read back to the host for display
QUIET, DEFAULT, VERBOSE = -1, 0, 1


def _is_tty(stream=None) -> bool:
    stream = stream or sys.stderr
    return hasattr(stream, "isatty") and stream.isatty()


# ============================================================================ the driver's display
class Display:
    """Renders events for the user; remembers the last step (a failed run's report says how far it got)."""

    def __init__(self, verbosity: int = DEFAULT, tty: Optional[bool] = None, every: int = 0,
                 stream=None, log_path: Optional[str] = None):
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
            TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} steps"),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[eval]}"),
            TextColumn("{task.fields[rate]} samples/s"),
            # the ETA the training process computed (rich's own would time the events' arrival on the driver)
            TimeElapsedColumn(), TextColumn("ETA {task.fields[eta]}"), transient=False,
            console=_rich_console(self.stream))
        self._rich.start()
        self._task = self._rich.add_task(event.get("desc", "train"), total=event.get("total"), loss="-", rate="-",
                                         eval="", eta="-", completed=0)

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
            self._rich.update(self._task, completed=event.get("done", 0),
                              loss="-" if loss is None else f"{loss:.4g}",
                              eval="  ".join(t for t in (format_eval(event), event.get("alert")) if t),
                              rate="-" if rate is None else f"{rate:,.0f}",
                              eta="-" if event.get("eta") is None else _duration(event["eta"]))
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


# ============================================================================ sinks
_sink: Optional[Callable[[Event], None]] = None
_display: Optional[Display] = None


def display() -> Display:
    """This process's display (created on first use with default settings)."""
    global _display
    if _display is None:
        _display = Display()
    return _display


def configure(verbosity: int = DEFAULT, every: int = 0, stream=None) -> Display:
    """The driver's display (the CLI calls this once); also this process's sink."""
    global _display, _sink
    if _display is not None:
        _display.close()
    _display = Display(verbosity=verbosity, every=every, stream=stream)
    _sink = _display
    return _display


def set_sink(sink: Optional[Callable[[Event], None]]) -> None:
    global _sink
    _sink = sink


def emit(kind: str, **fields: Any) -> None:
    sink = _sink if _sink is not None else display()
    sink(dict(kind=kind, **fields))


class ProgressChannel:
    """Carries process 0's progress events from its Ray actor to the driver's display.

    Driver:  `channel = ProgressChannel.open()`; hand it to process 0's actor in the training call;
             call `channel.deliver()` while waiting for the training (it shows what arrived since).
    Actor:   `send_to(channel)` once before training: this process's events go through it;
             `send_to(None)` keeps them in the worker's own log (the processes other than 0).
    The events travel through a tiny actor (num_cpus=0: it never takes a node's training CPU); this
    object is its handle and is passed to the worker like any argument of a Ray call.
    """

    def __init__(self, actor: Any):
        self._actor = actor

    @classmethod
    def open(cls) -> "ProgressChannel":
        return cls(_channel_actor_class().remote())

    def push(self, events: List[Event]) -> None:
        """Actor side: hand `events` over without waiting for the driver."""
        self._actor.push.remote(events)

    def deliver(self, to: Optional[Display] = None, timeout_s: float = 10) -> None:
        """Driver side: show the events that arrived on `to` (default: this process's display).
        Best effort: the training's futures, not the progress, carry its errors."""
        import ray

        try:
            events = ray.get(self._actor.drain.remote(), timeout=timeout_s)
        except Exception:  # noqa: BLE001 - a lost progress line is not a failure
            return
        shown = to or display()
        for event in events:
            shown.handle(event)


@functools.lru_cache(maxsize=None)
def _channel_actor_class():
    """The channel's actor class (made once: Ray registers each class it is given)."""
    import ray

    @ray.remote(num_cpus=0)
    class ProgressChannelActor:
        def __init__(self):
            self.events: List[Event] = []

        def push(self, events: List[Event]) -> None:
            self.events.extend(events)

        def drain(self) -> List[Event]:
            out, self.events = self.events, []
            return out

    return ProgressChannelActor


BATCHED = ("step", "metrics")  # events that wait for the next batch (the others go at once)


class _ChannelSink:
    """Process 0's sink inside a Ray actor: batches events into its `ProgressChannel`."""

    def __init__(self, channel: ProgressChannel):
        self.channel = channel
        self.pending: List[Event] = []
        self.last_flush = 0.0

    def __call__(self, event: Event) -> None:
        self.pending.append(event)
        now = time.monotonic()
        if event["kind"] not in BATCHED or event.get("last") or now - self.last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.channel.push(self.pending)  # fire and forget: never waits on the driver
            self.pending = []
        self.last_flush = time.monotonic()


def _null_sink(event: Event) -> None:
    if event["kind"] in ("phase", "note"):  # still in the worker's own log (ray logs / -v)
        print(event["text"], file=sys.stderr, flush=True)


def send_to(channel: Optional[ProgressChannel]) -> None:
    """In a Ray actor: send this process's events through `channel` (None: keep them in its own log)."""
    set_sink(_ChannelSink(channel) if channel is not None else _null_sink)


def _flush_channel() -> None:
    if isinstance(_sink, _ChannelSink):
        _sink.flush()


# ============================================================================ producers
class Progress:
    """Steps of one loop (train) or candidates of a search; `update` after each."""

    def __init__(self, desc: str, total: Optional[int], unit: str = "step", first: int = 0):
        self.desc, self.total, self.unit, self.n, self.first = desc, total, unit, 0, first
        self.start = time.perf_counter()
        self.samples = 0
        self._loss_at = 0.0
        self._prev_loss: Any = None
        self._shown_loss: Optional[float] = None
        self._eval: Dict[str, Optional[float]] = {}
        self._alert: Optional[str] = None
        self._tokens_a_sample_a_device: Optional[float] = None  # tokens/s a device from samples/s
        if unit == "step":
            emit("start", desc=desc, total=total, first=first)

    def update(self, n: int = 1, **postfix: Any) -> None:
        self.n += n
        if self.unit != "step":
            detail = " ".join(f"{k}={v}" for k, v in postfix.items())
            emit("phase", text=f"[{self.desc}] {self.n}/{self.total} {detail}".rstrip())
            return
        self.samples += int(postfix.get("samples") or 0)
        loss = postfix.get("loss")
        now = time.perf_counter()
        last = self.total is not None and self.n >= self.total
        # The newest loss the caller has already read back (the loop's timing sync): free to show, and on
        # a run shorter than LOSS_INTERVAL_S the only way its line ever moves off the first step's loss.
        read = postfix.get("read_loss")
        if read is not None:
            self._shown_loss = _to_float(read)
            self._loss_at = now
        elif self._prev_loss is not None and (last or now - self._loss_at >= LOSS_INTERVAL_S):
            # The previous step's loss: finished by now, so reading it does not stall the pipeline.
            self._shown_loss = _to_float(self._prev_loss)
            self._loss_at = now
        if last and loss is not None:
            self._shown_loss = _to_float(loss)
        self._prev_loss = loss
        elapsed = now - self.start
        step_s = postfix.get("step_s")
        if step_s:
            # The loop's steady-state step time (the median of its timed windows, the report's measure),
            # measured where the steps run: the first step and the evals are not counted as steps.
            rate = self.samples / self.n / step_s if self.samples else None
            eta = (self.total - self.n) * step_s if self.total else None
        else:  # before the first timed window (or a caller that times nothing): the run so far
            rate = self.samples / elapsed if self.samples and elapsed > 0 else None
            eta = (self.total - self.n) * elapsed / self.n if self.total and self.n else None
        emit("step", desc=self.desc, done=self.n, total=self.total, step=self.first + self.n,
             total_step=self.first + (self.total or 0), loss=self._shown_loss, rate=rate, eta=eta, last=last,
             epoch=postfix.get("epoch"), alert=self._alert, **self._eval,
             tokens_per_s_device=rate * self._tokens_a_sample_a_device if rate and self._tokens_a_sample_a_device
             else None)

    def set_eval(self, loss: float, perplexity: Optional[float] = None) -> None:
        """The latest evaluation, shown with every step from now on."""
        self._eval = {"eval_loss": loss, "eval_perplexity": perplexity}

    def set_tokens(self, tokens_per_sample: Optional[int], devices: int) -> None:
        """A model with a sequence length: the line gives tokens/s a device beside samples/s."""
        self._tokens_a_sample_a_device = tokens_per_sample / max(devices, 1) if tokens_per_sample else None

    def set_alert(self, text: Optional[str]) -> None:
        """A standing warning (a straggler named) shown with every step until it is cleared with None."""
        self._alert = text

    def close(self) -> None:
        if self.unit == "step":
            emit("end", desc=self.desc)
        _flush_channel()


def _to_float(value: Any) -> Optional[float]:
    try:
        return float(value)
    except Exception:  # noqa: BLE001 - an engine's loss type float() cannot read: show no loss
        return None


def metrics(step: int, scalars: Optional[Dict[str, Optional[float]]] = None,
            series: Optional[Dict[str, List[float]]] = None) -> None:
    """Numbers for the run's metrics log (TensorBoard, --track): `scalars` at global step `step`, and
    `series` of one value a step from `step` on (the losses the loop read back in one sync)."""
    emit("metrics", step=step, scalars=scalars or {}, series=series or {})


def phase(text: str) -> None:
    """A phase line: compiling, an auto-search candidate starting, the winner and why."""
    emit("phase", text=text)
    _flush_channel()


def note(message: str) -> None:
    emit("note", text=message)


@contextmanager
def timed(message: str) -> Iterator[None]:
    """`compiling train step ...` then `... done in 3.2 s`."""
    phase(f"{message} ...")
    start = time.perf_counter()
    yield
    phase(f"{message} done in {time.perf_counter() - start:.1f} s")


# ============================================================================ Ray's own noise
def ray_noise_env(verbosity: int, tty: bool) -> Dict[str, str]:
    """Environment for Ray's own output: without -v no dedup summaries; never colour codes in a log."""
    env = {"RAY_DEDUP_LOGS": "0"}
    if not tty:
        env["RAY_COLOR_PREFIX"] = "0"
    return env


def quiet_ray_loggers(verbosity: int) -> None:
    """Ray's Python warnings (the token-auth notice, ...) only with -v."""
    if verbosity < VERBOSE:
        import ray  # noqa: F401 - importing ray sets its logger's level, so ours must come after

        logging.getLogger("ray").setLevel(logging.ERROR)


class NativeStderr:
    """Send what native code writes to fd 2 (Ray's C++ retry spam, raylet/GCS child processes, XLA)
    to a log file, while Python's sys.stderr keeps going to the user. Undone by `restore`."""

    def __init__(self, log_path: str):
        self.log_path = log_path
        self._saved_fd: Optional[int] = None
        self._saved_stderr = None

    def start(self) -> "NativeStderr":
        sys.stderr.flush()
        self._saved_fd = os.dup(2)
        self._saved_stderr = sys.stderr
        user = os.fdopen(os.dup(self._saved_fd), "w", buffering=1, errors="replace")
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        sys.stderr = user  # a Display without its own stream follows sys.stderr
        return self

    def restore(self) -> None:
        if self._saved_fd is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        self._saved_fd = None
        sys.stderr = self._saved_stderr
