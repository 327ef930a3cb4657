"""Preemption: SIGTERM to the driver (`ray job stop`, a pod eviction, `systemctl stop`, `timeout`) stops the
run at one step every JAX process agrees on, with a checkpoint there, and a report saying `preempted`.

Only the driver is signalled (Ray does not forward a job's SIGTERM to its actors), so the driver tells the
processes: in this process (`--address none`) the loop's StopPoint stops at the next step; on Ray the job
controller proposes a step to every process (`WorkerGroup.stop_at_one_step`). A second SIGTERM stops at
once, as Ctrl-C does (an `interrupted` report, no checkpoint). An engine that cannot checkpoint (Alpa)
stops at once on the first.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator, Optional

from alpa_job.train.stop import StopPoint


class Preemption:
    """The driver's view: whether SIGTERM came, and the in-process loop's StopPoint."""

    def __init__(self, can_stop: bool = True):
        self.can_stop = can_stop
        self.signals = 0
        self.stop = StopPoint()

    @property
    def requested(self) -> bool:
        return self.signals > 0

    def handle(self, _signum=None, _frame=None) -> None:
        # Only flags here: a signal handler runs between two bytecodes of the main thread, which may be
        # in the middle of printing; the loop and the controller say what they do.
        self.signals += 1
        if self.signals > 1 or not self.can_stop:
            self.interrupt()  # the Ctrl-C path: an `interrupted` report, at once
        self.stop.request_now()

    def interrupt(self, _signum=None, _frame=None) -> None:
        """SIGINT (Ctrl-C): KeyboardInterrupt now, and again at the next step boundary or controller poll in
        case this one lands where Python only prints it (a `__del__`, a runtime callback)."""
        self.stop.interrupt()
        raise KeyboardInterrupt


_CURRENT: Optional[Preemption] = None


def current() -> Optional[Preemption]:
    """The run's Preemption while `watch` is active (None otherwise: tests, library callers)."""
    return _CURRENT


@contextlib.contextmanager
def watch(can_stop: bool = True) -> Iterator[Preemption]:
    """SIGTERM means "stop at an agreed step and save" while the block runs; the old handler after it.
    Off the main thread (a library caller) nothing is installed: signals reach only the main thread."""
    global _CURRENT
    preemption = Preemption(can_stop)
    installed = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, preemption.handle) if installed else None
    # A process started with SIGINT ignored (nohup, `&` in a script) keeps ignoring it.
    catch_int = installed and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    previous_int = signal.signal(signal.SIGINT, preemption.interrupt) if catch_int else None
    _CURRENT = preemption
    try:
        yield preemption
    finally:
        _CURRENT = None
        if installed:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        if catch_int:
            signal.signal(signal.SIGINT, previous_int if previous_int is not None else signal.default_int_handler)


def take_back_sigterm() -> None:
    """After ray.init, which installs its own SIGTERM handler on the driver (sys.exit: no checkpoint, a
    `failed` report): SIGTERM is the run's again."""
    if _CURRENT is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _CURRENT.handle)


def stopped_message(step: int, checkpoints: str) -> str:
    return (
        f"preempted (SIGTERM) at step {step}: every process stopped there and checkpoint {step} is saved in "
        f"{checkpoints}; run the same command with --resume auto to continue"
    )
