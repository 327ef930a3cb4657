"""Stopping a run early at one step every process agrees on (preemption: SIGTERM to the driver).

The loop asks its `StopPoint` after every step whether to stop there; what makes it say yes:
  - one process (`--address none`): `request_now()`, from the driver's SIGTERM handler, stops at the
    next step boundary (a plain attribute write: safe inside a signal handler);
  - several processes (Ray): the driver proposes a step to every process (`propose`); a process that
    has already passed it refuses and says where it is, and the driver proposes a later step. A process
    that reaches a proposed step before the driver has confirmed it (every process accepted) waits
    there, so no process ever stops at a step another one trains past: their collectives and the
    checkpoint's save would wait on each other. A confirmed step is where every process stops; a
    later proposal (after a refusal) releases the waiting ones.
The processes' steps differ by the few steps the host dispatches ahead, so this ends in a round or two.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, List, Optional

from alpa_job.errors import EXIT_PROCESS_LOST, KitError

CONFIRM_TIMEOUT_S = 120.0  # a process waiting at a proposed step for the driver's word (the driver gone: fail)


class StopPoint:
    """Where this process stops before the end of its run (None: it does not)."""

    def __init__(self, confirm_timeout_s: float = CONFIRM_TIMEOUT_S):
        self._cond = threading.Condition()
        self._step: Optional[int] = None  # the last step this process finished (dispatched)
        self._at: Optional[int] = None  # the proposed step
        self._confirmed = False
        self._now = False  # one process: stop at the next boundary, no agreement needed
        self._interrupted = False  # Ctrl-C: end now, even if its KeyboardInterrupt was swallowed
        self.stopped_at: Optional[int] = None  # the step this process stopped at
        self.confirm_timeout_s = confirm_timeout_s

    @property
    def step(self) -> Optional[int]:
        return self._step

    @property
    def requested(self) -> bool:
        return self._now or self._at is not None

    def request_now(self) -> None:
        """Stop at the next step boundary (one process: no other process to agree with)."""
        self._now = True

    def interrupt(self) -> None:
        """Ctrl-C (or a second SIGTERM) came: the next step boundary raises KeyboardInterrupt. The signal
        handler raises one too, but one that lands inside a `__del__` or a callback the runtime calls
        is printed as "Exception ignored" and lost, and the run would train on."""
        self._interrupted = True

    def check_interrupted(self) -> None:
        if self._interrupted:
            raise KeyboardInterrupt

    def propose(self, at: int) -> Optional[int]:
        """Stop after step `at`, once confirmed. None: accepted (this process has not finished step `at`
        yet); otherwise this process's step, already at or past `at`: the driver proposes again."""
        with self._cond:
            if self._step is not None and self._step >= at:
                return self._step
            self._at, self._confirmed = at, False
            self._cond.notify_all()
            return None

    def confirm(self, at: int) -> None:
        """Every process accepted `at`: stop there."""
        with self._cond:
            if self._at == at:
                self._confirmed = True
                self._cond.notify_all()

    def after_step(self, step: int) -> bool:
        """The loop finished step `step`: True means stop here (save, then end the run)."""
        self.check_interrupted()
        if self._now:
            self.stopped_at = step
            return True
        with self._cond:
            self._step = step
            if self._at is None or step < self._at:
                return False
            deadline = time.monotonic() + self.confirm_timeout_s
            while self._at == step and not self._confirmed:  # a later proposal releases this wait
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KitError(
                        f"stopping at step {step}: the driver did not confirm the step within "
                        f"{self.confirm_timeout_s:.0f} s (is it gone?); the last checkpoint stays the "
                        "one to resume from",
                        EXIT_PROCESS_LOST,
                    )
                self._cond.wait(left)
            if self._at == step and self._confirmed:
                self.stopped_at = step
                return True
            return False


STOP_MARGIN = 2  # steps past the furthest known step: room for the proposal to reach every process first
STOP_ROUNDS = 8


def agree(
    propose: Callable[[int], List[Optional[int]]],
    confirm: Callable[[int], None],
    furthest: int,
    margin: int = STOP_MARGIN,
    rounds: int = STOP_ROUNDS,
) -> int:
    """The driver's side: propose `furthest + margin` to every process (`propose(at)` returns each one's
    answer, StopPoint.propose's), and again past the furthest refusal, until all accept; then confirm.
    Returns the agreed step. The margin doubles each round, so processes stepping fast still converge."""
    at = furthest + margin
    for _ in range(rounds):
        refused = [step for step in propose(at) if step is not None]
        if not refused:
            confirm(at)
            return at
        margin *= 2
        at = max(refused) + margin
    raise KitError(
        f"the JAX processes did not agree on a step to stop at in {rounds} rounds (the last proposal: "
        f"step {at}); the last checkpoint stays the one to resume from",
        EXIT_PROCESS_LOST,
    )
