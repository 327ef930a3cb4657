"""One JAX process per Ray node: pin an actor to each node, start jax.distributed, train; name a lost
process and, with --max-restarts, go on without it (issue 12).

The coordinator is process 0's node's OWN IP (as Ray knows it, from --node-ip-address) and the
port from the cluster spec - never a default-route guess, never a random port the firewall closes.
Every attempt computes it again (process 0 may land elsewhere after a loss).

Supervision (`_Attempt.watch`): the driver waits on every process's future at once (`ray.wait` with a
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
import datetime
import socket
import threading
import time
import uuid
from typing import Any, Dict, List, Optional, Set, Tuple

from alpa_job import progress
from alpa_job.train.checkpoint import latest_complete_step
from alpa_job.cluster import ray_api
from alpa_job.launch import failures, shared_out
from alpa_job.cluster.worker_path import worker_pythonpath
from alpa_job.errors import EXIT_PROCESS_LOST, EXIT_TIMEOUT, KitError, LostProcessError
from alpa_job.launch.restarts import Lost, check_batch_divides, eligible_nodes, node_alive
from alpa_job.train.rundir import checkpoint_dir

ACTOR_START_TIMEOUT_S = 120
POLL_S = 0.5  # how often the driver looks at the processes' futures and steps
GRACE_S = 3.0  # after the first failure: time for the others' to arrive (the dead one is the one to name)
PING_TIMEOUT_S = 5.0
NODE_CHECK_S = 2.0  # how often the driver reads Ray's node table while training
PORT_FREE_TIMEOUT_S = 30.0  # process 0 waits for the last attempt's coordinator to release the port
PLACEMENT_RETRIES = 3  # a node that died before its process started: settle and choose again


def training_nodes(nodes: Optional[List[ray_api.RayNode]] = None) -> List[ray_api.RayNode]:
    """Alive nodes with a CPU to spare, process 0's first.

    Process 0 (the coordinator) goes on the driver's node when it is a member: that is the head
    under `ray job submit`, whose address the user already knows.
    """
    import ray

    here = ray.util.get_node_ip_address()
    if nodes is None:
        nodes = [n for n in ray_api.alive_nodes() if n.cpus() >= 1]
    return sorted(nodes, key=lambda n: (n.ip != here, n.ip))


def _worker_env(config, spec) -> Dict[str, str]:
    env = {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={config.devices}",
        "PYTHONPATH": worker_pythonpath(),
    }
    env.update(spec.xla_env())
    return env


def wait_port_free(port: int, timeout_s: float = PORT_FREE_TIMEOUT_S) -> None:
    """Until this node can bind `port` (the previous attempt's coordinator, just killed, releases it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("", port))
            return
        except OSError:
            if time.monotonic() > deadline:
                return  # jax.distributed's own error will then name the port
            time.sleep(0.25)
        finally:
            s.close()


_ACTOR_CLASS = None


def _actor_class():
    """The JaxProcess actor class (made once: Ray registers each class it is given)."""
    global _ACTOR_CLASS
    if _ACTOR_CLASS is not None:
        return _ACTOR_CLASS
    import ray

    @ray.remote(num_cpus=1, max_concurrency=2)  # a 2nd thread answers step polls while the 1st trains
    class JaxProcess:
        def __init__(self):
            self.step: Optional[int] = None

        def describe(self, index: int) -> Dict[str, Any]:
            return failures.describe_self(index)

        def current_step(self) -> Optional[int]:
            return self.step

        def write_probe(self, out: str, token: str, index: int) -> None:
            shared_out.write_probe(out, token, index, socket.gethostname())

        def missing_probes(self, out: str, token: str, count: int) -> List[int]:
            return shared_out.missing_probes(out, token, count)

        def trajectory(self, cfg, run_start: int, resumed_from: int) -> Tuple[int, int]:
            from alpa_job.data import load_dataset, plan_epoch
            from alpa_job.launch.restarts import samples_in_steps

            epoch = plan_epoch(load_dataset(cfg).num_samples, cfg.batch_size, cfg.remainder)
            return samples_in_steps(epoch.steps, epoch.full_batches, epoch.remainder, epoch.policy,
                                    cfg.batch_size, run_start, resumed_from)

        def train(self, cfg, process_id: int, num_processes: int, coordinator: Optional[str],
                  channel=None) -> Any:
            from alpa_job import progress
            from alpa_job.train.loop import train_process

            def on_step(step: int) -> None:
                self.step = step

            progress.send_to(channel)  # process 0 feeds the driver's display; the others keep quiet
            if process_id == 0 and coordinator:
                wait_port_free(int(coordinator.rpartition(":")[2]))
            return train_process(cfg, process_id, num_processes, coordinator, on_step=on_step)

    _ACTOR_CLASS = JaxProcess
    return JaxProcess


# ---------------------------------------------------------------------------------------- outcomes
class _Failed(Exception):
    """An attempt lost processes (their actors died); `lost` names them."""

    def __init__(self, lost: List[Lost], slots: Dict[int, failures.Slot], detected: float, wall: str):
        super().__init__(", ".join(x.where() for x in lost))
        self.lost, self.slots, self.detected, self.wall = lost, slots, detected, wall
        self.run_step: Optional[int] = None  # the furthest step any process had reached
        self.tails: Dict[int, Optional[List[str]]] = {}  # log tails already read while ranking the dead


class _Unresponsive(Exception):
    """A process whose actor stopped answering (its node gone without a connection reset telling us)."""


class _PlacementFailed(Exception):
    """A chosen node died (or was already dead) before its process started."""

    def __init__(self, lost: List[Lost]):
        super().__init__(", ".join(x.where() for x in lost))
        self.lost = lost


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def _user_error(err: BaseException) -> Optional[KitError]:
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, KitError) else None


# ---------------------------------------------------------------------------------------- one attempt
class _Attempt:
    """One process set: start the actors, check --out, train, watch."""

    def __init__(self, config, spec, nodes: List[ray_api.RayNode]):
        import ray

        self.config, self.spec, self.nodes = config, spec, nodes
        env = _worker_env(config, spec)
        cls = _actor_class()
        self.actors = [cls.options(runtime_env={"env_vars": env}, **ray_api.pin_to_node(n.ip)).remote()
                       for n in nodes]
        self.slots: Dict[int, failures.Slot] = {}
        self.steps: Dict[int, Optional[int]] = {}
        self.first_step_at: Optional[float] = None
        self._ray = ray

    def __len__(self) -> int:
        return len(self.actors)

    def kill(self) -> None:
        failures.kill_all(self.actors)

    def start(self) -> None:
        """Every actor describes itself (bounded); a node that died meanwhile -> _PlacementFailed."""
        ray = self._ray
        refs = [a.describe.remote(i) for i, a in enumerate(self.actors)]
        deadline = time.monotonic() + ACTOR_START_TIMEOUT_S
        lost: List[Lost] = []
        pending = list(refs)
        while pending and not lost and time.monotonic() < deadline:
            _ready, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            if pending:  # a node Ray marks dead meanwhile never starts its actor: stop waiting for it
                nodes = failures.current_nodes()
                lost = [Lost(i, None, n.ip, n.node_id, None, "its node died before the process started")
                        for i, (ref, n) in enumerate(zip(refs, self.nodes))
                        if ref in pending and not node_alive(nodes, n.node_id)]
        for i, (ref, node) in enumerate(zip(refs, self.nodes)):
            if ref in pending:
                continue
            try:
                self.slots[i] = failures.Slot(**ray.get(ref))
            except ray.exceptions.RayActorError as err:
                lost.append(Lost(i, None, node.ip, node.node_id, None, failures.first_line(err)))
        if lost:
            raise _PlacementFailed(lost)
        if pending:
            idle = [self.nodes[i].ip for i, r in enumerate(refs) if r in pending]
            raise KitError(f"JAX processes did not start on {', '.join(idle)} within {ACTOR_START_TIMEOUT_S} s; "
                           "run python -m alpa_job doctor to find the node that cannot run tasks", EXIT_TIMEOUT)

    def check_shared_out(self) -> None:
        """Every process sees every other's probe file under --out (checkpoints need one directory)."""
        ray = self._ray
        out, n = self.config.out, len(self.actors)
        token = uuid.uuid4().hex[:12]
        try:
            ray.get([a.write_probe.remote(out, token, i) for i, a in enumerate(self.actors)],
                    timeout=ACTOR_START_TIMEOUT_S)
            seen = ray.get([a.missing_probes.remote(out, token, n) for a in self.actors], timeout=ACTOR_START_TIMEOUT_S)
        finally:
            shared_out.remove_probes(out, token)
        shared_out.check_shared(out, dict(enumerate(seen)), [self.slots[i].host for i in range(n)])

    def coordinator(self) -> Optional[str]:
        return f"{self.slots[0].ip}:{self.spec.jax_coordinator_port}" if len(self) > 1 else None

    def train(self, cfg, channel: progress.ProgressChannel) -> List[Any]:
        """Train on every process; the results, or _Failed naming the lost processes (actors killed)."""
        ray = self._ray
        n, coordinator = len(self), self.coordinator()
        futures = [a.train.remote(cfg, i, n, coordinator, channel if i == 0 else None)
                   for i, a in enumerate(self.actors)]
        polls: Dict[int, Any] = {}
        errors: Dict[int, BaseException] = {}
        results: Dict[int, Any] = {}
        first_failure: Optional[float] = None
        index = {ref: i for i, ref in enumerate(futures)}
        pending = list(futures)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
                for ref in done:
                    try:
                        results[index[ref]] = ray.get(ref)
                    except Exception as err:  # classified below
                        user = _user_error(err)
                        if user is not None:  # a user error found on a worker: same one line as locally
                            raise KitError(str(user), user.exit_code) from None
                        errors[index[ref]] = err
                self._poll_steps(polls, errors)
                channel.deliver()
                if errors and first_failure is None:
                    first_failure = time.monotonic()
                    self._ping_all(errors, results)
                if first_failure is not None and (time.monotonic() - first_failure > GRACE_S or not pending):
                    break
        finally:
            if first_failure is not None:
                self.kill()
            progress.display().stop_bar()
        if first_failure is None:
            return [results[i] for i in range(n)]
        raise self._failed(errors, first_failure)

    def _poll_steps(self, polls: Dict[int, Any], errors: Dict[int, BaseException]) -> None:
        ray = self._ray
        self._check_nodes(errors)
        for i, ref in list(polls.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del polls[i]
            try:
                step = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                errors.setdefault(i, err)
                continue
            except Exception:  # noqa: BLE001 - a poll is best effort
                continue
            if step is not None:
                self.steps[i] = step
                if self.first_step_at is None:
                    self.first_step_at = time.monotonic()
        for i, a in enumerate(self.actors):
            if i not in polls and i not in errors:
                polls[i] = a.current_step.remote()

    _nodes_checked = 0.0

    def _check_nodes(self, errors: Dict[int, BaseException]) -> None:
        """Every NODE_CHECK_S: a process whose node Ray has marked dead is lost, even while it still answers
        (its raylet died first) or before any connection reset told us (a partition rather than a crash)."""
        now = time.monotonic()
        if now - self._nodes_checked < NODE_CHECK_S:
            return
        self._nodes_checked = now
        try:
            alive = {n.node_id for n in failures.current_nodes() if n.alive}
        except Exception:  # noqa: BLE001 - the GCS busy: look again next time
            return
        for i, slot in self.slots.items():
            if i not in errors and slot.node_id and slot.node_id not in alive:
                errors[i] = _Unresponsive("Ray marked its node dead")

    def _ping_all(self, errors: Dict[int, BaseException], results: Dict[int, Any]) -> None:
        """A process whose actor no longer answers (within PING_TIMEOUT_S) is dead too."""
        ray = self._ray
        refs = {i: a.current_step.remote() for i, a in enumerate(self.actors) if i not in errors and i not in results}
        if not refs:
            return
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=PING_TIMEOUT_S)
        for i, ref in refs.items():
            if ref not in ready:
                errors[i] = _Unresponsive("did not answer within %.0f s" % PING_TIMEOUT_S)
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                errors[i] = err
            except Exception:  # noqa: BLE001 - alive enough
                pass

    def _failed(self, errors: Dict[int, BaseException], first_failure: float) -> BaseException:
        ray = self._ray
        dead = {i: e for i, e in errors.items() if isinstance(e, (ray.exceptions.RayActorError, _Unresponsive))}
        if not dead:
            # Every process is alive and one raised: a bug or a bad input, not a lost node; no restart.
            i, err = sorted(errors.items())[0]
            slot = self.slots.get(i)
            lines = failures.log_tail(slot) if slot else None
            if slot:
                failures.print_log_tail(slot, lines)
            who = f"process {i} on host {slot.host} ({slot.ip})" if slot else f"process {i}"
            return KitError(f"JAX {who} failed: {failures.first_line(getattr(err, 'cause', None) or err)}",
                            EXIT_PROCESS_LOST)
        # The lost one first: a node that stopped answering (Ray: "unavailable") over a process that died on a
        # live node (JAX's coordination service aborts the survivors of a dead peer: collateral), then by
        # arrival (`errors` keeps the order the failures were seen in).
        unreachable = tuple(t for t in (getattr(ray.exceptions, "ActorUnavailableError", None), _Unresponsive) if t)
        arrival = list(errors)
        tails = self._read_tails(dead) if not any(isinstance(e, unreachable) for e in dead.values()) else {}
        collateral = {i for i, lines in tails.items() if lines and any(m in line for line in lines for m in JAX_ABORT)}
        order = sorted(dead, key=lambda i: (not isinstance(dead[i], unreachable), i in collateral, arrival.index(i)))
        lost = [self.slots[i].lost(self.steps.get(i), failures.first_line(dead[i])) for i in order]
        failed = _Failed(lost, self.slots, first_failure, _now_iso())
        failed.tails = tails
        failed.run_step = max((s for s in self.steps.values() if s is not None), default=None)
        return failed


    def _read_tails(self, dead: Dict[int, BaseException]) -> Dict[int, Optional[List[str]]]:
        """Several processes died on live nodes: their logs' tails, read at once (bounded), to tell the one to
        name from those JAX's coordination service aborted because a peer died (JAX_ABORT); _report reuses them."""
        if len(dead) < 2:
            return {}
        tails: Dict[int, Optional[List[str]]] = {}

        def read(i: int) -> None:
            slot = self.slots.get(i)
            tails[i] = failures.log_tail(slot, lines=60) if slot else None

        threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in dead]
        for t in threads:
            t.start()
        for t in threads:
            t.join(failures.LOG_TIMEOUT_S + 1)
        return dict(tails)


JAX_ABORT = ("CoordinationServiceAgent::SetError", "detected fatal errors", "Terminating process because",
             "SIGABRT received")


# ---------------------------------------------------------------------------------------- the job
def run_on_nodes(config, spec) -> List[Any]:
    """Train with one JAX process per node (restarting up to --max-restarts times after a loss).
    `spec`: the ClusterSpec the entry point resolved."""
    return _Job(config, spec).run()


class _Job:
    def __init__(self, config, spec):
        self.config, self.spec = config, spec
        self.max_restarts = int(getattr(config, "max_restarts", 0) or 0)
        self.restart_wait = float(getattr(config, "restart_wait", 0) or 0)
        self.ckpt_dir = checkpoint_dir(config.out) if config.out else None
        self.lost: List[Lost] = []  # every node lost so far (never scheduled onto again)
        self.healthy: Set[str] = set()  # lost processes whose node was found alive
        self.restarts: List[Dict[str, Any]] = []
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
            if self.restarts and self.restarts[-1].get("processes_after") is None:
                self.restarts[-1].update(resumed_from_step=resumed, processes_after=len(attempt))
                failed_at = self.restarts[-1]["failed_at_step"]
                self.restarts[-1]["steps_lost"] = max(0, (failed_at or resumed) - resumed)
            channel = progress.ProgressChannel.open()
            progress.note(f"[alpa_job] {len(attempt)} JAX process(es) on "
                          f"{', '.join(attempt.slots[i].ip for i in range(len(attempt)))}; "
                          f"coordinator {attempt.coordinator() or '-'}"
                          + (f"; attempt {attempt_no + 1}, from step {resumed}" if attempt_no else ""))
            try:
                results = attempt.train(cfg, channel)
            except _Failed as failed:
                self._close_recovery(attempt)
                self._report(failed)
                if len(self.restarts) >= self.max_restarts:
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

    def _place(self, want: Optional[int]) -> "_Attempt":
        """Start a process on each chosen node; a node that turns out dead is settled and replaced."""
        for _ in range(PLACEMENT_RETRIES):
            attempt = _Attempt(self.config, self.spec, self.choose(want if not self.restarts else
                                                                   min(want or 0, self._eligible_count()) or None))
            try:
                attempt.start()
            except _PlacementFailed as err:
                attempt.kill()
                progress.note(f"[alpa_job] a JAX process could not start on {', '.join(x.ip for x in err.lost)} "
                              f"({err.lost[0].reason}); waiting for Ray's view of the cluster to settle")
                self._settle(err.lost)
                continue
            except BaseException:
                attempt.kill()
                raise
            if len(attempt) > 1 and (self.config.checkpoint_every or self.config.resume or self.max_restarts):
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

    def _report(self, failed: _Failed) -> None:
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

    def _prepare_restart(self, failed: _Failed, attempt: "_Attempt") -> None:
        x = failed.lost[0]
        progress.note(f"[alpa_job] restart {len(self.restarts) + 1}/{self.max_restarts}: waiting for Ray to settle "
                      f"(node {x.ip} marked dead, or answering again)")
        self._settle(failed.lost)
        want = len(attempt)
        deadline = time.monotonic() + self.restart_wait
        while self._eligible_count() < want and time.monotonic() < deadline:
            time.sleep(0.5)  # a replacement node joining within --restart-wait is used too
        self.restarts.append({"time": failed.wall, "host": x.host, "ip": x.ip, "node_id": x.node_id,
                              "process": x.index, "reason": x.reason,
                              "failed_at_step": failed.run_step if failed.run_step is not None else x.step,
                              "resumed_from_step": 0, "steps_lost": 0, "processes_after": None,
                              "recover_seconds": None, "_detected": failed.detected})

    def _close_recovery(self, attempt: "_Attempt") -> None:
        if self.restarts and self.restarts[-1]["recover_seconds"] is None and attempt.first_step_at is not None:
            self.restarts[-1]["recover_seconds"] = round(attempt.first_step_at - self.restarts[-1]["_detected"], 3)

    def _finish(self, results: List[Any], attempt: "_Attempt", resumed: int) -> List[Any]:
        from alpa_job.record.run_record import ProcessResult, RestartRecord

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
        rows = [RestartRecord(**{k: v for k, v in r.items() if not k.startswith("_")}) for r in self.restarts]
        for r in typed:
            r.steps += resumed - self.run_start
            r.samples_seen += extra_seen
            r.samples_dropped += extra_dropped
            r.resumed_from_step = self.run_start if self.config.resume else None
            r.restarts = rows
        return typed
