"""What the training loop does besides stepping, one hook each, on its own cadence.

The loop (train/loop.py) dispatches a step, then calls every hook that is due, in the order it was given
them; a hook sees the loop (`Loop`: the step it is at, the state, the one way to read losses back) and
nothing else. Every hook has one signature: `start(loop)` once, `before_step(loop)` and, when `due(loop)`,
`after_step(loop)` around each step, `finish(loop)` once at the end. The order that makes the numbers
right is the one `train_process` builds: profile, checkpoints, the caller's callback, timing windows,
evaluation, stragglers, the progress line, then the stop point (last, so a stopped step is fully shown).
"""

from __future__ import annotations

import bisect
import time
from typing import Any, Callable, List, Optional

from alpa_job.progress.events import Progress
from alpa_job.train import timing
from alpa_job.train.divergence import check_finite


class Loop:
    """The loop as hooks see it: where it is (`global_step`, `steps` in this run, `last`), the train state,
    the losses still on the device, and `read_back`, the one host sync a hook asks for."""

    def __init__(self, engine, state: Any, start_step: int, total_steps: int, metrics=None, checkpointer=None):
        self.engine, self.state = engine, state
        self.start_step, self.total_steps = start_step, total_steps
        self.global_step = start_step
        self.steps = self.samples_seen = self.samples_dropped = 0
        self.real = 0  # the newest step's real (not padded) samples
        self.loss: Any = None  # the newest step's loss, still on the device
        self.input_seconds = 0.0  # this process's time producing and placing its batches, the whole run
        self.pending: List[Any] = []  # losses still on the device, oldest first
        self.losses: List[float] = []
        self.fresh: Optional[List[float]] = None  # losses read back at this step (the progress line's newest)
        self.eval_point = None  # the newest evaluation (shown with every step from then on)
        self.alert: Optional[str] = None  # a standing warning for the progress line
        self.timer: Optional["StepTimer"] = None  # set by StepTimer.start: other hooks take their time out
        self.stopped_at: Optional[int] = None
        self.metrics, self.checkpointer = metrics, checkpointer

    @property
    def last(self) -> bool:
        return self.global_step == self.total_steps

    def dispatched(self, loss: Any, real: int, steps_per_epoch: int, epoch_dropped: int) -> None:
        """Count the step just dispatched."""
        self.pending.append(loss)
        self.loss = loss
        self.global_step += 1
        self.steps += 1
        self.samples_seen += real
        self.real = real
        self.fresh = None
        if self.global_step % steps_per_epoch == 0:
            self.samples_dropped += epoch_dropped  # the epoch ran to its end: its tail was dropped

    def read_back(self, count: Optional[int] = None) -> List[float]:
        """The oldest `count` pending losses (all by default) in one host sync, checked: a non-finite one
        stops the run."""
        count = len(self.pending) if count is None else count
        first = self.global_step - len(self.pending) + 1
        values = self.engine.to_floats(self.pending[:count])
        del self.pending[:count]
        self.losses.extend(values)
        if self.metrics is not None:  # before the check: a diverged run's curve ends with its non-finite loss
            self.metrics.losses(first, values)
        check_finite(values, first, self.global_step, self.checkpointer, self.losses)
        if values:
            self.fresh = values
        return values


class Hook:
    """One job of the loop's. `every` N steps by default (0: never by count); override `due` for another
    cadence."""

    every = 1

    def due(self, loop: Loop) -> bool:
        return bool(self.every) and loop.global_step % self.every == 0

    def start(self, loop: Loop) -> None:
        pass

    def before_step(self, loop: Loop) -> None:
        pass

    def after_step(self, loop: Loop) -> None:
        pass

    def finish(self, loop: Loop) -> None:
        pass


class StepTimer(Hook):
    """Timing without a per-step sync: the first step alone, then one sync per window (train/timing.py).

    A window is synced on the step before the newest, which is already queued, so the device does not idle
    while the host reads the clock and dispatches again (a sync on the newest step drains the queue every
    window: ~3 ms a step on GPT 24L, one H100). The losses up to that step come back in the same sync."""

    def __init__(self, steps: int):
        self.window = timing.window_size(steps)
        self.window_step_s: List[float] = []
        self.ordered: List[float] = []  # window_step_s sorted: the steady median for every progress event
        self.first_step_s = self.first_done = self.process_age = None
        self.loop_start = self.mark = 0.0
        self.mark_step = self.mark_samples = 0  # the step (counted in this run) `mark` timed, its samples

    def start(self, loop: Loop) -> None:
        loop.timer = self
        self.loop_start = self.mark = time.perf_counter()

    def after_step(self, loop: Loop) -> None:
        if self.first_done is None:
            loop.read_back()  # sync: the first step is done
            now = time.perf_counter()
            self.first_step_s, self.first_done, self.process_age = now - self.loop_start, now, timing.process_age_s()
            self.mark, self.mark_step, self.mark_samples = now, loop.steps, loop.samples_seen
            if loop.metrics is not None:
                loop.metrics.first_step(loop.global_step, self.first_step_s, self.process_age)
        elif loop.steps - 1 - self.mark_step == self.window:
            loop.read_back(len(loop.pending) - 1)
            self._close(loop, loop.steps - 1, loop.global_step - 1, loop.samples_seen - loop.real)
        if self.first_done is not None and loop.last and loop.steps - self.mark_step == self.window:
            # the last window ends with the run: closed here, so the last progress event's rate counts it too
            loop.read_back()
            self._close(loop, loop.steps, loop.global_step, loop.samples_seen)

    def finish(self, loop: Loop) -> None:
        if self.first_done is not None and loop.steps - self.mark_step == self.window:  # a run stopped early
            self._close(loop, loop.steps, loop.global_step, loop.samples_seen)

    def restart(self, loop: Loop) -> None:
        """The time since the last mark was not steps' (an evaluation): the window starts again now."""
        if self.first_done is not None:
            self.mark, self.mark_step, self.mark_samples = time.perf_counter(), loop.steps, loop.samples_seen

    def exclude(self, seconds: float) -> None:
        """`seconds` of the current window were not a step's: its start moves past them."""
        self.mark += seconds

    @property
    def median_step_s(self) -> Optional[float]:
        return timing.percentile_sorted(self.ordered, 0.5) if self.ordered else None

    def _close(self, loop: Loop, steps_at: int, timed_step: int, samples_at: int) -> None:
        # A window ends now (its last step synced): its per-step time, the sorted copy, the metrics log.
        now = time.perf_counter()
        self.window_step_s.append((now - self.mark) / self.window)
        bisect.insort(self.ordered, self.window_step_s[-1])
        if loop.metrics is not None:
            loop.metrics.window(timed_step, self.window, now - self.mark, samples_at - self.mark_samples)
        self.mark, self.mark_step, self.mark_samples = now, steps_at, samples_at


class ProfileHook(Hook):
    """`--profile START:COUNT` (train/profile.py): the trace starts before step START is dispatched."""

    def __init__(self, profile):
        self.profile = profile

    def before_step(self, loop: Loop) -> None:
        self.profile.before_step(loop.global_step + 1)

    def after_step(self, loop: Loop) -> None:
        self.profile.after_step(loop.global_step, loop.engine, loop.state)

    def finish(self, loop: Loop) -> None:
        self.profile.stop(loop.engine, loop.state)  # a run that ended (or stopped) inside the traced steps


class CheckpointHook(Hook):
    """Saves every `--checkpoint-every` steps (the checkpointer decides); a checkpoint never holds a state
    past a non-finite loss, so the losses up to it are read back first."""

    def __init__(self, checkpointer, stream):
        self.checkpointer, self.stream = checkpointer, stream

    def after_step(self, loop: Loop) -> None:
        every = self.checkpointer.every
        if every and loop.global_step % every == 0:
            loop.read_back()
        self.checkpointer.maybe_save(loop.global_step, loop.state, self.stream.state(loop.global_step))


class CallbackHook(Hook):
    """The caller's `on_step(global_step)` after each dispatch (no host sync): the driver's failure reports."""

    def __init__(self, on_step: Callable[[int], None]):
        self.on_step = on_step

    def after_step(self, loop: Loop) -> None:
        self.on_step(loop.global_step)


class EvalHook(Hook):
    """The eval split's loss every `--eval-every` steps and at the end; its time is not a step's."""

    def __init__(self, evaluator):
        self.evaluator = evaluator

    def due(self, loop: Loop) -> bool:
        return self.evaluator.due(loop.global_step, loop.last)

    def after_step(self, loop: Loop) -> None:
        point = self.evaluator(loop.global_step, loop.state)
        if point is not None:
            loop.eval_point = point
            if loop.metrics is not None:
                loop.metrics.evaluation(point)
        if loop.timer is not None:
            loop.timer.restart(loop)


class StragglerHook(Hook):
    """Every `--straggler-every` steps (not at the last): each process's own share measured with the devices
    idle, compared across processes, a slow one named (train/stragglers.py)."""

    def __init__(self, watch):
        self.watch = watch
        self.every = watch.every
        self._input_at = (0, 0.0)  # (steps, input seconds) at the last round

    def due(self, loop: Loop) -> bool:
        return super().due(loop) and not loop.last and loop.timer is not None and loop.timer.first_done is not None

    def after_step(self, loop: Loop) -> None:
        steps, seconds = self._input_at
        self.watch.input_time(loop.input_seconds - seconds, loop.steps - steps)
        self._input_at = (loop.steps, loop.input_seconds)
        loop.read_back()  # the queued steps done: the devices are idle for the probe
        loop.timer.exclude(self.watch(loop.global_step, loop.timer.median_step_s))
        loop.alert = self.watch.alert()


class ProgressHook(Hook):
    """The progress line after every step: the loss the loop has read back, the steady rate, the eval and any
    standing alert."""

    def __init__(self, steps_per_epoch: int, tokens_per_sample: Optional[int] = None, devices: int = 1):
        self.steps_per_epoch, self.tokens_per_sample, self.devices = steps_per_epoch, tokens_per_sample, devices
        self.bar: Optional[Progress] = None
        self._eval = None

    def start(self, loop: Loop) -> None:
        self.bar = Progress("train", loop.total_steps - loop.start_step, first=loop.start_step)
        self.bar.set_tokens(self.tokens_per_sample, self.devices)

    def after_step(self, loop: Loop) -> None:
        if loop.eval_point is not None and loop.eval_point is not self._eval:
            self._eval = loop.eval_point
            self.bar.set_eval(self._eval.loss, self._eval.perplexity)
        self.bar.set_alert(loop.alert)
        self.bar.update(
            1,
            epoch=(loop.global_step - 1) // self.steps_per_epoch + 1,
            loss=loop.loss,
            samples=loop.real,
            read_loss=loop.fresh[-1] if loop.fresh else None,
            step_s=loop.timer.median_step_s if loop.timer is not None else None,
        )

    def finish(self, loop: Loop) -> None:
        self.bar.close()


class StopHook(Hook):
    """Preemption (train/stop.py): ends the run at a step every process agreed on."""

    def __init__(self, stop):
        self.stop = stop

    def due(self, loop: Loop) -> bool:
        return not loop.last

    def after_step(self, loop: Loop) -> None:
        if self.stop.after_step(loop.global_step):
            loop.stopped_at = loop.global_step
