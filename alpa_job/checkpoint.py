"""Checkpoints with orbax: save every N steps, resume from the latest, restore exactly.

The saved step number is enough to resume the data stream: batches are a pure function of
(seed, epoch, step), so no iterator state needs saving.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from alpa_job.errors import KitError


class Checkpointer:
    def __init__(self, directory: str, every: int, max_to_keep: int = 3):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        self.every = every
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(save_interval_steps=max(every, 1), max_to_keep=max_to_keep,
                                               create=True)
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
