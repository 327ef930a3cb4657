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

A step folder counts as complete only when it verifies (`checkpoint_files.verify_step`). A checkpoint
that verifies and still fails to restore is skipped the same way: the
newest one that restores is used, each skipped one named (step, file, reason) and set aside under
`OUT/checkpoints-skipped/` once an older one has restored (which proves the damage was the
checkpoint's, not a model mismatch), so the run's own later saves never collide with it.

A full disk: free space is checked before each save against the last save's size (plus a margin for the
files its arrays may land in), and a save that fails for lack of space (orbax reports it from a background
thread, steps later) stops the run in one line naming the folder and the bytes needed, with the partial
`*.orbax-checkpoint-tmp*` removed, so the previous checkpoint stays the latest complete one.

Ending is bounded: `close` waits for the last save at most FINISH_TIMEOUT_S, `abandon` (a run that
failed) at most ABANDON_TIMEOUT_S and never raises. A save that failed or never finished leaves
orbax's threads waiting for a signal that will not come; both tell `alpa_job.shutdown` so, and the
process's exit does not wait for them.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

from alpa_job import shutdown
from alpa_job.progress.events import note
from alpa_job.errors import EXIT_PROCESS_LOST, KitError
from alpa_job.train.checkpoint_files import (
    TMP_MARK,
    Skipped,
    disk_bytes,
    latest_complete_step,
    scan,
    seal,
    set_aside,
    step_folders,
)
from alpa_job.train.disk_full import _QUIET, _REPORTED, _install_unraisable_hook, is_disk_full
from alpa_job.units import human_bytes

FINISH_TIMEOUT_S = 600.0  # the end of a run waits this long for its last save (orbax's own async timeout)
ABANDON_TIMEOUT_S = 20.0  # a failed run waits this long for a save in flight (a newer checkpoint to resume)

SPACE_MARGIN = 1 / 20  # a save may grow a little (metadata, a larger step number)
SPACE_SLACK_BYTES = 64 * 1024
# How the same state lands on disk varies from save to save: tensorstore groups the arrays' writes into data
# files by timing, so a busy machine writes more, smaller files. Each array in a file of its own costs a file
# header and a partly filled block; this many blocks per array covers it.
BLOCKS_PER_ARRAY = 2
PARTIAL_SETTLE_S = 10.0  # how long a failed save's partial folders are removed again while its threads end
EXIT_SAVE_FAILED = 1  # the run stopped part-way: the report says how far it got


class DiskFullError(KitError):
    """A save found (or would find) no room: one line naming the folder and the bytes needed."""

    def __init__(self, message: str):
        super().__init__(message, EXIT_SAVE_FAILED)


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split()).split(" See full TensorStore details")[0] or type(err).__name__
    return f"{type(err).__name__}: {text[:240]}"


def _process_index() -> int:
    import jax

    return jax.process_index()


def _agree(value: bool) -> bool:
    """Process 0's `value` on every process (one decision for a collective save)."""
    import jax

    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.asarray(value, dtype=np.int32)))


def _barrier(name: str) -> None:
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class Checkpointer:
    def __init__(self, directory: str, every: int, max_to_keep: int = 3):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.every = every
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=max(every, 1), max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True
        )
        self._options = options
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        for name in ("absl", "orbax", "asyncio"):
            logging.getLogger(name).addFilter(_QUIET)
        _install_unraisable_hook()
        self._pending: Optional[int] = None  # the step whose save may still be running
        self.last_save_bytes: Optional[int] = None
        self._estimate: Optional[int] = None  # the state's bytes: what a first save needs at least
        self._arrays = 0  # the arrays a save writes (each may become a data file of its own)
        self.skipped: List[Skipped] = []  # what restore() passed over, newest first
        self.saving: Optional[int] = None  # the step of the newest save started (it may still be writing)

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def maybe_save(self, step: int, state: Any, data_state: Optional[Dict[str, Any]] = None) -> bool:
        self._settle(wait=False)
        if not self.every or step % self.every:
            return False
        return self._save(step, state, data_state)

    def wait(self) -> None:
        """Wait for the save in flight and seal it (its errors, a full disk's included, are raised here)."""
        self._settle(wait=True)

    def save_now(self, step: int, state: Any, data_state: Optional[Dict[str, Any]] = None) -> bool:
        """Save `step` whatever --checkpoint-every says (a preempted run's last step) and wait until it is on
        disk; every process calls it. False when that step is saved already."""
        self._settle(wait=True)
        if self.manager.latest_step() == step:
            return False
        saved = self._save(step, state, data_state, force=True)
        self._settle(wait=True)
        return saved

    def _save(self, step: int, state: Any, data_state: Optional[Dict[str, Any]], force: bool = False) -> bool:
        self._settle(wait=True)  # orbax waits for the previous save anyway; its size decides the check below
        if self.last_save_bytes is None and self._estimate is None:
            leaves = _leaves(state)
            self._estimate = sum(int(getattr(x, "nbytes", 0)) for x in leaves)
            self._arrays = len(leaves)
        self._check_space(step)
        args = self._ocp.args
        try:
            saved = self.manager.save(
                step, args=args.Composite(state=args.StandardSave(state), data=args.JsonSave(data_state or {})), force=force
            )
        except Exception as err:
            self._failed(err, step)
            raise
        if saved:
            self._pending = step
            self.saving = step
        return bool(saved)

    def _settle(self, wait: bool) -> None:
        """A save that has finished: its errors raised here (a full disk in one line), its files sealed."""
        step = self._pending
        if step is None or (not wait and self.manager.is_saving_in_progress()):
            return
        self._pending = None
        try:
            self.manager.wait_until_finished()
        except Exception as err:
            self._failed(err, step)
            raise
        step_dir = os.path.join(self.directory, str(step))
        if os.path.isdir(step_dir):
            if _process_index() == 0:
                self.last_save_bytes = seal(step_dir)
            return
        # orbax skipped the finalize after an error it only logged (a full disk's records are filtered)
        free = shutil.disk_usage(self.directory).free
        if free < max(self.last_save_bytes or self._estimate or 0, SPACE_SLACK_BYTES):
            self._failed(OSError(errno.ENOSPC, "No space left on device"), step)
        raise KitError(
            f"checkpoint at step {step} was not committed to {self.directory} (orbax logged why above); "
            "fix that, then --resume from the latest complete checkpoint",
            EXIT_SAVE_FAILED,
        )

    def _check_space(self, step: int) -> None:
        """Refuse to start a save that the disk cannot hold (the last save's size plus a margin)."""
        last = self.last_save_bytes
        if last is None:  # none saved yet in this run: a resumed run knows its checkpoint's size
            previous = step_folders(self.directory)
            if previous and _process_index() == 0:
                last = disk_bytes(os.path.join(self.directory, str(previous[0])))
                self.last_save_bytes = last
        need = self._need(last) if last else 0
        free = shutil.disk_usage(self.directory).free if need else 0
        fits = _agree(not need or free >= need)
        if not fits:
            raise DiskFullError(self._full_message(step, need, free, started=False))

    def _need(self, last: int) -> int:
        """What the next save may take: the last one's size, a margin, and the worst file layout of its arrays."""
        block = os.statvfs(self.directory).f_frsize
        return int(last * (1 + SPACE_MARGIN)) + SPACE_SLACK_BYTES + self._arrays * BLOCKS_PER_ARRAY * block

    def _full_message(self, step: int, need: Optional[int], free: Optional[int], started: bool = True) -> str:
        what = "the last save's size and a margin" if self.last_save_bytes else "the train state's size"
        latest = latest_complete_step(self.directory)
        kept = f"step {latest} stays the latest complete checkpoint" if latest is not None else "no checkpoint is kept"
        needs = f"a save needs about {need} bytes ({human_bytes(need)}, {what})" if need else "a save did not fit"
        has = f", {free} bytes free" if free is not None else ""
        removed = "the partial save was removed" if started else "the save was not started"
        return (
            f"checkpoint at step {step}: no space left in {self.directory}{has}; {needs}; {removed} "
            f"and {kept}; free space there or use an --out on a larger disk, then --resume"
        )

    def _failed(self, err: BaseException, step: int) -> None:
        """A save failed: a full disk becomes one line (and its partial folder goes); anything else is raised."""
        if not is_disk_full(err):
            return
        _REPORTED["failure"] = True
        self._quiesce()
        if _process_index() == 0:
            self.remove_partial()
        free = shutil.disk_usage(self.directory).free if os.path.isdir(self.directory) else None
        need = self._need(self.last_save_bytes) if self.last_save_bytes else self._estimate
        raise DiskFullError(self._full_message(step, need, free)) from None

    def _quiesce(self) -> None:
        """Let orbax's threads of the failed save end (else each prints a traceback as the process exits)."""
        try:
            self.manager.close()
        except Exception:  # noqa: BLE001 - the save already failed; its error is the one reported
            pass

    def remove_partial(self, settle_s: float = PARTIAL_SETTLE_S) -> List[str]:
        """Remove the `*.orbax-checkpoint-tmp*` folders a failed save left (they only fill the disk). A writer
        thread of the failed save may still be ending (a busy machine: a file created while the folder was
        being removed leaves it there), so the removal is repeated until none is left, for up to `settle_s`."""
        removed: List[str] = []
        deadline = time.monotonic() + settle_s
        while True:
            try:
                left = [name for name in os.listdir(self.directory) if TMP_MARK in name]
            except OSError:
                return removed
            if not left or time.monotonic() > deadline:
                return removed
            for name in left:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
                if name not in removed:
                    removed.append(name)
            time.sleep(0.05)

    def restore(self, abstract_state: Any, step: Optional[int] = None) -> Tuple[Any, Optional[Dict[str, Any]]]:
        """(state, the data item or None for a checkpoint without one) of `step` (default: the newest
        complete checkpoint that restores; each one passed over is named and kept in `skipped`)."""
        if step is not None:
            return self._restore_step(abstract_state, step)
        good, self.skipped = scan(self.directory)
        if not good and not self.skipped:
            raise KitError(f"--resume: no checkpoint in {self.directory}; run once with --checkpoint-every N first or drop --resume")
        failed: List[Skipped] = []
        for candidate in good:
            try:
                restored = self._restore_step(abstract_state, candidate)
            except KitError:
                raise
            except Exception as err:  # noqa: BLE001 - a damaged checkpoint: named, and the next one is tried
                skip = Skipped(
                    candidate, _file_in(str(err), os.path.join(self.directory, str(candidate))), f"does not restore ({_short(err)})"
                )
                note(skip.line())
                _REPORTED["failure"] = True
                failed.append(skip)
                continue
            # The driver named and set aside the newer ones before a --resume; a restart's come up here.
            newer = [x for x in self.skipped if x.step > candidate]
            for skip in newer:
                note(skip.line())
            self.skipped += failed
            self._set_aside(failed + newer)
            return restored
        lines = "; ".join(f"step {s.step}: {s.path}: {s.reason}" for s in self.skipped + failed)
        raise KitError(
            f"--resume: no checkpoint in {self.directory} restores ({lines}); start again without "
            "--resume (with --overwrite) or restore the checkpoints",
            EXIT_SAVE_FAILED,
        )

    def _set_aside(self, failed: List[Skipped]) -> None:
        """Damaged steps newer than the restored one would block the run's own saves at their steps."""
        if not failed:
            return
        if _process_index() == 0:
            for skip in failed:
                where = set_aside(self.directory, skip.step)
                note(f"[alpa_job] checkpoint step {skip.step} moved to {where}")
        _barrier("alpa_job_checkpoints_set_aside")
        self.manager.reload()

    def _restore_step(self, abstract_state: Any, step: int) -> Tuple[Any, Optional[Dict[str, Any]]]:
        args = self._ocp.args
        if os.path.isdir(os.path.join(self.directory, str(step), "default")):  # written before the data item
            return self.manager.restore(step, args=args.StandardRestore(abstract_state)), None
        restored = self.manager.restore(step, args=args.Composite(state=args.StandardRestore(abstract_state), data=args.JsonRestore()))
        return restored["state"], restored["data"] or None

    def close(self, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """Wait for the last save (bounded); one that failed or did not finish is a one-line error naming it."""
        finished, error = self._finish(timeout_s)
        if finished and error is None:
            return
        if finished and isinstance(error, KitError):  # already one line naming the folder and the fix
            raise error
        why = self._unfinished(finished, error, timeout_s)
        shutdown.expect_stuck(f"the checkpoint save of step {self.saving}")
        raise KitError(
            f"{why}; the last complete checkpoint is {self._latest_text()}; rerun with --resume to "
            "continue from it once the folder is writable",
            EXIT_PROCESS_LOST,
        ) from None

    def abandon(self, timeout_s: float = ABANDON_TIMEOUT_S) -> None:
        """The run is failing: wait (bounded) for a save in flight, never raise (the run's own error is
        the one to report); a save given up is one line naming its step."""
        finished, error = self._finish(timeout_s)
        if finished and error is None:
            return
        shutdown.expect_stuck(f"the checkpoint save of step {self.saving}")
        note(f"[alpa_job] {self._unfinished(finished, error, timeout_s)}; the last complete checkpoint is {self._latest_text()}")

    def _finish(self, timeout_s: float) -> Tuple[bool, Optional[BaseException]]:
        """(finished, its error): orbax's wait for the saves in flight and its close, in a daemon thread
        so that a save that never ends cannot hold this one."""
        box: Dict[str, BaseException] = {}

        def finish() -> None:
            try:
                self._settle(wait=True)  # a full disk or a failed commit: its one line, its partial save removed
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
            return f"the checkpoint save of step {self.saving} in {self.directory} did not finish within {timeout_s:.0f} s; abandoned it"
        first = next((x.strip() for x in str(error).splitlines() if x.strip()), type(error).__name__)
        return f"the checkpoint save of step {self.saving} in {self.directory} failed: {first[:300]}"

    def _latest_text(self) -> str:
        step = latest_complete_step(self.directory)
        return f"step {step}" if step is not None else "none"


def _leaves(tree: Any) -> List[Any]:
    import jax

    return jax.tree_util.tree_leaves(tree)


def _file_in(message: str, step_dir: str) -> str:
    """The file under `step_dir` an error message names (TensorStore quotes it), else the step folder."""
    import re

    quoted = re.findall(r'"(?:file://)?(/[^"]+)"', message) + re.findall(r"'(?:file://)?(/[^']+)'", message)
    paths = [p.rstrip("/") for p in quoted if p.startswith(step_dir)]
    return max(paths, key=len) if paths else step_dir
