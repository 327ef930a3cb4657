"""The worker group: one JAX process (a `JaxProcess` actor) pinned to each chosen Ray node.

It places the actors, starts them (each describes itself: a node that died meanwhile is a
`PlacementFailed`), checks that --out is one directory for all, launches the training on every
process and is polled by the controller: `poll` collects finished processes' results and errors,
reads each process's step through its actor's second thread (the training thread only writes an
int, so no host sync slows the steps) and notices nodes Ray has marked dead. `kill` ends every
actor (a survivor blocked in a collective with a dead peer goes too).

The coordinator is process 0's node's OWN IP (as Ray knows it, from --node-ip-address) and the
port from the cluster spec - never a default-route guess, never a random port the firewall closes.
Every group computes it again (process 0 may land elsewhere after a loss).

The watchdog (`hung`, --hang-timeout S): a process whose step has not advanced for S seconds is alive
but silent. Its clock starts at the launch with 3 x S before the first step (jax.distributed, the
compile, a restore), then S between steps and after the last one (the final eval and save: S must
exceed them). A stopped process (SIGSTOP) stops answering the step polls too; they never block (each
is one outstanding call, read with a zero timeout), its step just stops advancing.
"""

from __future__ import annotations

import os

import time
import uuid
from typing import Any, Dict, List, Optional

from alpa_job.progress.channel import ProgressChannel
from alpa_job.cluster import ray_api
from alpa_job.cluster.worker_path import worker_pythonpath
from alpa_job.cpu_devices import with_device_count
from alpa_job.errors import EXIT_TIMEOUT, Diverged, KitError
from alpa_job.launch import failures, shared_out
from alpa_job.launch.failures import Lost, node_alive
from alpa_job.launch.jax_process import actor_class

ACTOR_START_TIMEOUT_S = 120
POLL_S = 0.5  # how long one poll waits for a process to finish
PING_TIMEOUT_S = 5.0
NODE_CHECK_S = 2.0  # how often a poll reads Ray's node table
FIRST_STEP_FACTOR = 3.0  # the watchdog's allowance before a process's first step, in --hang-timeouts


def training_nodes(nodes: List[ray_api.RayNode]) -> List[ray_api.RayNode]:
    """`nodes` (the eligible ones: alive, a CPU to spare), process 0's first.

    Process 0 (the coordinator) goes on the driver's node when it is a member: that is the head
    under `ray job submit`, whose address the user already knows.
    """
    import ray

    here = ray.util.get_node_ip_address()
    return sorted(nodes, key=lambda n: (n.ip != here, n.ip))


def worker_env(config, spec) -> Dict[str, str]:
    """The environment of every JAX process: the driver's XLA flags with the process's device count, the kit on
    its path, XLA's ports. (Ray's env_vars replace a variable: the driver's other XLA flags would be lost.)"""
    env = {
        "XLA_FLAGS": with_device_count(config.devices),
        "PYTHONPATH": worker_pythonpath(),
    }
    env.update(spec.xla_env())
    from alpa_job.data.pipeline import TRACE_ENV

    if os.environ.get(TRACE_ENV):  # the driver's input trace reaches every process
        env[TRACE_ENV] = os.environ[TRACE_ENV]
    return env


class PlacementFailed(Exception):
    """A chosen node died (or was already dead) before its process started."""

    def __init__(self, lost: List[Lost]):
        super().__init__(", ".join(x.where() for x in lost))
        self.lost = lost


def _user_error(err: BaseException) -> Optional[KitError]:
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, KitError) else None


class WorkerGroup:
    """One process per node in `nodes`: place, start, launch, poll, kill."""

    def __init__(self, config, spec, nodes: List[ray_api.RayNode]):
        import ray

        self.config, self.spec, self.nodes = config, spec, nodes
        env = worker_env(config, spec)
        cls = actor_class()
        self.actors = [cls.options(runtime_env={"env_vars": env}, **ray_api.pin_to_node(n.ip)).remote() for n in nodes]
        self.slots: Dict[int, failures.Slot] = {}  # who each process is (from start())
        self.steps: Dict[int, Optional[int]] = {}  # the last step each process reported
        self.first_step_at: Optional[float] = None  # monotonic time a poll first saw a step
        self.results: Dict[int, Any] = {}  # processes that finished
        self.errors: Dict[int, BaseException] = {}  # processes that failed, in the order seen
        self._pending: List[Any] = []
        self._index: Dict[Any, int] = {}
        self._step_polls: Dict[int, Any] = {}
        self._asked: Dict[int, float] = {}  # when each outstanding step poll was sent
        self._advanced: Dict[int, float] = {}  # when each process's step last advanced
        self.launched_at: Optional[float] = None
        self._nodes_checked = 0.0
        self._ray = ray

    def __len__(self) -> int:
        return len(self.actors)

    def kill(self) -> None:
        failures.kill_all(self.actors)

    def ips(self) -> List[str]:
        return [self.slots[i].ip for i in range(len(self))]

    def coordinator(self) -> Optional[str]:
        return f"{self.slots[0].ip}:{self.spec.jax_coordinator_port}" if len(self) > 1 else None

    # ----- starting ------------------------------------------------------------------------------
    def start(self) -> None:
        """Every actor describes itself (bounded); a node that died meanwhile -> PlacementFailed."""
        ray = self._ray
        refs = [a.describe.remote(i) for i, a in enumerate(self.actors)]
        deadline = time.monotonic() + ACTOR_START_TIMEOUT_S
        lost: List[Lost] = []
        pending = list(refs)
        while pending and not lost and time.monotonic() < deadline:
            _ready, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            if pending:  # a node Ray marks dead meanwhile never starts its actor: stop waiting for it
                nodes = failures.current_nodes()
                lost = [
                    Lost(i, None, n.ip, n.node_id, None, "its node died before the process started")
                    for i, (ref, n) in enumerate(zip(refs, self.nodes))
                    if ref in pending and not node_alive(nodes, n.node_id)
                ]
        for i, (ref, node) in enumerate(zip(refs, self.nodes)):
            if ref in pending:
                continue
            try:
                self.slots[i] = failures.Slot(**ray.get(ref))
            except ray.exceptions.RayActorError as err:
                lost.append(Lost(i, None, node.ip, node.node_id, None, failures.first_line(err)))
        if lost:
            raise PlacementFailed(lost)
        if pending:
            idle = [self.nodes[i].ip for i, r in enumerate(refs) if r in pending]
            raise KitError(
                f"JAX processes did not start on {', '.join(idle)} within {ACTOR_START_TIMEOUT_S} s; "
                "run python -m alpa_job doctor to find the node that cannot run tasks",
                EXIT_TIMEOUT,
            )

    def check_shared_out(self) -> None:
        """Every process sees every other's probe file under --out (checkpoints need one directory)."""
        ray = self._ray
        out, n = self.config.out, len(self.actors)
        token = uuid.uuid4().hex[:12]
        try:
            ray.get([a.write_probe.remote(out, token, i) for i, a in enumerate(self.actors)], timeout=ACTOR_START_TIMEOUT_S)
            seen = ray.get([a.missing_probes.remote(out, token, n) for a in self.actors], timeout=ACTOR_START_TIMEOUT_S)
        finally:
            shared_out.remove_probes(out, token)
        shared_out.check_shared(out, dict(enumerate(seen)), [self.slots[i].host for i in range(n)])

    # ----- training ------------------------------------------------------------------------------
    def launch(self, cfg, channel: Optional[ProgressChannel]) -> None:
        """Start training on every process; process 0's progress goes through `channel`."""
        n, coordinator = len(self), self.coordinator()
        futures = [a.train.remote(cfg, i, n, coordinator, channel if i == 0 else None) for i, a in enumerate(self.actors)]
        self._index = {ref: i for i, ref in enumerate(futures)}
        self._pending = list(futures)
        self.launched_at = time.monotonic()

    @property
    def running(self) -> bool:
        """Some process has neither finished nor failed."""
        return bool(self._pending)

    def poll(self, timeout_s: float = POLL_S) -> None:
        """Wait up to `timeout_s` for processes to finish; collect their results or errors, every
        process's step and the nodes Ray marked dead. A user error found on a worker is raised here as
        the same one line as locally."""
        ray = self._ray
        done, self._pending = ray.wait(self._pending, num_returns=len(self._pending), timeout=timeout_s)
        for ref in done:
            try:
                self.results[self._index[ref]] = ray.get(ref)
            except Exception as err:  # classified by failures.classify
                user = _user_error(err)
                if isinstance(user, Diverged):  # its type is its report's status
                    raise user from None
                if user is not None:
                    raise KitError(str(user), user.exit_code) from None
                self.errors[self._index[ref]] = err
        self._check_nodes()
        self._poll_steps()

    def results_in_order(self) -> List[Any]:
        return [self.results[i] for i in range(len(self))]

    def _poll_steps(self) -> None:
        ray = self._ray
        for i, ref in list(self._step_polls.items()):
            ready, _ = ray.wait([ref], timeout=0)
            if not ready:
                continue
            del self._step_polls[i]
            self._asked.pop(i, None)
            try:
                step = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                self.errors.setdefault(i, err)
                continue
            except Exception:  # noqa: BLE001 - a poll is best effort
                continue
            if step is not None:
                if step != self.steps.get(i):
                    self._advanced[i] = time.monotonic()
                self.steps[i] = step
                if self.first_step_at is None:
                    self.first_step_at = time.monotonic()
        for i, a in enumerate(self.actors):
            if i not in self._step_polls and i not in self.errors:
                self._step_polls[i] = a.current_step.remote()
                self._asked[i] = time.monotonic()

    def _check_nodes(self) -> None:
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
            if i not in self.errors and slot.node_id and slot.node_id not in alive:
                self.errors[i] = failures.Unresponsive("Ray marked its node dead")

    def stop_at_one_step(self, base: int) -> int:
        """Preemption: every process stops after one step they all accepted (train.stop.agree), saving it;
        `base` is the step the attempt started from. Returns that step."""
        from alpa_job.train.stop import agree

        ray = self._ray
        live = [a for i, a in enumerate(self.actors) if i not in self.errors]

        def propose(at: int) -> List[Optional[int]]:
            return ray.get([a.propose_stop.remote(at) for a in live], timeout=PING_TIMEOUT_S)

        def confirm(at: int) -> None:
            ray.get([a.confirm_stop.remote(at) for a in live], timeout=PING_TIMEOUT_S)

        return agree(propose, confirm, max([base] + [s for s in self.steps.values() if s is not None]))

    def ping_all(self, hang_timeout: float = 0.0) -> None:
        """After a first failure: a process whose actor no longer answers (within PING_TIMEOUT_S) is dead too;
        hung when its step had not advanced for half of `hang_timeout` either (the peers that JAX's heartbeat
        ended because of it are then the collateral, and it is the one to name)."""
        ray = self._ray
        refs = {i: a.current_step.remote() for i, a in enumerate(self.actors) if i not in self.errors and i not in self.results}
        if not refs:
            return
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=PING_TIMEOUT_S)
        for i, ref in refs.items():
            if ref not in ready:
                quiet = time.monotonic() - (self._advanced.get(i) or self.launched_at or time.monotonic())
                self.errors[i] = (
                    failures.Hung(self.steps.get(i), quiet, answering=False)
                    if hang_timeout and quiet > hang_timeout / 2
                    else failures.Unresponsive("did not answer within %.0f s" % PING_TIMEOUT_S)
                )
                continue
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as err:
                self.errors[i] = err
            except Exception:  # noqa: BLE001 - alive enough
                pass

    def hung(self, timeout_s: float) -> Dict[int, failures.Hung]:
        """The watchdog: when a running process has been silent past its allowance, every process silent
        for over half of it, the one to blame first (one that does not answer at all, then the lowest
        step: its peers wait for it in a collective); {} while every process makes progress."""
        if not timeout_s or self.launched_at is None:
            return {}
        now = time.monotonic()
        silent: Dict[int, float] = {}
        tripped = False
        for i in range(len(self)):
            if i in self.results or i in self.errors:
                continue
            last = self._advanced.get(i)
            allowance = timeout_s if last is not None else timeout_s * FIRST_STEP_FACTOR
            quiet = now - (last if last is not None else self.launched_at)
            tripped = tripped or quiet > allowance
            if quiet > allowance / 2:
                silent[i] = quiet
        if not tripped:
            return {}

        def answering(i: int) -> bool:
            return now - self._asked.get(i, now) < PING_TIMEOUT_S

        def step(i: int) -> int:
            return self.steps[i] if self.steps.get(i) is not None else -1

        order = sorted(silent, key=lambda i: (answering(i), step(i), i))
        return {i: failures.Hung(self.steps.get(i), silent[i], answering(i)) for i in order}

    def failure(self, detected: float) -> BaseException:
        """What the errors seen so far mean (failures.classify): lost processes, or one that raised."""
        return failures.classify(self.errors, self.slots, self.steps, detected)
