"""What restarts cost, as the report tells it: one `RestartRecord` per restart, and the final trajectory.

A `Recovery` is a restart under way. It holds the report's typed row from the moment the loss is
named, and is filled in as the restart proceeds: `resumed` when the next worker group is placed
(the checkpoint step it restores, how many processes it has), `recovered` when that group reports
its first step (the time since the loss was detected).

The run's result counts the final trajectory, each step once: the steps [run_start, resumed_from)
that earlier attempts ran and the last checkpoint kept, plus the final attempt's own. Steps an
attempt ran past its last checkpoint were lost and are not counted (`trajectory_counts`).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from alpa_job.launch.failures import GroupLost
from alpa_job.record.run_record import ProcessResult, RestartRecord


@dataclasses.dataclass
class Recovery:
    """One restart: its report row, and when the loss was detected (time.monotonic())."""

    record: RestartRecord
    detected: float

    @classmethod
    def after(cls, failed: GroupLost) -> "Recovery":
        """The restart after `failed`, named after the process to blame (its first lost one)."""
        x = failed.lost[0]
        record = RestartRecord(
            time=failed.wall,
            host=x.host,
            ip=x.ip,
            node_id=x.node_id,
            process=x.index,
            reason=x.reason,
            failed_at_step=failed.run_step if failed.run_step is not None else x.step,
            resumed_from_step=0,
            steps_lost=0,
            processes_after=0,
            recover_seconds=None,
        )
        return cls(record, failed.detected)

    def resumed(self, from_step: int, processes: int) -> None:
        """The next attempt restored checkpoint `from_step` (0: none, started over) on `processes` processes."""
        r = self.record
        r.resumed_from_step, r.processes_after = from_step, processes
        r.steps_lost = max(0, (r.failed_at_step or from_step) - from_step)

    def recovered(self, first_step_at: Optional[float]) -> None:
        """The next attempt's first step was seen at `first_step_at` (None: it never got there)."""
        if first_step_at is not None:
            self.record.recover_seconds = round(first_step_at - self.detected, 3)


def with_restarts(
    results: List[ProcessResult],
    recoveries: List[Recovery],
    run_start: int,
    resumed: int,
    extra_seen: int,
    extra_dropped: int,
    resume: bool,
) -> List[ProcessResult]:
    """The final attempt's results as the whole run's: its trajectory extended back to `run_start` by the
    steps and samples of the kept checkpoint (`extra_*`), and every restart's row."""
    rows = [r.record for r in recoveries]
    for r in results:
        r.steps += resumed - run_start
        r.samples_seen += extra_seen
        r.samples_dropped += extra_dropped
        r.resumed_from_step = run_start if resume else None
        r.restarts = rows
    return results


def samples_in_steps(
    epoch_steps: int, full_batches: int, remainder: int, policy: str, batch_size: int, start: int, end: int
) -> Tuple[int, int]:
    """(samples seen, samples dropped) over global steps [start, end): every full batch holds
    `batch_size` real samples; with policy "pad" an epoch's last step holds `remainder`; with "drop" an
    epoch that ran to its end drops `remainder` samples (as the training loop counts them)."""
    seen = dropped = 0
    for step in range(start, end):
        index = step % epoch_steps
        seen += batch_size if index < full_batches else remainder
        if index == epoch_steps - 1 and policy == "drop":
            dropped += remainder
    return seen, dropped


def trajectory_counts(
    final_steps: int, final_samples: int, final_dropped: int, run_start: int, resumed_from: int, epoch, batch_size: int
) -> Tuple[int, int, int]:
    """(steps, samples_seen, samples_dropped) of the run's final trajectory: the steps [run_start,
    resumed_from) that earlier attempts ran and the last checkpoint kept, plus the final attempt's own."""
    seen, dropped = samples_in_steps(epoch.steps, epoch.full_batches, epoch.remainder, epoch.policy, batch_size, run_start, resumed_from)
    return final_steps + (resumed_from - run_start), final_samples + seen, final_dropped + dropped
