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
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple

from alpa_job.errors import KitError


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

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def maybe_save(self, step: int, state: Any, data_state: Optional[Dict[str, Any]] = None) -> bool:
        if not self.every or step % self.every:
            return False
        args = self._ocp.args
        saved = self.manager.save(step, args=args.Composite(state=args.StandardSave(state),
                                                            data=args.JsonSave(data_state or {})))
        return bool(saved)

    def save_now(self, step: int, state: Any, data_state: Optional[Dict[str, Any]] = None) -> bool:
        """Save `step` whatever --checkpoint-every says (a preempted run's last step); every process calls it.
        False when that step is saved already (it was a multiple of --checkpoint-every)."""
        if self.manager.latest_step() == step:
            return False
        args = self._ocp.args
        saved = self.manager.save(step, args=args.Composite(state=args.StandardSave(state),
                                                            data=args.JsonSave(data_state or {})), force=True)
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

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
