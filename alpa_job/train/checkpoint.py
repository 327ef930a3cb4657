"""Checkpoints with orbax: save every N steps, resume from the latest, restore exactly.

Each checkpoint holds two items: `state` (the train state) and `data` (the input pipeline's iterator
state, JSON: its position and what fixes the stream's content), so `--resume` and a restart after a
lost node continue the exact batch sequence, and refuse to continue it over other data. A checkpoint
written before the data item existed (one `default` item) still restores, its data position taken
from its step.

A save is atomic: orbax writes `<dir>/<step>.orbax-checkpoint-tmp-<n>/` and renames it to `<dir>/<step>`
only once every process's shards are written, so a kill during a save leaves the previous step the
latest complete one (`latest_complete_step` reads that without importing orbax; the driver uses it to
decide whether a restart resumes). Restoring to `engine.abstract_state` reshards onto the current mesh,
so a run saved on 3 hosts resumes on 2 (after a lost node).

Ending is bounded: `close` waits for the last save at most FINISH_TIMEOUT_S, `abandon` (a run that
failed) at most ABANDON_TIMEOUT_S and never raises. A save that failed or never finished leaves
orbax's threads waiting for a signal that will not come; both tell `alpa_job.shutdown` so, and the
process's exit does not wait for them.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Dict, Optional, Tuple

from alpa_job import progress, shutdown
from alpa_job.errors import EXIT_PROCESS_LOST, KitError

FINISH_TIMEOUT_S = 600.0  # the end of a run waits this long for its last save (orbax's own async timeout)
ABANDON_TIMEOUT_S = 20.0  # a failed run waits this long for a save in flight (a newer checkpoint to resume)


def latest_complete_step(directory: str) -> Optional[int]:
    """The highest step saved completely under `directory` (orbax's step folders are plain integers;
    a save in flight or killed mid-way is still a `*.orbax-checkpoint-tmp-*` folder), or None."""
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    steps = [int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n))]
    return max(steps) if steps else None


class Checkpointer:
    def __init__(self, directory: str, every: int, max_to_keep: int = 3):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.every = every
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(save_interval_steps=max(every, 1), max_to_keep=max_to_keep,
                                               create=True, cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self.saving: Optional[int] = None  # the step of the newest save started (it may still be writing)

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def maybe_save(self, step: int, state: Any, data_state: Optional[Dict[str, Any]] = None) -> bool:
        if not self.every or step % self.every:
            return False
        args = self._ocp.args
        saved = self.manager.save(step, args=args.Composite(state=args.StandardSave(state),
                                                            data=args.JsonSave(data_state or {})))
        if saved:
            self.saving = step
        return bool(saved)

    def restore(self, abstract_state: Any, step: Optional[int] = None) -> Tuple[Any, Optional[Dict[str, Any]]]:
        """(state, the data item or None for a checkpoint without one) of `step` (default: the latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise KitError(f"--resume: no checkpoint in {self.directory}; run once with --checkpoint-every N first "
                           "or drop --resume")
        args = self._ocp.args
        if os.path.isdir(os.path.join(self.directory, str(step), "default")):  # written before the data item
            return self.manager.restore(step, args=args.StandardRestore(abstract_state)), None
        restored = self.manager.restore(step, args=args.Composite(state=args.StandardRestore(abstract_state),
                                                                  data=args.JsonRestore()))
        return restored["state"], restored["data"] or None

    def close(self, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """Wait for the last save (bounded); one that failed or did not finish is a one-line error naming it."""
        finished, error = self._finish(timeout_s)
        if finished and error is None:
            return
        why = self._unfinished(finished, error, timeout_s)
        shutdown.expect_stuck(f"the checkpoint save of step {self.saving}")
        raise KitError(f"{why}; the last complete checkpoint is {self._latest_text()}; rerun with --resume to "
                       "continue from it once the folder is writable", EXIT_PROCESS_LOST) from None

    def abandon(self, timeout_s: float = ABANDON_TIMEOUT_S) -> None:
        """The run is failing: wait (bounded) for a save in flight, never raise (the run's own error is
        the one to report); a save given up is one line naming its step."""
        finished, error = self._finish(timeout_s)
        if finished and error is None:
            return
        shutdown.expect_stuck(f"the checkpoint save of step {self.saving}")
        progress.note(f"[alpa_job] {self._unfinished(finished, error, timeout_s)}; the last complete checkpoint "
                      f"is {self._latest_text()}")

    def _finish(self, timeout_s: float) -> Tuple[bool, Optional[BaseException]]:
        """(finished, its error): orbax's wait for the saves in flight and its close, in a daemon thread
        so that a save that never ends cannot hold this one."""
        box: Dict[str, BaseException] = {}

        def finish() -> None:
            try:
                self.manager.wait_until_finished()
                self.manager.close()
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                box["error"] = err

        thread = threading.Thread(target=finish, name="checkpoint-finish", daemon=True)
        thread.start()
        thread.join(timeout_s)
        return not thread.is_alive(), box.get("error")

    def _unfinished(self, finished: bool, error: Optional[BaseException], timeout_s: float) -> str:
        if not finished:
            return (f"the checkpoint save of step {self.saving} in {self.directory} did not finish within "
                    f"{timeout_s:.0f} s; abandoned it")
        first = next((x.strip() for x in str(error).splitlines() if x.strip()), type(error).__name__)
        return f"the checkpoint save of step {self.saving} in {self.directory} failed: {first[:300]}"

    def _latest_text(self) -> str:
        step = latest_complete_step(self.directory)
        return f"step {step}" if step is not None else "none"
