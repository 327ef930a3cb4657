"""Preemption on the 3-host test bed (3 hosts x 2 devices, one JAX process per host): SIGTERM to the driver
stops every process at one agreed step with a checkpoint there, the report says `preempted`, exit 75, and the
same command with `--resume auto` continues with the losses of a run that was never stopped.

Two ways the signal comes: straight to the driver (what `systemctl stop`, `timeout` or a pod eviction send),
and `ray job stop` on a `ray job submit`ted run, with RAY_JOB_STOP_WAIT_TIME_S in the job's env_vars (Ray's
job supervisor reads it from its own environment, which the job's runtime_env sets; its default, 3 s, is
too short for a step and a save on this bed: the driver is SIGKILLed).

The bed is test_node_loss.py's (one 3-host Ray cluster shared by the test-bed tests of a session); the
uninterrupted reference run is trained once per session on it: CPU XLA on the same devices and the same
process layout gives the same losses bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from alpa_job.errors import EXIT_PREEMPTED
from alpa_job.train.checkpoint import latest_complete_step
from helpers_report import assert_valid_report
from helpers_node_loss import _cluster

pytestmark = [pytest.mark.slow, pytest.mark.testbed]

STEPS = 40
SIGNAL_AFTER = 8  # the step the driver has seen before SIGTERM: mid-run, with a compiled step behind it
BATCH = 96  # divides 3 hosts x 2 devices
# No --checkpoint-every multiple is reached: the checkpoint the resume uses is the preemption's own save.
# The MLP is node loss's (helpers_node_loss.MLP: steps of about a tenth of a second, so a stop sent through
# `ray job stop` still lands seconds before the last step).
ARGS = (
    "--model",
    "mlp",
    "--hidden-dim",
    "256",
    "--devices",
    "2",
    "--batch-size",
    str(BATCH),
    "--checkpoint-every",
    "1000",
    "--progress-every",
    "1",
    "--resume",
    "auto",
)
STEP_LINE = re.compile(r"\[train\] step (\d+)/")
RUN_TIMEOUT = 300


def _argv(cluster, out: Path, steps: int = STEPS):
    return [
        "python",
        "-m",
        "alpa_job",
        "train",
        *ARGS,
        "--steps",
        str(steps),
        "--address",
        cluster.address,
        "--cluster-spec",
        str(cluster.spec_path),
        "--out",
        str(out),
    ]


def _out(name: str) -> Path:
    # /tmp outside /tmp/ray is the machine's /tmp, the same folder on every test-bed host: a shared --out.
    path = Path("/tmp") / ("aktg-preempt-%s-%s" % (name, uuid.uuid4().hex[:8]))
    path.mkdir()
    return path


def _report(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text())
    assert_valid_report(report)
    return report


_REFERENCE: dict = {}


def _reference_losses(cluster) -> list:
    """The losses of the same run never stopped (trained once per session)."""
    if "losses" not in _REFERENCE:
        out = _out("reference")
        p = cluster.testbed.exec("head", *_argv(cluster, out), timeout=RUN_TIMEOUT, check=False, env={"RAY_ADDRESS": cluster.address})
        assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
        report = _report(out)
        assert report["status"] == "ok" and report["steps"] == STEPS and report["summary"]["hosts"] == 3
        _REFERENCE["losses"] = report["losses"]
        shutil.rmtree(out, ignore_errors=True)
    return _REFERENCE["losses"]


def _step_seen(out: Path) -> int:
    """The furthest step the driver logged (train.log is written line by line)."""
    try:
        text = (out / "train.log").read_text()
    except FileNotFoundError:
        return 0
    return max((int(m) for m in STEP_LINE.findall(text)), default=0)


def _wait_for_step(out: Path, alive, timeout: float = RUN_TIMEOUT, every: float = 0.05) -> int:
    """The step seen once it is SIGNAL_AFTER or more; `alive()` (asked every `every` s) false: the run ended."""
    deadline = time.monotonic() + timeout
    asked = 0.0
    while time.monotonic() < deadline:
        seen = _step_seen(out)
        if seen >= SIGNAL_AFTER:
            return seen
        if time.monotonic() - asked >= every:
            assert alive(), f"the run ended before step {SIGNAL_AFTER}:\n{_tail(out)}"
            asked = time.monotonic()
        time.sleep(0.05)
    pytest.fail(f"step {SIGNAL_AFTER} not reached within {timeout} s:\n{_tail(out)}")


def _tail(out: Path) -> str:
    try:
        return (out / "train.log").read_text()[-4000:]
    except FileNotFoundError:
        return "(no train.log)"


def _driver_pid(launcher: subprocess.Popen) -> int:
    """The driver's PID as this machine sees it: bed.popen starts nsenter, which forks the command (env,
    then python) into the host's PID namespace; a signal to nsenter would not reach it."""
    import psutil

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                cmd = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            if cmd[1:4] == ["-m", "alpa_job", "train"]:
                return child.pid
        time.sleep(0.1)
    raise AssertionError("the driver process under nsenter was not found")


def _assert_preempted(out: Path, reference: list, seen: int) -> int:
    """Status preempted at one step S that every process stopped at, checkpoint S complete; returns S."""
    report = _report(out)
    stop = report["stopped_at_step"]
    assert report["status"] == "preempted" and stop is not None, report.get("error")
    assert seen <= stop < STEPS and report["steps"] == stop
    assert f"at step {stop}" in report["error"] and "--resume auto" in report["error"]
    # Every process's own step: none trained past S (their collectives, and the save, would have waited).
    procs = sorted(report["processes"], key=lambda x: x["id"])
    assert [x["id"] for x in procs] == [0, 1, 2] and sorted(x["host"] for x in procs) == ["head", "w1", "w2"]
    assert [x["stopped_at_step"] for x in procs] == [stop] * 3, procs
    assert latest_complete_step(str(out / "checkpoints")) == stop  # not a multiple of --checkpoint-every
    assert sorted(int(d.name) for d in (out / "checkpoints").iterdir() if d.name.isdigit()) == [stop]
    assert report["losses"] == reference[:stop]
    return stop


def _assert_resumes(cluster, out: Path, stop: int, reference: list) -> None:
    """The same command again continues from S to the end, with the uninterrupted run's losses."""
    p = cluster.testbed.exec("head", *_argv(cluster, out), timeout=RUN_TIMEOUT, check=False, env={"RAY_ADDRESS": cluster.address})
    assert p.returncode == 0, (p.stdout + p.stderr)[-5000:]
    report = _report(out)
    assert report["status"] == "ok" and report["resumed_from_step"] == stop and report["stopped_at_step"] is None
    assert report["steps"] == STEPS - stop and report["summary"]["hosts"] == 3
    assert report["losses"] == reference[stop:]


def test_sigterm_to_the_driver_stops_every_host_at_one_step_and_resume_auto_continues(testbed_factory):
    cluster = _cluster(testbed_factory)
    reference = _reference_losses(cluster)
    out = _out("sigterm")
    log = open(out.parent / (out.name + ".driver.log"), "w+")
    p = cluster.testbed.popen("head", *_argv(cluster, out), stdout=log, stderr=subprocess.STDOUT, env={"RAY_ADDRESS": cluster.address})
    try:
        driver = _driver_pid(p)
        seen = _wait_for_step(out, lambda: p.poll() is None)
        signalled = time.monotonic()
        os.kill(driver, signal.SIGTERM)
        rc = p.wait(timeout=120)
        seconds = time.monotonic() - signalled
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=30)
        log.seek(0)
        text = log.read()
        log.close()
    assert rc == EXIT_PREEMPTED == 75, text[-5000:]
    assert "Traceback" not in text
    assert re.search(r"SIGTERM: every JAX process stops after step \d+", text), text[-3000:]
    stop = _assert_preempted(out, reference, seen)
    assert f"preempted (SIGTERM) at step {stop}" in text
    assert seconds < 60, f"{seconds:.1f} s from SIGTERM to the driver's exit"  # a step or two and one save
    _assert_resumes(cluster, out, stop, reference)
    shutil.rmtree(out, ignore_errors=True)
    (out.parent / (out.name + ".driver.log")).unlink(missing_ok=True)


# ----------------------------------------------------------------------------- ray job submit / ray job stop
STOP_WAIT_S = 120  # RAY_JOB_STOP_WAIT_TIME_S: Ray SIGKILLs the driver this long after SIGTERM


def _jobs(cluster, *argv, timeout: float = 120):
    """`ray job ...` on the head against the dashboard's job API."""
    address = "http://%s:%d" % (cluster.head_ip, cluster.spec.ports["dashboard"])
    return cluster.testbed.exec("head", "ray", "job", argv[0], "--address", address, *argv[1:], timeout=timeout, check=False)


def test_ray_job_stop_preempts_a_submitted_run_at_one_step(testbed_factory):
    """`ray job stop`: Ray's job supervisor sends SIGTERM to the driver (and its children), waits
    RAY_JOB_STOP_WAIT_TIME_S for them to exit, then SIGKILLs them. With the wait set in the job's env_vars the
    driver stops every host at one step, saves it, writes the `preempted` report and exits; Ray marks the job
    STOPPED. Resubmitting the same command continues from there."""
    cluster = _cluster(testbed_factory)
    reference = _reference_losses(cluster)
    out = _out("jobstop")
    job = "preempt-" + uuid.uuid4().hex[:8]
    env = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S)}})
    submitted = _jobs(cluster, "submit", "--submission-id", job, "--no-wait", "--runtime-env-json", env, "--", *_argv(cluster, out))
    assert submitted.returncode == 0, (submitted.stdout + submitted.stderr)[-3000:]
    try:

        def alive():
            status = _jobs(cluster, "status", job).stdout
            return not any(x in status for x in ("failed", "succeeded", "was stopped"))

        seen = _wait_for_step(out, alive, every=5.0)
        t0 = time.monotonic()
        stopped = _jobs(cluster, "stop", job, timeout=STOP_WAIT_S + 60)
        seconds = time.monotonic() - t0
    finally:
        _jobs(cluster, "stop", "--no-wait", job)  # a no-op once it has stopped
    assert stopped.returncode == 0, (stopped.stdout + stopped.stderr)[-3000:]
    status = _jobs(cluster, "status", job)
    assert f"Job '{job}' was stopped" in status.stdout, status.stdout[-2000:]
    logs = _jobs(cluster, "logs", job).stdout
    stop = _assert_preempted(out, reference, seen)
    assert f"preempted (SIGTERM) at step {stop}" in logs, logs[-3000:]
    assert "Traceback" not in logs
    assert seconds < 60, f"`ray job stop` took {seconds:.1f} s"  # the driver's own exit, not the SIGKILL

    # The restarted job: the same command, submitted again, continues from the preemption's checkpoint.
    again = _jobs(cluster, "submit", "--", *_argv(cluster, out), timeout=RUN_TIMEOUT)
    assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
    report = _report(out)
    assert report["status"] == "ok" and report["resumed_from_step"] == stop
    assert report["losses"] == reference[stop:]
    shutil.rmtree(out, ignore_errors=True)


def test_a_stop_wait_too_short_loses_steps_never_the_run(testbed_factory):
    """RAY_JOB_STOP_WAIT_TIME_S=0: Ray SIGKILLs the driver right after SIGTERM, before any agreement or save
    (the JAX processes, the driver's actors, die with it). What stays is the last complete periodic
    checkpoint (a save cut off midway never counts) and the driver's lock in --out; the job submitted again
    takes the lock over and continues from that checkpoint with the uninterrupted run's losses."""
    cluster = _cluster(testbed_factory)
    reference = _reference_losses(cluster)
    out = _out("killed")
    job = "preempt-" + uuid.uuid4().hex[:8]
    argv = _argv(cluster, out) + ["--checkpoint-every", "5"]  # the last flag wins: periodic saves this time
    env = json.dumps({"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "0"}})
    submitted = _jobs(cluster, "submit", "--submission-id", job, "--no-wait", "--runtime-env-json", env, "--", *argv)
    assert submitted.returncode == 0, (submitted.stdout + submitted.stderr)[-3000:]
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while (latest_complete_step(str(out / "checkpoints")) or 0) < 5:
            assert time.monotonic() < deadline, f"no checkpoint 5 within {RUN_TIMEOUT} s:\n{_tail(out)}"
            time.sleep(0.05)
        stopped = _jobs(cluster, "stop", job, timeout=120)
    finally:
        _jobs(cluster, "stop", "--no-wait", job)
    assert stopped.returncode == 0 and f"Job '{job}' was stopped" in stopped.stdout, stopped.stdout[-2000:]
    assert not (out / "report.json").exists()  # SIGKILLed: no report, no preemption save
    assert "preempted (SIGTERM)" not in _jobs(cluster, "logs", job).stdout
    saved = latest_complete_step(str(out / "checkpoints"))
    assert saved is not None and saved % 5 == 0 and (out / ".alpa_job.lock").exists()

    again = _jobs(cluster, "submit", "--", *argv, timeout=RUN_TIMEOUT)
    assert again.returncode == 0, (again.stdout + again.stderr)[-5000:]
    assert "took over the lock of a run that is gone" in again.stdout
    report = _report(out)
    assert report["status"] == "ok" and report["resumed_from_step"] == saved and report["steps"] == STEPS - saved
    assert report["losses"] == reference[saved:]
    shutil.rmtree(out, ignore_errors=True)
