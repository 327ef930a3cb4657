"""One JAX process per Ray node: pin an actor to each node, start jax.distributed, train; name a lost
process and, with --max-restarts, go on without it (issue 12).

The coordinator is process 0's node's OWN IP (as Ray knows it, from --node-ip-address) and the
port from the cluster spec - never a default-route guess, never a random port the firewall closes.
Every attempt computes it again (process 0 may land elsewhere after a loss).

Supervision (`_watch`, on a `WorkerGroup`): the driver waits on every process's future at once (`ray.wait` with a
timeout, never a blocking `ray.get` on one), and polls each process's step through a second thread of
its actor (max_concurrency=2: the training thread only writes an int, so no host sync slows the steps).
On the first failure it gives the others a short grace to show theirs (a dead peer makes the survivors'
collectives fail too: the dead one is the process whose ACTOR died), kills every actor (ray.kill: a
survivor blocked in a collective goes too; jax.distributed's heartbeat timeout is the backstop), names
the lost process (host, node IP, Ray node id, index, step, its log's last lines or where the log is)
and then fails, or restarts: waits for Ray's settled view, chooses the nodes again (never the lost
one), checks the global batch divides the shrunk data axis, and resumes from the last complete
checkpoint (orbax restores onto the new mesh), so the same data stream continues.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, List, Optional, Set

from alpa_job import progress
from alpa_job.train.checkpoint import latest_complete_step
from alpa_job.cluster import ray_api
from alpa_job.launch import failures
from alpa_job.errors import KitError, LostProcessError
from alpa_job.launch.failure_policy import FailurePolicy, check_batch_divides, eligible_nodes
from alpa_job.launch.failures import Lost
from alpa_job.launch.recovery import Recovery, with_restarts
from alpa_job.launch.worker_group import PlacementFailed, WorkerGroup, training_nodes
from alpa_job.train.rundir import checkpoint_dir

GRACE_S = 3.0  # after the first failure: time for the others' to arrive (the dead one is the one to name)
PLACEMENT_RETRIES = 3  # a node that died before its process started: settle and choose again


def _watch(group: WorkerGroup, cfg, channel: progress.ProgressChannel) -> List[Any]:
    """Train on every process; the results, or GroupLost naming the lost processes (actors killed)."""
    group.launch(cfg, channel)
    first_failure: Optional[float] = None
    try:
        while group.running:
            group.poll()
            channel.deliver()
            if group.errors and first_failure is None:
                first_failure = time.monotonic()
                group.ping_all()
            if first_failure is not None and (time.monotonic() - first_failure > GRACE_S or not group.running):
                break
    finally:
        if first_failure is not None:
            group.kill()
        progress.display().stop_bar()
    if first_failure is None:
        return group.results_in_order()
    raise group.failure(first_failure)


# ---------------------------------------------------------------------------------------- the job
def run_on_nodes(config, spec) -> List[Any]:
    """Train with one JAX process per node (restarting up to --max-restarts times after a loss).
    `spec`: the ClusterSpec the entry point resolved."""
    return _Job(config, spec).run()


class _Job:
    def __init__(self, config, spec):
        self.config, self.spec = config, spec
        self.policy = FailurePolicy.from_config(config)
        self.ckpt_dir = checkpoint_dir(config.out) if config.out else None
        self.lost: List[Lost] = []  # every node lost so far (never scheduled onto again)
        self.healthy: Set[str] = set()  # lost processes whose node was found alive
        self.restarts: List[Recovery] = []
        self.recovering: Optional[Recovery] = None  # the restart whose next attempt has not run yet
        self.run_start = (latest_complete_step(self.ckpt_dir) or 0) if config.resume and self.ckpt_dir else 0

    def latest(self) -> Optional[int]:
        return latest_complete_step(self.ckpt_dir) if self.ckpt_dir and self.config.checkpoint_every else None

    def choose(self, want: Optional[int]) -> List[ray_api.RayNode]:
        nodes = training_nodes(eligible_nodes(failures.current_nodes(), self.lost, healthy_ids=self.healthy))
        count = want or len(nodes)
        if not nodes:
            raise LostProcessError("no alive Ray node with a free CPU is left to run the JAX processes on (lost: %s); "
                           "add nodes, then rerun with --resume" % (", ".join(x.where() for x in self.lost) or "-"))
        if count > len(nodes):
            raise KitError(f"--processes {count} but only {len(nodes)} alive Ray nodes have a free CPU; "
                           f"use --processes {len(nodes)} or add nodes")
        return nodes[:count]

    def run(self) -> List[Any]:
        want = self.config.processes or None
        attempt_no = 0
        while True:
            attempt = self._place(want)
            if attempt_no:
                try:
                    check_batch_divides(self.config.batch_size, len(attempt), self.config.devices,
                                        self.config.strategy, self.config.model_parallel, before=want)
                except KitError:
                    attempt.kill()
                    raise
            cfg = self._attempt_config(attempt_no)
            resumed = (latest_complete_step(self.ckpt_dir) or 0) if cfg.resume else 0
            if self.recovering is not None:
                self.recovering.resumed(resumed, len(attempt))
            channel = progress.ProgressChannel.open()
            progress.note(f"[alpa_job] {len(attempt)} JAX process(es) on "
                          f"{', '.join(attempt.ips())}; "
                          f"coordinator {attempt.coordinator() or '-'}"
                          + (f"; attempt {attempt_no + 1}, from step {resumed}" if attempt_no else ""))
            try:
                results = _watch(attempt, cfg, channel)
            except failures.GroupLost as failed:
                self._close_recovery(attempt)
                self._report(failed)
                if not self.policy.may_restart(len(self.restarts)):
                    raise LostProcessError(failures.failure_message(failed.lost[0], failed.slots.get(failed.lost[0].index),
                                                            self.latest(), self._log_shown,
                                                            also=[y.index for y in failed.lost[1:]])) from None
                self._prepare_restart(failed, attempt)
                want = len(attempt)
                attempt_no += 1
                continue
            except BaseException:
                attempt.kill()
                raise
            self._close_recovery(attempt)
            return self._finish(results, attempt, resumed)

    def _place(self, want: Optional[int]) -> WorkerGroup:
        """Start a process on each chosen node; a node that turns out dead is settled and replaced."""
        for _ in range(PLACEMENT_RETRIES):
            attempt = WorkerGroup(self.config, self.spec, self.choose(want if not self.restarts else
                                                                   min(want or 0, self._eligible_count()) or None))
            try:
                attempt.start()
            except PlacementFailed as err:
                attempt.kill()
                progress.note(f"[alpa_job] a JAX process could not start on {', '.join(x.ip for x in err.lost)} "
                              f"({err.lost[0].reason}); waiting for Ray's view of the cluster to settle")
                self._settle(err.lost)
                continue
            except BaseException:
                attempt.kill()
                raise
            if len(attempt) > 1 and (self.config.checkpoint_every or self.config.resume or self.policy.max_restarts):
                try:
                    attempt.check_shared_out()
                except BaseException:
                    attempt.kill()
                    raise
            return attempt
        raise LostProcessError(f"could not place the JAX processes in {PLACEMENT_RETRIES} tries: nodes kept dying "
                       f"({', '.join(x.where() for x in self.lost)}); check `ray status`")

    def _settle(self, lost: List[Lost]) -> None:
        """Wait for Ray's settled view of `lost`; remember them (never used again unless found healthy)."""
        self.healthy -= {x.node_id for x in lost}  # a node found healthy once may be the one lost now
        settled = failures.wait_settled(lost)
        self.healthy |= settled.healthy
        self.lost.extend(lost)

    def _eligible_count(self) -> int:
        return len(eligible_nodes(failures.current_nodes(), self.lost, healthy_ids=self.healthy))

    def _attempt_config(self, attempt_no: int):
        if attempt_no == 0:
            return self.config
        # Resume when a complete checkpoint exists; else start the stream over (nothing was kept).
        resume = self.config.checkpoint_every > 0 and latest_complete_step(self.ckpt_dir) is not None
        return dataclasses.replace(self.config, resume=resume)

    _log_shown = False

    def _report(self, failed: failures.GroupLost) -> None:
        x = failed.lost[0]
        slot = failed.slots.get(x.index)
        if slot is not None:
            if x.index in failed.tails:  # read while ranking (even if Ray could not serve it): not a second time
                read = failed.tails[x.index]
                lines = read[-failures.LOG_TAIL_LINES:] if read is not None else None
            else:
                lines = failures.log_tail(slot)
            self._log_shown = failures.print_log_tail(slot, lines)
        progress.note(f"[alpa_job] lost JAX {x.where()} at step {x.step if x.step is not None else '-'}: {x.reason}")
        for y in failed.lost[1:]:
            progress.note(f"[alpa_job] ended with it: JAX {y.where()} ({y.reason})")

    def _prepare_restart(self, failed: failures.GroupLost, attempt: WorkerGroup) -> None:
        x = failed.lost[0]
        progress.note(f"[alpa_job] restart {len(self.restarts) + 1}/{self.policy.max_restarts}: waiting for Ray to settle "
                      f"(node {x.ip} marked dead, or answering again)")
        self._settle(failed.lost)
        self.policy.wait_for_replacements(self._eligible_count, len(attempt))
        self.recovering = Recovery.after(failed)
        self.restarts.append(self.recovering)

    def _close_recovery(self, attempt: WorkerGroup) -> None:
        if self.recovering is not None:
            self.recovering.recovered(attempt.first_step_at)
            self.recovering = None

    def _finish(self, results: List[Any], attempt: WorkerGroup, resumed: int) -> List[Any]:
        from alpa_job.record.run_record import ProcessResult

        typed = [ProcessResult.coerce(r) for r in results]
        if not self.restarts:
            attempt.kill()
            return typed
        import ray

        extra_seen, extra_dropped = (0, 0)
        if resumed > self.run_start:
            extra_seen, extra_dropped = ray.get(attempt.actors[0].trajectory.remote(self.config, self.run_start,
                                                                                    resumed), timeout=60)
        attempt.kill()  # their work is done; the trajectory call was the last
        return with_restarts(typed, self.restarts, self.run_start, resumed, extra_seen, extra_dropped,
                             self.config.resume)
