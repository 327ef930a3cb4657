"""Never hang: every ending is bounded, and a process that is alive but silent is found (--hang-timeout).

CPU part: the exit deadline ends a process whose non-daemon thread never ends; a checkpoint save that
cannot finish (orbax's threads then wait for a signal that never comes: the exit used to wait with them)
no longer holds the exit, and is named by its step; the --hang-timeout setting.

Slow part: a JAX process SIGSTOPped on a local Ray (one node) is named by the watchdog. The same on the
3-host test bed: tests/test_watchdog_testbed.py (a module of its own, so that this one stays out of the
suite's test-bed lane).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from alpa_job.cli import main
from alpa_job.cpu_devices import with_device_count
from alpa_job.errors import KitError
from alpa_job.settings.config import JobConfig
from helpers_watchdog import _stop_and_wait

REPO = Path(__file__).resolve().parent.parent


def _python(code: str, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=with_device_count(2), JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, cwd=str(cwd), env=env
    )


# ============================================================================ CPU: bounded exits
def test_the_exit_deadline_ends_a_process_held_by_a_thread_that_never_ends(tmp_path):
    t0 = time.monotonic()
    p = _python(
        """
        import threading
        from alpa_job.shutdown import exit_within
        threading.Thread(target=threading.Event().wait, name="waits-forever").start()  # non-daemon
        exit_within(3, deadline_s=1.0)
    """,
        timeout=60,
        cwd=tmp_path,
    )
    assert p.returncode == 3, p.stderr
    assert time.monotonic() - t0 < 30
    lines = [x for x in p.stderr.splitlines() if "exiting without waiting" in x]
    assert lines and "waits-forever" in lines[0] and "exit code 3" in lines[0], p.stderr


def test_a_healthy_exit_is_not_cut_short(tmp_path):
    p = _python(
        """
        import atexit, threading, time
        from alpa_job.shutdown import exit_within
        threading.Thread(target=time.sleep, args=(0.5,), name="short").start()
        atexit.register(lambda: print("atexit ran", flush=True))
        exit_within(0, deadline_s=20.0)
    """,
        timeout=60,
        cwd=tmp_path,
    )
    assert p.returncode == 0 and "atexit ran" in p.stdout and "exiting without" not in p.stderr, p.stderr


# A real orbax save that cannot finish: the checkpoint folder is replaced by a file between two saves, so
# the second save cannot create its step folder; orbax's threads of that save then wait (for up to its own
# 10-minute timeout) for a signal from the creation that failed, and Python's exit joined them.
BROKEN_SAVE = """
    import os, time
    import jax.numpy as jnp
    from alpa_job.train.checkpoint import Checkpointer
    from alpa_job.errors import KitError
    from alpa_job.shutdown import exit_within
    ck = Checkpointer("checkpoints", every=1)
    state = {"w": jnp.arange(4.0)}
    ck.maybe_save(1, state, {"position": 1})
    ck.wait()  # step 1 is complete and sealed
    os.rename("checkpoints", "checkpoints.moved")
    open("checkpoints", "w").write("not a folder")
    ck.maybe_save(2, state, {"position": 2})
    t0 = time.monotonic()
    %s
    print("ended in %%.1f s" %% (time.monotonic() - t0), flush=True)
    exit_within(1)
"""


@pytest.mark.parametrize("how", ["close", "abandon"])
def test_a_checkpoint_save_that_cannot_finish_does_not_hold_the_exit(tmp_path, how):
    end = (
        "ck.abandon()"
        if how == "abandon"
        else "try:\n        ck.close()\n    except KitError as err:\n        print('error: ' + str(err), flush=True)"
    )
    t0 = time.monotonic()
    p = _python(BROKEN_SAVE % end, timeout=120, cwd=tmp_path)  # the hang lasted 10 minutes
    seconds = time.monotonic() - t0
    out = p.stdout + p.stderr
    assert p.returncode == 1, out[-3000:]
    assert seconds < 60, f"{seconds:.0f} s"
    named = [x for x in out.splitlines() if "the checkpoint save of step 2" in x and "failed" in x]
    assert named, out[-3000:]
    if how == "close":  # the end of a run: a one-line error (exit 1) naming the step
        assert named[0].startswith("error: ") and "rerun with --resume" in named[0]
    assert "exiting without waiting longer for the checkpoint save of step 2" in out, out[-3000:]


# ============================================================================ CPU: the setting
def test_hang_timeout_defaults_to_a_few_minutes_and_is_checked():
    assert JobConfig().hang_timeout == 300.0
    assert JobConfig(hang_timeout=0).validated().hang_timeout == 0  # 0: the watchdog is off
    with pytest.raises(KitError, match="--hang-timeout must be >= 0"):
        JobConfig(hang_timeout=-5).validated()


def test_hang_timeout_is_in_help_and_refused_where_no_driver_watches(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--hang-timeout S" in capsys.readouterr().out
    assert main(["train", "--address", "none", "--hang-timeout", "30"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --hang-timeout does nothing here"), err
    assert "--address none" in err[0]


# ============================================================================ slow: a stopped process
def _local_signal(sig):
    def send(pid: int) -> bool:
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False

    return send


@pytest.mark.slow
def test_a_stopped_process_on_a_local_ray_is_named_by_the_watchdog(tmp_path):
    """One node, one JAX process (a Ray actor): SIGSTOP it; the watchdog names it within --hang-timeout
    plus a few seconds, the job fails with exit 1 and the report says it hung."""
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "alpa_job",
        "train",
        "--address",
        "local",
        "--hidden-dim",
        "32",
        "--steps",
        "5000",
        "--num-samples",
        "6400",
        "--batch-size",
        "16",
        "--devices",
        "2",
        "--checkpoint-every",
        "10",
        "--hang-timeout",
        "10",
        "--out",
        str(out),
    ]
    started = []

    def popen(a, **kw):
        started.append(subprocess.Popen(a, cwd=str(REPO), **kw))
        return started[-1]

    def find_victim(exclude=()) -> int:
        # The JAX process this test's Ray started: the in-process Ray's processes descend from the driver.
        # Not every `ray::JaxProcess` of the machine: other runs (the test beds' among them) have their own.
        import psutil

        pids = []
        for child in psutil.Process(started[0].pid).children(recursive=True):
            try:
                if " ".join(child.cmdline()).startswith("ray::JaxProcess"):  # as `pgrep -f ^ray::JaxProcess`
                    pids.append(child.pid)
            except psutil.NoSuchProcess:
                continue
        assert len(pids) == 1, pids
        return pids[0]

    rc, text, seconds, _pid, _gone = _stop_and_wait(
        argv,
        out,
        find_victim,
        _local_signal(signal.SIGSTOP),
        _local_signal(signal.SIGCONT),
        _local_signal(0),
        after_checkpoint=100,
        popen=popen,
    )
    assert rc == 1, text[-4000:]
    assert seconds < 10 + 25, f"{seconds:.0f} s from the stop to the exit:\n{text[-3000:]}"
    line = [x for x in text.splitlines() if x.startswith("error: JAX process 0") and "hung at step" in x]
    assert line and "stopped, frozen" in line[0] and "last complete checkpoint: step" in line[0], text[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed" and "hung at step" in report["error"]
    assert "Traceback" not in text
