"""What a job does when it loses a JAX process: a decision from what the controller saw.

`FailurePolicy` is built from --max-restarts / --restart-wait (like Ray Train's FailureConfig). The
controller hands it a `PollStatus` (the losses, the restarts so far, the nodes eligible now and how long it
has waited for replacements) and acts on the `Decision` it returns: fail (with the reason), wait (for Ray's
settled view, then for replacement nodes, up to --restart-wait), or retry on that many processes. A pure
function of plain data: tested without a cluster, and the controller's own tests script decisions.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from alpa_job.launch.failures import Lost

FAIL, WAIT, RETRY = "fail", "wait", "retry"


@dataclasses.dataclass(frozen=True)
class PollStatus:
    """What the controller knows after a loss."""

    lost: Sequence[Lost]  # this attempt's lost processes, the one to name first
    restarts_so_far: int
    processes: int  # the failed attempt's
    eligible: Optional[int] = None  # nodes a new attempt may use; None until Ray's view of the loss has settled
    waited_s: float = 0.0  # since the view settled


@dataclasses.dataclass(frozen=True)
class Decision:
    action: str  # FAIL | WAIT | RETRY
    reason: str
    processes: int = 0  # RETRY: the next attempt's process count


@dataclasses.dataclass(frozen=True)
class FailurePolicy:
    """How many losses a job survives, and how long a restart waits for replacement nodes."""

    max_restarts: int = 0
    restart_wait: float = 0.0  # seconds

    @classmethod
    def from_config(cls, config) -> "FailurePolicy":
        return cls(max_restarts=int(getattr(config, "max_restarts", 0) or 0), restart_wait=float(getattr(config, "restart_wait", 0) or 0))

    def decide(self, status: PollStatus) -> Decision:
        if status.restarts_so_far >= self.max_restarts:
            return Decision(FAIL, "no restart left (--max-restarts %d)" % self.max_restarts)
        if status.eligible is None:
            return Decision(WAIT, "Ray's view of the lost node has not settled")
        if status.eligible < status.processes and status.waited_s < self.restart_wait:
            return Decision(
                WAIT,
                "%d of %d nodes eligible; waiting up to %.0f s for replacements" % (status.eligible, status.processes, self.restart_wait),
            )
        if status.eligible == 0:
            return Decision(FAIL, "no alive Ray node with a free CPU is left to run the JAX processes on")
        processes = min(status.eligible, status.processes)
        return Decision(RETRY, "restart %d/%d on %d process(es)" % (status.restarts_so_far + 1, self.max_restarts, processes), processes)
