"""The event bus: what producers call to say how far they got, and this process's sink.

Producers (train.run_loop, the auto search, compile timers) call `Progress`, `phase`, `note`,
`timed` and `metrics` (numbers for the run's metrics log, which the driver's display hands on); each
makes an event (a small dict) and hands it to this process's sink:
  - on the driver (in-process training, the Alpa engine): the `Display` itself (display.py);
  - in process 0's Ray actor: the driver's `ProgressChannel` (channel.py), fed in batches. No
    per-step host sync: the loss shown is the newest one the loop has read back (it syncs once per
    timing window), or else the previous step's, converted at most once per display interval (that
    step has long finished);
  - in the other processes: nothing (process 0 speaks for the run).

Training processes and the Alpa engine import this module: it imports neither Ray nor rich (the display
it falls back to loads rich only to draw).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional

from alpa_job.progress.display import DEFAULT, Display, Event

LOSS_INTERVAL_S = 1.0  # how often a loss is read back to the host for display


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
    """Where this process's events go (None: its display). A sink that batches them (process 0's, in
    channel.py) has a `flush`: a phase and a loop's end call it, so they are not held back."""
    global _sink
    _sink = sink


def emit(kind: str, **fields: Any) -> None:
    sink = _sink if _sink is not None else display()
    sink(dict(kind=kind, **fields))


def _flush_sink() -> None:
    flush = getattr(_sink, "flush", None)
    if flush is not None:
        flush()


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
        emit(
            "step",
            desc=self.desc,
            done=self.n,
            total=self.total,
            step=self.first + self.n,
            total_step=self.first + (self.total or 0),
            loss=self._shown_loss,
            rate=rate,
            eta=eta,
            last=last,
            epoch=postfix.get("epoch"),
            alert=self._alert,
            **self._eval,
            tokens_per_s_device=rate * self._tokens_a_sample_a_device if rate and self._tokens_a_sample_a_device else None,
        )

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
        _flush_sink()


def _to_float(value: Any) -> Optional[float]:
    try:
        return float(value)
    except Exception:  # noqa: BLE001 - an engine's loss type float() cannot read: show no loss
        return None


def metrics(step: int, scalars: Optional[Dict[str, Optional[float]]] = None, series: Optional[Dict[str, List[float]]] = None) -> None:
    """Numbers for the run's metrics log (TensorBoard, --track): `scalars` at global step `step`, and
    `series` of one value a step from `step` on (the losses the loop read back in one sync)."""
    emit("metrics", step=step, scalars=scalars or {}, series=series or {})


def phase(text: str) -> None:
    """A phase line: compiling, an auto-search candidate starting, the winner and why."""
    emit("phase", text=text)
    _flush_sink()


def note(message: str) -> None:
    emit("note", text=message)


@contextmanager
def timed(message: str) -> Iterator[None]:
    """`compiling train step ...` then `... done in 3.2 s`."""
    phase(f"{message} ...")
    start = time.perf_counter()
    yield
    phase(f"{message} done in {time.perf_counter() - start:.1f} s")
