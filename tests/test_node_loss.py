"""Node loss (issue 12): a job that loses a host names it, and restarts on the survivors from its last
checkpoint.

Unit part (no test bed): the settled-view and node-choice decisions on injected node rows, the batch
divisibility check of a shrunk mesh, the final trajectory's counts, the shared --out check, and that a
checkpoint killed mid-save (a leftover orbax tmp folder) never counts as the latest.

Test-bed part (slow, real host kills: the host's PID 1 is SIGKILLed, which takes every process of
that host with it, its raylet and its JAX process included): 3 hosts x 2 devices, process 2 on w2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from alpa_job.train.checkpoint_files import latest_complete_step
from alpa_job.cluster import ray_api
from alpa_job.launch import shared_out
from alpa_job.errors import KitError
from alpa_job.launch.failure_policy import FAIL, RETRY, WAIT, FailurePolicy, PollStatus
from alpa_job.launch.placement import check_batch_divides, eligible_nodes
from alpa_job.launch.failures import Lost, view_settled
from alpa_job.launch.recovery import samples_in_steps, trajectory_counts
from alpa_job.data import plan_epoch
from helpers_node_loss import BATCH, EVERY, FAST_DEATH, MLP, STEPS, _cluster, _out, _train_argv
from helpers_train import tiny_config


# ============================================================================ unit: settled view
def _row(ip, node_id, alive=True, cpus=2.0):
    return {"NodeManagerAddress": ip, "NodeID": node_id, "Alive": alive, "Resources": {"CPU": cpus}}


LOST = [Lost(index=2, host="w2", ip="10.77.0.3", node_id="n3", step=70)]


def test_view_not_settled_while_the_lost_node_is_listed_alive():
    """The --resume crash of issue 12: Ray still listed the killed node as alive."""
    nodes = ray_api.parse_nodes([_row("10.77.0.1", "n1"), _row("10.77.0.2", "n2"), _row("10.77.0.3", "n3")])
    assert not view_settled(nodes, LOST)


@pytest.mark.parametrize(
    "rows",
    [
        [_row("10.77.0.1", "n1"), _row("10.77.0.2", "n2"), _row("10.77.0.3", "n3", alive=False)],  # marked dead
        [_row("10.77.0.1", "n1"), _row("10.77.0.2", "n2")],  # gone from the table
        [_row("10.77.0.1", "n1"), _row("10.77.0.3", "n9")],  # its raylet came back under a new id
    ],
)
def test_view_settled_once_the_lost_node_is_dead_or_gone(rows):
    assert view_settled(ray_api.parse_nodes(rows), LOST)


def test_eligible_nodes_never_include_the_lost_node():
    rows = [
        _row("10.77.0.1", "n1"),
        _row("10.77.0.2", "n2"),
        _row("10.77.0.3", "n3"),  # n3: not yet marked
        _row("10.77.0.4", "n4", cpus=0.0),
    ]  # no CPU to spare
    chosen = eligible_nodes(ray_api.parse_nodes(rows), LOST)
    assert [n.ip for n in chosen] == ["10.77.0.1", "10.77.0.2"]


def test_a_replacement_node_at_the_lost_ip_is_used_once_the_lost_id_is_marked_dead():
    # w2's raylet restarted (a new id, n7) before Ray marked the old one (n3) dead: that IP is the stale view
    stale = [_row("10.77.0.1", "n1"), _row("10.77.0.2", "n2"), _row("10.77.0.3", "n3"), _row("10.77.0.3", "n7")]
    assert [n.node_id for n in eligible_nodes(ray_api.parse_nodes(stale), LOST)] == ["n1", "n2"]
    settled = [_row("10.77.0.1", "n1"), _row("10.77.0.2", "n2"), _row("10.77.0.3", "n3", alive=False), _row("10.77.0.3", "n7")]
    assert [n.node_id for n in eligible_nodes(ray_api.parse_nodes(settled), LOST)] == ["n1", "n2", "n7"]


def test_a_node_whose_process_died_but_that_answers_is_used_again():
    rows = [_row("10.77.0.1", "n1"), _row("10.77.0.2", "n2"), _row("10.77.0.3", "n3")]
    chosen = eligible_nodes(ray_api.parse_nodes(rows), LOST, healthy_ids={"n3"})
    assert [n.node_id for n in chosen] == ["n1", "n2", "n3"]


# ============================================================================ unit: the shrunk mesh
def test_batch_that_divides_the_shrunk_data_axis_passes():
    assert check_batch_divides(96, 2, 2, "data", before=3) == 4
    assert check_batch_divides(96, 2, 4, "tensor", model_parallel=2) == 4


def test_batch_that_does_not_divide_the_shrunk_data_axis_names_the_sizes():
    with pytest.raises(KitError) as err:
        check_batch_divides(36, 4, 2, "data", before=3)  # 3 x 2 = 6 divided 36; 4 x 2 = 8 does not
    msg = str(err.value)
    assert "\n" not in msg
    assert "batch size 36 is not divisible by the data-parallel size 8" in msg and "4 process(es)" in msg
    assert "was 3 process(es)" in msg and "e.g. 72" in msg


# ============================================================================ unit: the final trajectory
def test_trajectory_counts_each_step_once():
    epoch = plan_epoch(1000, 96, "drop")  # 10 full batches, 40 dropped per epoch
    # run from 0; the last attempt resumed from step 20 and ran 10 steps (20 -> 30)
    steps, seen, dropped = trajectory_counts(10, 10 * 96, 0, run_start=0, resumed_from=20, epoch=epoch, batch_size=96)
    assert steps == 30 and seen == 30 * 96 and dropped == 40 * 2  # epochs 1 and 2 ran to their end
    pad = plan_epoch(1000, 96, "pad")  # 11 steps: the 11th holds 40 real samples
    assert samples_in_steps(pad.steps, pad.full_batches, pad.remainder, "pad", 96, 0, 11) == (1000, 0)


# ============================================================================ unit: --out shared / checkpoints
def test_shared_out_probe_passes_on_one_directory(tmp_path):
    token = "t1"
    for i in range(3):
        shared_out.write_probe(str(tmp_path), token, i, "h%d" % i)
    seen = {i: shared_out.missing_probes(str(tmp_path), token, 3) for i in range(3)}
    shared_out.check_shared(str(tmp_path), seen, ["h0", "h1", "h2"])  # no error
    shared_out.remove_probes(str(tmp_path), token)
    assert not os.path.exists(tmp_path / shared_out.PROBE_DIR)


def test_non_shared_out_names_the_host(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"  # process 2 writes into a folder the others do not see
    for i in (0, 1):
        shared_out.write_probe(str(a), "t", i, "h%d" % i)
    shared_out.write_probe(str(b), "t", 2, "w2")
    seen = {
        0: shared_out.missing_probes(str(a), "t", 3),
        1: shared_out.missing_probes(str(a), "t", 3),
        2: shared_out.missing_probes(str(b), "t", 3),
    }
    with pytest.raises(KitError, match=r"not one shared directory: on host w2 \(process 2\)"):
        shared_out.check_shared("/x", seen, ["head", "w1", "w2"])


def test_a_save_killed_midway_never_counts_as_the_latest_checkpoint(tmp_path):
    """orbax writes <step>.orbax-checkpoint-tmp-<n> and renames it when complete: the leftover of a
    kill mid-save is ignored by the driver's reader and by orbax itself; the previous step restores."""
    pytest.importorskip("orbax.checkpoint")
    import numpy as np

    from alpa_job.train.checkpoint import Checkpointer

    ck = Checkpointer(str(tmp_path / "checkpoints"), every=10)
    state = {"w": np.arange(4.0)}
    assert ck.maybe_save(10, state)
    ck.close()
    (tmp_path / "checkpoints" / "20.orbax-checkpoint-tmp-1700000000").mkdir()  # the killed save of step 20
    assert latest_complete_step(str(tmp_path / "checkpoints")) == 10
    again = Checkpointer(str(tmp_path / "checkpoints"), every=10)
    assert again.latest_step() == 10
    restored, _data = again.restore({"w": np.zeros(4)})
    assert np.array_equal(np.asarray(restored["w"]), np.arange(4.0))
    again.close()
    assert latest_complete_step(str(tmp_path / "missing")) is None


def test_failure_policy_from_the_restart_flags_decides_from_what_was_seen():
    assert FailurePolicy.from_config(tiny_config()) == FailurePolicy(0, 0.0)  # fail fast by default
    policy = FailurePolicy.from_config(tiny_config(max_restarts=2, restart_wait=1.0))

    def decide(restarts, eligible=None, waited=0.0, processes=3):
        decision = policy.decide(PollStatus(LOST, restarts, processes, eligible, waited))
        return decision.action, decision.processes

    assert decide(2) == (FAIL, 0)  # restarts spent: fail at once, before any settling
    assert decide(0) == (WAIT, 0)  # Ray's view of the loss not settled yet
    assert decide(0, eligible=2) == (WAIT, 0)  # a replacement may still join ...
    assert decide(0, eligible=2, waited=1.0) == (RETRY, 2)  # ... not within --restart-wait: the survivors
    assert decide(1, eligible=4) == (RETRY, 3)  # never more processes than the attempt that failed
    assert decide(1, eligible=0, waited=1.0) == (FAIL, 0)
    assert "no restart left (--max-restarts 0)" in FailurePolicy().decide(PollStatus(LOST, 0, 3)).reason
    assert FailurePolicy(1, 0.0).decide(PollStatus(LOST, 0, 3, 1)).action == RETRY  # no wait asked: go on


def test_a_restart_record_is_typed_from_the_loss_to_the_first_step():
    from alpa_job.launch.failures import GroupLost, Slot
    from alpa_job.launch.recovery import Recovery
    from alpa_job.record.run_record import RestartRecord

    slot = Slot(index=2, ip="10.77.0.3", host="w2", node_id="n3")
    failed = GroupLost([slot.lost(68, "actor died")], {2: slot}, detected=100.0, wall="2024-01-01T00:00:00.000+00:00")
    failed.run_step = 70
    recovery = Recovery.after(failed)
    assert isinstance(recovery.record, RestartRecord)
    assert (recovery.record.host, recovery.record.process, recovery.record.failed_at_step) == ("w2", 2, 70)
    recovery.resumed(60, processes=2)
    recovery.recovered(112.5)
    r = recovery.record
    assert (r.resumed_from_step, r.processes_after, r.steps_lost, r.recover_seconds) == (60, 2, 10, 12.5)


def test_cli_takes_max_restarts_and_restart_wait():
    from alpa_job.settings.config import JobConfig

    assert JobConfig().max_restarts == 0  # today's fail-fast stays the default
    with pytest.raises(KitError, match="--max-restarts must be >= 0"):
        JobConfig(max_restarts=-1).validated()
    with pytest.raises(KitError, match="--restart-wait must be >= 0"):
        JobConfig(restart_wait=-2.0).validated()


# ============================================================================ test bed: real host kills
KILL_AFTER_CHECKPOINT = 20


def kill_host(bed, name: str) -> float:
    """SIGKILL the host's PID 1 (tini): its PID namespace dies with it, every process of the host with it
    (raylet, object store, the JAX process); its network namespace stays, nothing answers there.
    Returns the wall-clock time of the kill."""
    pid = bed.host(name).pid
    assert pid, f"host {name} has no PID 1 recorded"
    t = time.time()
    os.kill(pid, signal.SIGKILL)
    return t


# A user's model (the LLaMA example package, imported from its folder on PYTHONPATH on every host).
LLAMA = (
    "--model",
    "llama_example.model:build",
    "--model-arg",
    "num_layers=6",
    "--model-arg",
    "d_model=32",
    "--model-arg",
    "num_heads=4",
    "--model-arg",
    "num_kv_heads=2",
    "--model-arg",
    "seq_len=16",
    "--model-arg",
    "vocab_size=64",
)
# As many micro-batches as the most stages here (3): the schedule's loops are unrolled, so the default (4 a
# stage) compiles a program 3x as long on each attempt; which stages run where does not depend on it.
PIPELINE = ("--strategy", "pipeline", "--micro-batches", "3")
REPO = Path(__file__).resolve().parent.parent
LLAMA_PATH = os.pathsep.join([str(REPO), str(REPO / "examples" / "llama")])


def _run_and_kill(cluster, out: Path, victim: str, *extra: str, timeout: float = 420, kill=None, model=MLP, env=None):
    """Train from the head; kill `victim` once checkpoint KILL_AFTER_CHECKPOINT is complete.
    Returns (rc, stdout, stderr, kill wall time, seconds from the kill to the driver's exit)."""
    bed = cluster.testbed
    log = open(out.parent / (out.name + ".driver.log"), "w+")
    p = bed.popen(
        "head",
        *_train_argv(cluster, str(out), *extra, model=model),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={"RAY_ADDRESS": cluster.address, **(env or {})},
    )
    deadline = time.monotonic() + timeout
    killed_at = None
    try:
        while p.poll() is None and time.monotonic() < deadline:
            if killed_at is None and (latest_complete_step(str(out / "checkpoints")) or 0) >= KILL_AFTER_CHECKPOINT:
                killed_at = (kill or kill_host)(bed, victim)
            time.sleep(0.05)
        if p.poll() is None:
            p.kill()
            pytest.fail(f"the job did not end within {timeout} s")
    finally:
        ended = time.time()
        log.seek(0)
        text = log.read()
        log.close()
    assert killed_at is not None, f"the job ended before checkpoint {KILL_AFTER_CHECKPOINT} (rc {p.returncode}):\n{text[-4000:]}"
    return p.returncode, text, killed_at, ended - killed_at


@pytest.mark.slow
@pytest.mark.testbed
def test_worker_host_killed_job_restarts_on_the_survivors(testbed_factory):
    # A user's model (the LLaMA example package, found on every host through the job's Python path),
    # pipelined: its 6 blocks run as 3 stages, one a host. --max-restarts knows nothing of the model: the
    # restart re-plans them as 2 stages on the 2 survivors, from the checkpoint the 3 stages saved, and every
    # process reads its share of the one batch order before and after.
    cluster = _cluster(testbed_factory)
    out = _out("restart")
    (out / "trace").mkdir()
    rc, text, killed_at, _ = _run_and_kill(
        cluster,
        out,
        "w2",
        "--max-restarts",
        "1",
        *PIPELINE,
        model=LLAMA,
        env={"PYTHONPATH": LLAMA_PATH, "ALPA_JOB_INPUT_TRACE": str(out / "trace")},
    )
    assert rc == 0, text[-5000:]
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["model"] == "llama_example.model:build"
    _every_host_read_its_share_of_one_order(out / "trace", report)
    assert report["steps"] == STEPS  # the final trajectory, each step once
    assert report["samples_seen"] == STEPS * BATCH
    assert report["summary"]["processes"] == 2 and report["summary"]["hosts"] == 2
    assert sorted(p["host"] for p in report["processes"]) == ["head", "w1"]
    (r,) = report["restarts"]
    assert r["host"] == "w2" and r["ip"] == cluster.node_ips["w2"] and r["process"] == 2 and r["node_id"]
    assert r["resumed_from_step"] >= KILL_AFTER_CHECKPOINT and r["resumed_from_step"] % EVERY == 0
    assert 0 <= r["steps_lost"] <= EVERY, r  # at most one checkpoint interval
    assert r["processes_after"] == 2 and r["recover_seconds"] and r["recover_seconds"] > 0
    assert "lost JAX process 2 on host w2" in text
    assert report["mesh"]["shape"] == [2, 2] and [row["blocks"] for row in report["pipeline"]["layers"]] == [
        ["layer_0", "layer_1", "layer_2"],
        ["layer_3", "layer_4", "layer_5"],
    ]
    _SAVED_ON_TWO_HOSTS.append(out)  # test_resume_on_more_hosts_than_saved continues it on 3


_SAVED_ON_TWO_HOSTS: list = []


def _every_host_read_its_share_of_one_order(trace: Path, report: dict) -> None:
    """The batches after a restart on 2 of 3 hosts are those of an uninterrupted run: every process, before
    and after the loss, read exactly its slice of the global batch the seed and the step fix."""
    from alpa_job.data.batching import epoch_order

    rows, per_epoch = report["input"]["rows"], report["input"]["steps_per_epoch"]
    seen = [json.loads(line) for f in trace.iterdir() for line in f.read_text().splitlines()]
    counts = {}
    for entry in seen:
        step, share = entry["step"], BATCH // entry["count"]
        b = step % per_epoch
        expected = epoch_order(rows, 0, step // per_epoch)[b * BATCH : (b + 1) * BATCH]
        lo = entry["process"] * share
        assert entry["rows"] == expected[lo : lo + share].tolist(), entry
        counts.setdefault(entry["count"], set()).add(step)
    (r,) = report["restarts"]
    assert set(range(r["resumed_from_step"], STEPS)) <= counts[2]  # the survivors read the rest of the run
    assert set(range(1, KILL_AFTER_CHECKPOINT)) <= counts[3]
    hosts_after = {e["host"] for e in seen if e["count"] == 2}
    assert hosts_after == {"head", "w1"}


@pytest.mark.slow
@pytest.mark.testbed
def test_worker_host_killed_without_restarts_fails_fast_naming_the_host(testbed_factory):
    cluster = _cluster(testbed_factory)
    out = _out("failfast")
    rc, text, killed_at, seconds = _run_and_kill(cluster, out, "w2")
    assert rc != 0
    assert seconds < 15, f"the job took {seconds:.1f} s after the kill to fail:\n{text[-3000:]}"
    line = [x for x in text.splitlines() if "JAX process 2 on host w2" in x and "died" in x]
    assert line, text[-4000:]
    assert cluster.node_ips["w2"] in line[-1] and "Ray node id" in line[-1] and re.search(r"at step \d+", line[-1])
    assert "Traceback" not in text

    # --resume right away (issue 12 item 4): Ray may still list w2 as alive; the job waits for the settled
    # view, never places a process on w2, and continues on the 2 survivors from the last checkpoint.
    bed = cluster.testbed
    p = bed.exec(
        "head",
        *_train_argv(cluster, str(out), "--resume", steps=KILL_AFTER_CHECKPOINT + 20),
        timeout=400,
        check=False,
        env={"RAY_ADDRESS": cluster.address},
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    report = json.loads((out / "report.json").read_text())
    assert sorted(x["host"] for x in report["processes"]) == ["head", "w1"]
    assert report["resumed_from_step"] >= KILL_AFTER_CHECKPOINT and report["restarts"] == []
    assert "Traceback" not in p.stdout + p.stderr
    shutil.rmtree(out, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.testbed
def test_resume_on_more_hosts_than_saved(testbed_factory):
    """The restart test's run ended on 2 hosts (2 stages); the bed is whole again (3 hosts): --resume re-plans
    the stages onto the 3 hosts' 6 devices."""
    if not _SAVED_ON_TWO_HOSTS:
        pytest.skip("needs test_worker_host_killed_job_restarts_on_the_survivors's run directory")
    cluster = _cluster(testbed_factory)
    out = _SAVED_ON_TWO_HOSTS[0]
    assert latest_complete_step(str(out / "checkpoints")) == STEPS
    argv = _train_argv(cluster, str(out), "--resume", *PIPELINE, steps=STEPS + 10, model=LLAMA)
    p = cluster.testbed.exec("head", *argv, timeout=400, check=False, env={"RAY_ADDRESS": cluster.address, "PYTHONPATH": LLAMA_PATH})
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    report = json.loads((out / "report.json").read_text())
    assert report["summary"]["hosts"] == 3 and report["summary"]["devices"] == 6
    assert report["mesh"]["shape"] == [3, 2] and len(report["pipeline"]["layers"]) == 3
    assert report["resumed_from_step"] == STEPS and report["steps"] == 10
    assert latest_complete_step(str(out / "checkpoints")) == STEPS + 10
    shutil.rmtree(out, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.testbed
def test_non_shared_out_is_refused_before_training(testbed_factory):
    cluster = _cluster(testbed_factory)
    bed = cluster.testbed
    out = _out("private")
    # w2 has its own mount namespace: a tmpfs over --out there is a folder only w2 sees.
    bed.exec("w2", "mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(out))
    try:
        t0 = time.monotonic()
        p = bed.exec("head", *_train_argv(cluster, str(out)), timeout=300, check=False, env={"RAY_ADDRESS": cluster.address})
        seconds = time.monotonic() - t0
    finally:
        bed.exec("w2", "umount", str(out), check=False)
    assert p.returncode != 0
    err = [x for x in (p.stdout + p.stderr).splitlines() if "not one shared directory" in x]
    assert err and "host w2 (process 2)" in err[-1] and str(out) in err[-1], p.stderr[-3000:]
    assert "compiling train step" not in p.stdout + p.stderr  # refused before any training
    assert not (out / "checkpoints").exists() or latest_complete_step(str(out / "checkpoints")) is None
    assert seconds < 120
    shutil.rmtree(out, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.testbed
def test_process_killed_on_a_live_node_is_named_with_its_log_and_the_node_is_used_again(testbed_factory):
    """Only the JAX process dies (SIGKILL inside w1), its node stays: the failure shows the last lines of
    that process's log (Ray's log API still serves them), and the restart uses all 3 nodes again."""
    cluster = _cluster(testbed_factory)
    bed = cluster.testbed
    out = _out("proc")

    def kill_jax_process_on_w1(_bed, _name):
        pids = bed.exec("w1", "pgrep", "-f", "^ray::JaxProcess").stdout.split()
        assert pids, "no JAX process found on w1"
        t = time.time()
        for pid in pids:  # inside w1's PID namespace: only w1's JAX process matches
            bed.exec("w1", "kill", "-9", pid, check=False)
        return t

    rc, text, _, _ = _run_and_kill(cluster, out, "w1", "--max-restarts", "1", kill=kill_jax_process_on_w1)
    assert rc == 0, text[-5000:]
    report = json.loads((out / "report.json").read_text())
    (r,) = report["restarts"]
    assert r["host"] == "w1" and r["process"] == 1 and r["processes_after"] == 3
    assert report["summary"]["hosts"] == 3 and report["steps"] == STEPS
    assert "last " in text and "lines of process 1's log (host w1" in text, text[-4000:]
    shutil.rmtree(out, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.testbed
def test_resume_after_the_heads_ray_restarts(testbed_factory):
    """Head loss (README: "Losing the head"): the driver, the GCS and process 0 go with it, so the job ends.
    Here the head's Ray is stopped mid-run (with the driver, which runs on the head), Ray is started again on
    every host (what `python -m alpa_job cluster up` / `ray start` does at a site), and the same command with
    --resume continues from the last complete checkpoint on all 3 hosts."""
    from fixtures_testbed import RAY_NUM_CPUS, RAY_OBJECT_STORE, RAY_FORM_TIMEOUT
    from kit_testbed import ray_layer as testbed_ray

    cluster = _cluster(testbed_factory)
    bed = cluster.testbed
    out = _out("head")

    def stop_heads_ray(_bed, _name):
        t = time.time()
        bed.exec("head", "ray", "stop", "--force", timeout=120, check=False)  # inside the head host only
        return t

    log = open(out.parent / (out.name + ".driver.log"), "w+")
    p = bed.popen("head", *_train_argv(cluster, str(out)), stdout=log, stderr=subprocess.STDOUT, env={"RAY_ADDRESS": cluster.address})
    deadline = time.monotonic() + 400
    try:
        while (latest_complete_step(str(out / "checkpoints")) or 0) < KILL_AFTER_CHECKPOINT:
            assert p.poll() is None and time.monotonic() < deadline, "the job ended before its checkpoint"
            time.sleep(0.05)
        stop_heads_ray(bed, "head")
    finally:
        if p.poll() is None:
            p.kill()  # the driver runs on the head: a lost head takes it along
        p.wait(timeout=30)
        log.close()
    saved = latest_complete_step(str(out / "checkpoints"))
    assert saved is not None and saved >= KILL_AFTER_CHECKPOINT

    # Ray again on every host (the workers' raylets are gone with the GCS, or stopped here), then resubmit.
    for host in bed.ips:
        bed.exec(host, "ray", "stop", "--force", timeout=120, check=False)
    bed.ray = None
    testbed_ray.start_ray(
        bed,
        num_cpus=RAY_NUM_CPUS,
        object_store_memory=RAY_OBJECT_STORE,
        include_dashboard=True,
        timeout=RAY_FORM_TIMEOUT,
        ray_env=FAST_DEATH,
    )
    p2 = bed.exec(
        "head",
        *_train_argv(cluster, str(out), "--resume", steps=saved + 10),
        timeout=400,
        check=False,
        env={"RAY_ADDRESS": cluster.address},
    )
    assert p2.returncode == 0, (p2.stdout + p2.stderr)[-5000:]
    report = json.loads((out / "report.json").read_text())
    assert report["resumed_from_step"] == saved and report["steps"] == 10 and report["summary"]["hosts"] == 3
    shutil.rmtree(out, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.testbed
def test_a_replacement_node_joining_within_restart_wait_is_used(testbed_factory):
    """w2's Ray is stopped mid-run (its raylet and JAX process die; Ray marks the node dead) and started
    again a few seconds later: a NEW node id at the lost IP. With --restart-wait the restart waits for it and
    runs on 3 hosts again (the stale id is never used, the replacement is)."""
    import threading

    from alpa_job.cluster.ray_start import ray_start_args
    from fixtures_testbed import RAY_NUM_CPUS, RAY_OBJECT_STORE

    cluster = _cluster(testbed_factory)
    bed = cluster.testbed
    out = _out("replace")

    def restart_w2_ray(_bed, _name):
        t = time.time()
        bed.exec("w2", "ray", "stop", "--force", timeout=120, check=False)  # inside w2 only

        def start_again():
            argv = ray_start_args(
                cluster.spec,
                "worker",
                cluster.node_ips["w2"],
                head_ip=cluster.head_ip,
                num_cpus=RAY_NUM_CPUS,
                object_store_memory=RAY_OBJECT_STORE,
            )
            bed.exec("w2", *argv, timeout=180, check=False)

        threading.Thread(target=start_again, daemon=True).start()
        return t

    rc, text, _, _ = _run_and_kill(cluster, out, "w2", "--max-restarts", "1", "--restart-wait", "150", kill=restart_w2_ray, timeout=600)
    assert rc == 0, text[-5000:]
    report = json.loads((out / "report.json").read_text())
    (r,) = report["restarts"]
    assert r["host"] == "w2" and r["processes_after"] == 3, r
    assert report["summary"]["hosts"] == 3 and report["steps"] == STEPS
    assert sorted(p["host"] for p in report["processes"]) == ["head", "w1", "w2"]
    shutil.rmtree(out, ignore_errors=True)
