"""The job on Ray, one JAX process per node, driven by a controller with explicit states.

    PLACING ──> RUNNING ──> FINISHED
       ^           │
       │           v
       └──── RECOVERING ──> FAILED     (and any state ──> FAILED on an error)

PLACING    choose the nodes (never a lost one), start a process on each (a node that dies meanwhile
           is settled and replaced), check --out is one shared directory, and after a loss check the
           global batch divides the shrunk data axis;
RUNNING    train on the worker group and watch it: the driver waits on every process at once (never
           a blocking get on one), on SIGTERM has them agree on one step to stop and save at
           (preemption.py), and on the first failure gives the others a short grace to show
           theirs (a dead peer makes the survivors' collectives fail too: the one to name is the
           process whose ACTOR died), then kills every actor; a process whose step stops advancing
           for --hang-timeout is a failure too (the watchdog: WorkerGroup.hung), handled as a loss;
RECOVERING name the lost process (host, node IP, Ray node id, index, step, its log's last lines or
           where the log is), then do what the FailurePolicy decides from what was seen: fail with its
           reason, wait (for Ray's settled view, for replacement nodes), or place again on the processes
           it says: the next attempt resumes from the last complete checkpoint (orbax restores onto the
           new mesh), so the same data stream continues.

Every transition goes through `_enter` (the allowed ones are `TRANSITIONS`) and is written to the
run's train.log.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Set

from alpa_job.progress.channel import ProgressChannel
from alpa_job.progress.events import display, note
from alpa_job.cluster import ray_api
from alpa_job.errors import KitError, LostProcessError
from alpa_job.launch import failures, preemption
from alpa_job.launch.failure_policy import FAIL, WAIT, FailurePolicy, PollStatus
from alpa_job.launch.failures import GroupLost, Lost
from alpa_job.launch.placement import check_batch_divides, eligible_nodes
from alpa_job.launch.recovery import Recovery, with_restarts
from alpa_job.launch.worker_group import PlacementFailed, WorkerGroup, training_nodes
from alpa_job.record.run_record import ProcessResult
from alpa_job.train.checkpoint_files import latest_complete_step
from alpa_job.train.rundir import checkpoint_dir

GRACE_S = 3.0  # after the first failure: time for the others' to arrive (the dead one is the one to name)
PLACEMENT_RETRIES = 3  # a node that died before its process started: settle and choose again
TRAJECTORY_TIMEOUT_S = 60
REPLACEMENT_POLL_S = 0.5  # while the policy waits for replacement nodes: how often the nodes are counted


class JobState(enum.Enum):
    PLACING = "placing"
    RUNNING = "running"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"


TRANSITIONS: Dict[JobState, FrozenSet[JobState]] = {
    JobState.PLACING: frozenset({JobState.RUNNING, JobState.FAILED}),
    JobState.RUNNING: frozenset({JobState.FINISHED, JobState.RECOVERING, JobState.FAILED}),
    JobState.RECOVERING: frozenset({JobState.PLACING, JobState.FAILED}),
    JobState.FINISHED: frozenset(),
    JobState.FAILED: frozenset(),
}


def run_on_nodes(config, spec) -> List[ProcessResult]:
    """Train with one JAX process per node (restarting as --max-restarts allows after a loss).
    `spec`: the ClusterSpec the entry point resolved."""
    return JobController(config, spec).run()


class JobController:
    """Drives one job through its states; `run` returns every process's result of the final attempt."""

    def __init__(self, config, spec, policy: Optional[FailurePolicy] = None):
        self.config, self.spec = config, spec
        self.policy = policy or FailurePolicy.from_config(config)
        self.hang_timeout = float(getattr(config, "hang_timeout", 0) or 0)
        self.state = JobState.PLACING
        self.ckpt_dir = checkpoint_dir(config.out) if config.out else None
        self.run_start = (latest_complete_step(self.ckpt_dir) or 0) if config.resume and self.ckpt_dir else 0
        self.lost: List[Lost] = []  # every node lost so far (never scheduled onto again)
        self.healthy: Set[str] = set()  # lost processes whose node was found alive
        self.restarts: List[Recovery] = []
        self.recovering: Optional[Recovery] = None  # the restart whose next attempt has not run yet
        self.want: Optional[int] = config.processes or None  # processes of the next attempt (None: every node)
        self.attempt = 0  # 0: the first; n: after n losses
        self.group: Optional[WorkerGroup] = None
        self.attempt_config = config
        self.resumed = 0  # the checkpoint step the current attempt restored (0: none)
        self.failed: Optional[GroupLost] = None
        self.results: List[ProcessResult] = []
        self._log_shown = False

    # ----- the state machine -----------------------------------------------------------------------
    def run(self) -> List[ProcessResult]:
        handlers: Dict[JobState, Callable[[], None]] = {
            JobState.PLACING: self._place,
            JobState.RUNNING: self._train,
            JobState.RECOVERING: self._recover,
        }
        try:
            while self.state in handlers:
                handlers[self.state]()
        except BaseException as err:
            self._enter(JobState.FAILED, failures.first_line(err))
            if self.group is not None:
                self.group.kill()
            if self.restarts:  # the failed run's report lists the restarts it did before it failed
                err.restarts = [r.record for r in self.restarts]
            raise
        return self.results

    def _enter(self, state: JobState, why: str = "") -> None:
        if state not in TRANSITIONS[self.state]:
            raise RuntimeError(f"job controller: no transition from {self.state.value} to {state.value}")
        display().log(f"[alpa_job] job {self.state.value} -> {state.value}" + (f": {why}" if why else ""))
        self.state = state

    # ----- PLACING ---------------------------------------------------------------------------------
    def _place(self) -> None:
        self.group = self._start_group()
        if self.attempt:
            check_batch_divides(
                self.config.batch_size,
                len(self.group),
                self.config.devices,
                self.config.strategy,
                self.config.model_parallel,
                before=self.want,
            )
        self.attempt_config = self._config_for_attempt()
        self.resumed = (latest_complete_step(self.ckpt_dir) or 0) if self.attempt_config.resume else 0
        if self.recovering is not None:
            self.recovering.resumed(self.resumed, len(self.group))
        self._enter(JobState.RUNNING, f"{len(self.group)} process(es), attempt {self.attempt + 1}")

    def _start_group(self) -> WorkerGroup:
        """Start a process on each chosen node; a node that turns out dead is settled and replaced."""
        for _ in range(PLACEMENT_RETRIES):
            group = WorkerGroup(self.config, self.spec, self._choose())
            self.group = group  # killed by run() if anything below raises
            try:
                group.start()
            except PlacementFailed as err:
                group.kill()
                note(
                    f"[alpa_job] a JAX process could not start on {', '.join(x.ip for x in err.lost)} "
                    f"({err.lost[0].reason}); waiting for Ray's view of the cluster to settle"
                )
                self._settle(err.lost)
                continue
            if len(group) > 1 and (self.config.checkpoint_every or self.config.resume or self.policy.max_restarts):
                group.check_shared_out()
            return group
        raise LostProcessError(
            f"could not place the JAX processes in {PLACEMENT_RETRIES} tries: nodes kept dying "
            f"({', '.join(x.where() for x in self.lost)}); check `ray status`"
        )

    def _choose(self) -> List[ray_api.RayNode]:
        eligible = self._eligible()  # one read of Ray's node table
        want = self.want if not self.restarts else min(self.want or 0, len(eligible)) or None
        nodes = training_nodes(eligible)
        count = want or len(nodes)
        if not nodes:
            raise LostProcessError(
                "no alive Ray node with a free CPU is left to run the JAX processes on (lost: %s); "
                "add nodes, then rerun with --resume" % (", ".join(x.where() for x in self.lost) or "-")
            )
        if count > len(nodes):
            raise KitError(
                f"--processes {count} but only {len(nodes)} alive Ray nodes have a free CPU; use --processes {len(nodes)} or add nodes"
            )
        return nodes[:count]

    def _config_for_attempt(self):
        if self.attempt == 0:
            return self.config
        # Resume when a complete checkpoint exists; else start the stream over (nothing was kept).
        resume = self.config.checkpoint_every > 0 and latest_complete_step(self.ckpt_dir) is not None
        return dataclasses.replace(self.config, resume=resume)

    # ----- RUNNING ---------------------------------------------------------------------------------
    def _train(self) -> None:
        group = self.group
        channel = ProgressChannel.open()
        note(
            f"[alpa_job] {len(group)} JAX process(es) on {', '.join(group.ips())}; "
            f"coordinator {group.coordinator() or '-'}"
            + (f"; attempt {self.attempt + 1}, from step {self.resumed}" if self.attempt else "")
        )
        try:
            results = self._watch(channel)
        except GroupLost as failed:
            self._close_recovery()
            self.failed = failed
            self._enter(JobState.RECOVERING, str(failed))
            return
        self._close_recovery()
        self.results = self._final_results([ProcessResult.coerce(r) for r in results])
        self._enter(JobState.FINISHED)

    def _watch(self, channel: ProgressChannel) -> List[Any]:
        """Train on every process; the results, or GroupLost naming the lost processes (actors killed)."""
        group = self.group
        group.launch(self.attempt_config, channel)
        first_failure: Optional[float] = None
        signalled, stop_at = preemption.current(), None
        try:
            while group.running:
                group.poll()
                channel.deliver()
                if signalled is not None:
                    signalled.stop.check_interrupted()  # a Ctrl-C whose KeyboardInterrupt was swallowed
                if signalled is not None and signalled.requested and stop_at is None and not group.errors:
                    stop_at = group.stop_at_one_step(self.resumed)
                    note(f"[alpa_job] SIGTERM: every JAX process stops after step {stop_at} and saves a checkpoint there")
                if first_failure is None and not group.errors:
                    group.errors.update(group.hung(self.hang_timeout))
                if group.errors and first_failure is None:
                    first_failure = time.monotonic()
                    group.ping_all(self.hang_timeout)
                if first_failure is not None and (time.monotonic() - first_failure > GRACE_S or not group.running):
                    break
        finally:
            if first_failure is not None:
                group.kill()
            display().stop_bar()
        if first_failure is None:
            return group.results_in_order()
        raise group.failure(first_failure)

    def _close_recovery(self) -> None:
        if self.recovering is not None:
            self.recovering.recovered(self.group.first_step_at)
            self.recovering = None

    def _final_results(self, results: List[ProcessResult]) -> List[ProcessResult]:
        """The results as the whole run's (each step of the final trajectory once, every restart's row)."""
        group = self.group
        if not self.restarts:
            group.kill()
            return results
        import ray

        extra_seen, extra_dropped = (0, 0)
        if self.resumed > self.run_start:
            extra_seen, extra_dropped = ray.get(
                group.actors[0].trajectory.remote(self.config, self.run_start, self.resumed), timeout=TRAJECTORY_TIMEOUT_S
            )
        group.kill()  # their work is done; the trajectory call was the last
        return with_restarts(results, self.restarts, self.run_start, self.resumed, extra_seen, extra_dropped, self.config.resume)

    # ----- RECOVERING ------------------------------------------------------------------------------
    def _recover(self) -> None:
        """Ask the policy what to do about the loss, and do it: settle Ray's view and count the nodes while it
        says wait, then fail with its reason or place the next attempt on the processes it says."""
        failed = self.failed
        self._name_the_loss(failed)
        settled_at: Optional[float] = None
        while True:
            status = PollStatus(
                failed.lost,
                len(self.restarts),
                len(self.group),
                eligible=None if settled_at is None else self._eligible_count(),
                waited_s=0.0 if settled_at is None else time.monotonic() - settled_at,
            )
            decision = self.policy.decide(status)
            if decision.action != WAIT:
                break
            if settled_at is None:
                note(
                    f"[alpa_job] restart {len(self.restarts) + 1}/{self.policy.max_restarts}: waiting for "
                    f"Ray to settle (node {failed.lost[0].ip} marked dead, or answering again)"
                )
                self._settle(failed.lost)
                settled_at = time.monotonic()
            else:
                time.sleep(REPLACEMENT_POLL_S)
        if decision.action == FAIL and status.eligible is None:  # the restarts are spent: name the loss
            x = failed.lost[0]
            raise LostProcessError(
                failures.failure_message(
                    x, failed.slots.get(x.index), self._latest_checkpoint(), self._log_shown, also=[y.index for y in failed.lost[1:]]
                )
            ) from None
        if decision.action == FAIL:
            raise LostProcessError(
                f"{decision.reason} (lost: {', '.join(x.where() for x in self.lost) or '-'}); add nodes, then rerun with --resume"
            )
        self.recovering = Recovery.after(failed)
        self.restarts.append(self.recovering)
        self.want = decision.processes
        self.attempt += 1
        self._enter(JobState.PLACING, decision.reason)

    def _name_the_loss(self, failed: GroupLost) -> None:
        """The lost process's log tail (when Ray still serves it) and one line per lost process."""
        x = failed.lost[0]
        slot = failed.slots.get(x.index)
        if slot is not None:
            if x.index in failed.tails:  # read while ranking (even if Ray could not serve it): not a second time
                read = failed.tails[x.index]
                lines = read[-failures.LOG_TAIL_LINES :] if read is not None else None
            else:
                lines = failures.log_tail(slot)
            self._log_shown = failures.print_log_tail(slot, lines)
        note(f"[alpa_job] lost JAX {x.where()} at step {x.step if x.step is not None else '-'}: {x.reason}")
        for y in failed.lost[1:]:
            note(f"[alpa_job] ended with it: JAX {y.where()} ({y.reason})")

    def _settle(self, lost: List[Lost]) -> None:
        """Wait for Ray's settled view of `lost`; remember them (never used again unless found healthy)."""
        self.healthy -= {x.node_id for x in lost}  # a node found healthy once may be the one lost now
        settled = failures.wait_settled(lost)
        self.healthy |= settled.healthy
        self.lost.extend(lost)

    def _eligible(self) -> List[ray_api.RayNode]:
        return eligible_nodes(failures.current_nodes(), self.lost, healthy_ids=self.healthy)

    def _eligible_count(self) -> int:
        return len(self._eligible())

    def _latest_checkpoint(self) -> Optional[int]:
        return latest_complete_step(self.ckpt_dir) if self.ckpt_dir and self.config.checkpoint_every else None
