"""A loss that became NaN or infinite stops the run at that step, naming the last good checkpoint."""

from __future__ import annotations

import math
import threading
from typing import List, Optional

from alpa_job.errors import Diverged

SAVE_WAIT_S = 60.0  # a diverged run waits this long for a save in flight before naming the last checkpoint


def check_finite(values: List[float], first_step: int, at_step: int, checkpointer=None, losses: Optional[List[float]] = None) -> None:
    """Raise `Diverged` at the first non-finite loss of `values` (the losses of steps first_step, ...),
    read back at `at_step`: training on would only spend the rest of the run on NaN. `losses`: the run's
    losses so far, carried to its report."""
    for offset, value in enumerate(values):
        if not math.isfinite(value):
            step = first_step + offset
            saved = _saved_before(checkpointer, step)
            where = (
                f"last good checkpoint: step {saved} in {checkpointer.directory} (--resume continues from it)"
                if saved is not None
                else "no checkpoint was saved before it"
            )
            raise Diverged(
                f"the loss became {value} at step {step} (seen at step {at_step}, within one "
                f"read-back window); {where}; lower --learning-rate or check the data",
                step=step,
                checkpoint_step=saved,
                losses=losses,
            )


def _saved_before(checkpointer, step: int) -> Optional[int]:
    """The newest complete checkpoint before `step` (None: none). The loop checks the losses before every
    save, so none at or after the diverged step exists; a save still in flight is waited for (bounded)."""
    if checkpointer is None:
        return None
    from alpa_job.train.checkpoint_files import latest_complete_step

    waiter = threading.Thread(target=checkpointer.manager.wait_until_finished, daemon=True)
    waiter.start()
    waiter.join(SAVE_WAIT_S)
    saved = latest_complete_step(checkpointer.directory)
    return saved if saved is not None and saved < step else None
