"""The job controller's states and restarts, without a cluster: a scripted worker group stands in for the
actors (the real group, the actor and Ray's node view are exercised by test_node_loss.py's test-bed part)."""

from __future__ import annotations

import time
from typing import Dict, List

import pytest

from alpa_job.cluster import ray_api
from alpa_job.errors import LostProcessError
from alpa_job.launch import controller as controller_module
from alpa_job.launch import failures
from alpa_job.launch.controller import TRANSITIONS, JobController, JobState
from alpa_job.launch.failure_policy import FAIL, RETRY, WAIT, Decision, FailurePolicy
from alpa_job.record.run_record import ProcessResult, RestartRecord
from helpers_train import tiny_config


def _nodes(*ids: str) -> List[ray_api.RayNode]:
    rows = [
        {"NodeManagerAddress": "10.77.0.%d" % (i + 1), "NodeID": nid, "Alive": True, "Resources": {"CPU": 2.0}} for i, nid in enumerate(ids)
    ]
    return ray_api.parse_nodes(rows)


class ScriptedGroup:
    """A worker group whose attempts follow SCRIPT: "ok", or the index of the process that is lost."""

    SCRIPT: List[object] = []
    made: List["ScriptedGroup"] = []

    def __init__(self, config, spec, nodes):
        self.nodes = nodes
        self.slots = {i: failures.Slot(index=i, ip=n.ip, host="h%d" % i, node_id=n.node_id) for i, n in enumerate(nodes)}
        self.errors: Dict[int, BaseException] = {}
        self.results: Dict[int, ProcessResult] = {}
        self.first_step_at = None
        self.running = False
        self.killed = False
        ScriptedGroup.made.append(self)

    def __len__(self):
        return len(self.nodes)

    def start(self):
        pass

    def check_shared_out(self):
        pass

    def ips(self):
        return [n.ip for n in self.nodes]

    def coordinator(self):
        return None

    def launch(self, cfg, channel):
        self.cfg, self.running, self.outcome = cfg, True, ScriptedGroup.SCRIPT.pop(0)

    def poll(self, timeout_s=0.0):
        self.first_step_at = time.monotonic()
        self.running = False
        if self.outcome == "ok":
            self.results = {i: ProcessResult(engine="jax", strategy="data", steps=4) for i in range(len(self))}
        else:
            self.errors[self.outcome] = failures.Unresponsive("Ray marked its node dead")

    def ping_all(self, hang_timeout=0.0):
        pass

    def hung(self, timeout_s):
        return {}  # the scripted processes always make progress (the watchdog's own tests are elsewhere)

    def results_in_order(self):
        return [self.results[i] for i in range(len(self))]

    def failure(self, detected):
        return failures.classify(self.errors, self.slots, {i: 7 for i in self.slots}, detected)

    def kill(self):
        self.killed = True


class QuietChannel:
    def deliver(self, to=None, timeout_s=10):
        pass


@pytest.fixture
def scripted(monkeypatch):
    nodes = _nodes("n1", "n2", "n3")
    dead: List[str] = []
    monkeypatch.setattr(controller_module, "WorkerGroup", ScriptedGroup)
    monkeypatch.setattr(controller_module, "training_nodes", lambda nodes: list(nodes))
    monkeypatch.setattr(controller_module.ProgressChannel, "open", classmethod(lambda cls: QuietChannel()))
    monkeypatch.setattr(failures, "current_nodes", lambda: [n for n in nodes if n.node_id not in dead])

    def settle(lost, timeout_s=0):
        dead.extend(x.node_id for x in lost)
        return failures.Settled(dead={x.node_id for x in lost}, healthy=set(), seconds=0.0)

    monkeypatch.setattr(failures, "wait_settled", settle)
    ScriptedGroup.made = []
    return ScriptedGroup


def test_every_state_but_the_ends_can_fail_and_the_ends_are_final():
    for state in (JobState.PLACING, JobState.RUNNING, JobState.RECOVERING):
        assert JobState.FAILED in TRANSITIONS[state]
    assert TRANSITIONS[JobState.FINISHED] == TRANSITIONS[JobState.FAILED] == frozenset()
    assert set(TRANSITIONS) == set(JobState)


def test_a_clean_run_is_placing_running_finished(scripted):
    scripted.SCRIPT = ["ok"]
    job = JobController(tiny_config(address="10.0.0.1:6379", batch_size=48), spec=None)
    results = job.run()
    assert job.state is JobState.FINISHED and len(results) == 3 and results[0].restarts == []
    assert scripted.made[0].killed  # the actors go once their work is done


def test_a_loss_is_recovered_on_the_survivors_with_a_typed_restart_record(scripted):
    scripted.SCRIPT = [2, "ok"]
    job = JobController(tiny_config(address="10.0.0.1:6379", batch_size=48, max_restarts=1), spec=None)
    states = []
    enter = job._enter

    def spy(state, why=""):
        states.append(state)
        enter(state, why)

    job._enter = spy
    results = job.run()
    assert states == [JobState.RUNNING, JobState.RECOVERING, JobState.PLACING, JobState.RUNNING, JobState.FINISHED]
    assert [len(g) for g in scripted.made] == [3, 2]  # the lost node is never chosen again
    assert "n3" not in {n.node_id for n in scripted.made[1].nodes}
    (row,) = results[0].restarts
    assert isinstance(row, RestartRecord)
    assert (row.host, row.process, row.node_id, row.failed_at_step, row.processes_after) == ("h2", 2, "n3", 7, 2)
    assert row.recover_seconds is not None and row.reason == "Ray marked its node dead"


def test_without_restarts_a_loss_fails_naming_the_process(scripted):
    scripted.SCRIPT = [1]
    job = JobController(tiny_config(address="10.0.0.1:6379", batch_size=48), spec=None, policy=FailurePolicy(max_restarts=0))
    with pytest.raises(LostProcessError, match=r"JAX process 1 on host h1 .* died at step 7"):
        job.run()
    assert job.state is JobState.FAILED and scripted.made[0].killed


class ScriptedPolicy:
    """Returns the decisions it was given, one a call, and keeps what it was shown."""

    def __init__(self, *decisions):
        self.decisions, self.seen = list(decisions), []
        self.max_restarts = 1

    def decide(self, status):
        self.seen.append(status)
        return self.decisions.pop(0)


def test_the_controller_does_what_the_policy_decides_wait_then_retry_on_its_count(scripted, monkeypatch):
    monkeypatch.setattr(controller_module, "REPLACEMENT_POLL_S", 0.01)
    scripted.SCRIPT = [0, "ok"]
    policy = ScriptedPolicy(
        Decision(WAIT, "settle first"), Decision(WAIT, "a replacement may join"), Decision(RETRY, "on one", processes=1)
    )
    job = JobController(tiny_config(address="10.0.0.1:6379", batch_size=48), spec=None, policy=policy)
    results = job.run()
    assert job.state is JobState.FINISHED and [len(g) for g in scripted.made] == [3, 1]
    # What it was shown: the loss, then (settled) the two nodes left, counted again after the wait.
    assert [(s.restarts_so_far, s.processes, s.eligible) for s in policy.seen] == [(0, 3, None), (0, 3, 2), (0, 3, 2)]
    assert policy.seen[0].lost[0].index == 0 and policy.seen[2].waited_s > 0
    assert results[0].restarts[0].processes_after == 1


def test_the_controller_fails_with_the_policys_reason_once_nodes_are_counted(scripted):
    scripted.SCRIPT = [1]
    policy = ScriptedPolicy(Decision(WAIT, "settle first"), Decision(FAIL, "no node the job may use is left"))
    job = JobController(tiny_config(address="10.0.0.1:6379", batch_size=48), spec=None, policy=policy)
    with pytest.raises(LostProcessError, match=r"^no node the job may use is left \(lost: .*10\.77\.0\.2.*\); add nodes"):
        job.run()
    assert job.state is JobState.FAILED and len(scripted.made) == 1


def test_every_jax_process_keeps_the_drivers_xla_flags_with_its_own_device_count(spec, monkeypatch):
    """Ray's env_vars replace a variable: a flag the user gave the driver (a dump folder, an optimisation level)
    must reach the JAX processes, with only the device count set by --devices."""
    from alpa_job.launch.worker_group import worker_env

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/dumps --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
    flags = worker_env(tiny_config(devices=2), spec)["XLA_FLAGS"].split()
    assert flags == ["--xla_dump_to=/tmp/dumps", "--xla_backend_optimization_level=0", "--xla_force_host_platform_device_count=2"]
    monkeypatch.delenv("XLA_FLAGS")
    assert worker_env(tiny_config(devices=3), spec)["XLA_FLAGS"] == "--xla_force_host_platform_device_count=3"
