"""Checkpoints with orbax: save every N steps, resume from the latest, restore exactly.

The saved step number is enough to resume the data stream: batches are a pure function of
(seed, epoch, step), so no iterator state needs saving.

A save is atomic: orbax writes `<dir>/<step>.orbax-checkpoint-tmp-<n>/` and renames it to `<dir>/<step>`
only once every process's shards are written, so a kill during a save leaves the previous step the
latest complete one (`latest_complete_step` reads that without importing orbax; the driver uses it to
decide whether a restart resumes). Restoring to `engine.abstract_state` reshards onto the current mesh,
so a run saved on 3 hosts resumes on 2 (after a lost node).
"""
from __future__ import annotations

import os
from typing import Any, Optional

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

    def maybe_save(self, step: int, state: Any) -> bool:
        if not self.every or step % self.every:
            return False
        saved = self.manager.save(step, args=self._ocp.args.StandardSave(state))
        return bool(saved)

    def restore(self, abstract_state: Any, step: Optional[int] = None) -> Any:
        step = self.latest_step() if step is None else step
        if step is None:
            raise KitError(f"--resume: no checkpoint in {self.directory}; run once with --checkpoint-every N first "
                           "or drop --resume")
        return self.manager.restore(step, args=self._ocp.args.StandardRestore(abstract_state))

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
