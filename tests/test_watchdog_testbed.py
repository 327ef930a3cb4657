"""Never hang, on the 3-host test bed (real hosts, tests/test_node_loss.py's cluster): a JAX process
SIGSTOPped on w1 is named by the watchdog (--hang-timeout), the job restarts from the last checkpoint on all
3 hosts (the stopped actor is killed) and trains on; stopped again with no restart left, it fails within
--hang-timeout plus a few seconds naming it. The CPU part and the local-Ray case: tests/test_watchdog.py.
"""

from __future__ import annotations

import json
from typing import Optional

import pytest

from helpers_watchdog import _stop_and_wait


@pytest.mark.slow
@pytest.mark.testbed
def test_a_stopped_process_on_the_test_bed_is_named_the_job_restarts_then_fails_when_it_hangs_again(testbed_factory):
    """SIGSTOP w1's JAX process (inside w1's PID namespace) after checkpoint 20: with --max-restarts 1 the
    job names it, kills every actor (the stopped one too: Ray's kill does not need its cooperation) and
    restarts from the last checkpoint on all 3 hosts (w1's node still answers). The restarted run trains on
    and saves again; then its own process on w1 is stopped: with no restart left the job fails within
    --hang-timeout plus a few seconds, naming w1's process as hung."""
    import shutil

    from helpers_node_loss import EVERY, _cluster, _out, _train_argv

    # Under JAX's 30 s heartbeat, so the watchdog, not the heartbeat, ends the job (both name w1); still
    # dozens of times the gaps between steps and saves of this job on a loaded machine.
    hang = 12
    cluster = _cluster(testbed_factory)
    bed = cluster.testbed
    out = _out("hang")

    def find_victim(exclude=()) -> Optional[str]:  # None while w1 runs no JAX process but stopped ones
        pids = [pid for pid in bed.exec("w1", "pgrep", "-f", "^ray::JaxProcess").stdout.split() if pid not in exclude]
        assert len(pids) <= 1, pids  # inside w1's PID namespace: only w1's JAX process matches
        return pids[0] if pids else None

    def signal_in_w1(name):
        return lambda pid: bed.exec("w1", "kill", "-" + name, pid, check=False).returncode == 0

    # 60 steps: the second stop, after the restarted run's first checkpoint, still finds 20 steps to stop in.
    argv = _train_argv(cluster, str(out), "--hang-timeout", str(hang), "--max-restarts", "1", steps=60)
    rc, text, seconds, victims, gone = _stop_and_wait(
        argv,
        out,
        find_victim,
        signal_in_w1("STOP"),
        signal_in_w1("CONT"),
        signal_in_w1("0"),
        timeout=500,
        again_after_steps=EVERY,
        popen=lambda a, **kw: bed.popen("head", *a, env={"RAY_ADDRESS": cluster.address}, **kw),
    )
    assert "Traceback" not in text, text[-5000:]
    named = [x for x in text.splitlines() if "JAX process 1 on host w1" in x and "hung" in x]
    assert len(named) >= 2 and all(cluster.node_ips["w1"] in x and "stopped, frozen" in x for x in named), text[-5000:]
    assert gone, f"a stopped JAX process (pids {victims} in w1) outlived the job's teardown"
    report = json.loads((out / "report.json").read_text())
    (r,) = report["restarts"]  # the first hang: restarted on all 3 hosts from its last checkpoint
    assert r["host"] == "w1" and r["process"] == 1 and r["reason"].startswith("hung:")
    assert r["resumed_from_step"] >= 20 and r["resumed_from_step"] % EVERY == 0 and r["processes_after"] == 3
    # the second: no restart left, so the job fails within --hang-timeout plus a few seconds
    assert rc == 1, text[-5000:]
    assert seconds < hang + 20, f"{seconds:.0f} s from the second stop to the exit:\n{text[-3000:]}"
    assert report["status"] == "failed" and "hung at step" in report["error"]
    assert named[-1].startswith("error: ")
    shutil.rmtree(out, ignore_errors=True)
