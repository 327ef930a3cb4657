"""Preemption: SIGTERM to the driver stops every JAX process at one agreed step, saves a checkpoint there,
writes the report as `preempted` and exits 75; `--resume auto` continues (or starts fresh) with the
losses of a run that was never stopped.

CPU, in-process (`--address none`) and the agreement protocol with real threads; the Ray path runs on
the test bed (test_preemption_testbed.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from alpa_job.errors import EXIT_PREEMPTED, KitError
from alpa_job.launch.runner import run_in_process
from alpa_job.train.checkpoint_files import latest_complete_step
from alpa_job.train.stop import StopPoint, agree
from helpers_report import assert_valid_report
from helpers_train import signal_at_step, tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 200
# The tiny MLP of helpers_train.tiny_config, as flags: the in-test run and the CLI's train the same.
TINY = (
    "--address",
    "none",
    "--hidden-dim",
    "32",
    "--num-samples",
    "64",
    "--batch-size",
    "16",
    "--epochs",
    "100",
    "--learning-rate",
    "3e-3",
    "--compile-cache",
    "none",
    "--steps",
    str(STEPS),
)


def _cli(*args, cwd):
    return subprocess.Popen(
        [sys.executable, "-m", "alpa_job", "train", *TINY, *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO, RAY_USAGE_STATS_ENABLED="0"),
    )


def test_sigterm_saves_the_step_reached_and_resume_auto_continues_with_the_same_losses(tmp_path):
    out = tmp_path / "run"
    straight = run_in_process(tiny_config(steps=STEPS, epochs=100, compile_cache="none", out=str(tmp_path / "a")))

    # First start: --resume auto on an empty --out starts fresh; no --checkpoint-every multiple is reached.
    proc = _cli("--resume", "auto", "--checkpoint-every", "1000", "--progress-every", "1", "--out", str(out), cwd=tmp_path)
    stderr = signal_at_step(proc, 5, signal.SIGTERM)
    assert proc.returncode == EXIT_PREEMPTED == 75, stderr[-3000:]
    assert "--resume auto: no complete checkpoint" in stderr and "starting fresh" in stderr
    assert "Traceback" not in stderr
    report = json.loads((out / "report.json").read_text())
    assert_valid_report(report)
    stop = report["stopped_at_step"]
    assert report["status"] == "preempted" and 5 <= stop < STEPS and report["steps"] == stop
    assert [p["stopped_at_step"] for p in report["processes"]] == [stop]
    assert f"at step {stop}" in report["error"] and "--resume auto" in report["error"]
    assert [l for l in stderr.splitlines() if l.startswith("preempted (SIGTERM) at step")], stderr[-2000:]
    assert latest_complete_step(str(out / "checkpoints")) == stop  # saved although not a multiple of 1000
    assert report["losses"] == straight.losses[:stop]

    # The same command again (what a restarted job runs): it resumes there and trains to the end.
    again = _cli("--resume", "auto", "--checkpoint-every", "1000", "--out", str(out), cwd=tmp_path)
    stdout, stderr = again.communicate(timeout=180)
    assert again.returncode == 0, stderr[-3000:]
    resumed = json.loads((out / "report.json").read_text())
    assert resumed["status"] == "ok" and resumed["resumed_from_step"] == stop
    assert resumed["steps"] == STEPS - stop and resumed["stopped_at_step"] is None
    assert resumed["losses"] == straight.losses[stop:]


def test_a_stop_without_checkpoint_every_still_saves_and_plain_resume_continues(tmp_path):
    """The loop's side in this process: a stop requested before the first step ends the run after it, and
    the checkpoint is written into OUT/checkpoints although the run saves nothing otherwise."""
    stop = StopPoint()
    stop.request_now()
    config = tiny_config(steps=12, epochs=10, out=str(tmp_path / "run"))
    first = run_in_process(config, stop=stop)
    assert first.stopped_at_step == 1 == stop.stopped_at and first.steps == 1
    assert latest_complete_step(str(tmp_path / "run" / "checkpoints")) == 1
    rest = run_in_process(config.replace(resume=True, checkpoint_every=100))
    assert rest.resumed_from_step == 1 and rest.steps == 11 and rest.stopped_at_step is None


# ----------------------------------------------------------------------------- the agreement
def _processes(count, total, pace):
    """`count` threads stepping through a loop as run_loop does (after_step after every step); each
    returns the step it stopped at, or None when it ran to `total`."""
    points = [StopPoint(confirm_timeout_s=10) for _ in range(count)]
    stopped = [None] * count
    started = threading.Barrier(count + 1)

    def run(i):
        started.wait()
        for step in range(1, total + 1):
            pace(i, step)
            if step < total and points[i].after_step(step):
                stopped[i] = step
                return

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    started.wait()
    return points, stopped, threads


def _driver(points):
    return agree(
        lambda at: [p.propose(at) for p in points], lambda at: [p.confirm(at) for p in points], furthest=max(p.step or 0 for p in points)
    )


def test_processes_at_different_steps_all_stop_at_the_one_agreed_step():
    import time

    # Process 2 runs ahead of the others (as a host dispatching ahead does); nobody may stop at a step
    # another one trains past.
    def pace(i, step):
        time.sleep(0.0005 if i == 2 else 0.002)

    points, stopped, threads = _processes(3, 100000, pace)
    time.sleep(0.2)
    at = _driver(points)
    for t in threads:
        t.join(timeout=30)
    assert stopped == [at, at, at], (stopped, at)


def test_a_proposal_a_process_has_passed_is_refused_and_the_next_one_releases_the_waiting():
    point, ahead = StopPoint(confirm_timeout_s=10), StopPoint()
    point.after_step(3)
    ahead.after_step(9)
    assert point.propose(5) is None and ahead.propose(5) == 9  # 9 is past 5: refused, with where it is
    waited = []
    waiter = threading.Thread(target=lambda: (point.after_step(4), waited.append(point.after_step(5))))
    waiter.start()
    waiter.join(timeout=0.3)
    assert waiter.is_alive()  # at 5, unconfirmed: it waits rather than train past or stop alone
    assert point.propose(11) is None  # the driver's next proposal, past the refusal
    waiter.join(timeout=5)
    assert waited == [False] and point.stopped_at is None


def test_a_stop_never_confirmed_fails_in_bounded_time():
    point = StopPoint(confirm_timeout_s=0.2)
    point.propose(2)
    with pytest.raises(KitError, match="did not confirm the step"):
        point.after_step(2)


def test_agreement_that_never_converges_is_one_error():
    with pytest.raises(KitError, match="did not agree on a step"):
        agree(lambda at: [at + 1], lambda at: None, furthest=0, rounds=3)


# ----------------------------------------------------------------------------- --resume [auto]
def test_resume_flag_alone_means_must_and_auto_is_a_word():
    from alpa_job.cli import build_parser
    from alpa_job.settings.config import build_config

    def config(*argv):
        args = build_parser().parse_args(["train", "--checkpoint-every", "5", *argv])
        return build_config({}, {k: v for k, v in vars(args).items() if k in tiny_config().as_dict()})

    assert config("--resume").resume is True
    assert config("--resume", "auto").resume == "auto"
    assert config().resume is False
    assert build_config({"resume": "auto", "checkpoint_every": 5}, {}).resume == "auto"  # YAML
    assert build_config({"resume": "yes", "checkpoint_every": 5}, {}).resume is True
    with pytest.raises(KitError, match=r"--resume takes no value or one of: auto \(got 'maybe'\)"):
        config("--resume", "maybe")


def test_resume_auto_resolves_against_the_out_folder(tmp_path):
    from alpa_job.train import rundir

    config = tiny_config(resume="auto", checkpoint_every=5, out=str(tmp_path / "run"))
    assert rundir.prepare(config, explicit_out=True).resume is False  # nothing there: a fresh run
    rundir.release(config.out)  # what the run's end does: the folder's lock goes with it
    import numpy as np

    from alpa_job.train.checkpoint import Checkpointer

    saver = Checkpointer(str(tmp_path / "run" / "checkpoints"), 5)  # a real, complete checkpoint at step 5
    assert saver.maybe_save(5, {"w": np.arange(4.0)})
    saver.close()
    assert rundir.prepare(config, explicit_out=True).resume is True
    rundir.release(config.out)


# ----------------------------------------------------------------------------- the systemd unit
def test_the_systemd_unit_runs_resume_auto_and_gives_sigterm_time_for_a_save():
    """What Ansible renders (its own Templar over the role): the driver alone gets SIGTERM, with
    TimeoutStopSec for one step plus one save, and a restart runs the same `--resume auto` command."""
    import shlex

    from helpers_ansible import Render

    unit = Render(
        "process", role="head", kit_role="alpa_train", alpa_train_args=["--model", "gpt"], alpa_train_stop_timeout_s=240
    ).template_file("alpa-kit-train.service.j2")
    lines = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    argv = shlex.split(lines["ExecStart"])
    assert argv[:4] == ["/opt/alpa-kit/venv/bin/python", "-m", "alpa_job", "train"]
    assert argv[argv.index("--resume") + 1] == "auto" and argv[-2:] == ["--model", "gpt"]
    assert int(argv[argv.index("--checkpoint-every") + 1]) > 0 and "--out" in argv
    assert lines["KillSignal"] == "SIGTERM" and lines["KillMode"] == "mixed" and lines["TimeoutStopSec"] == "240"
    assert lines["Restart"] == "on-failure"  # exit 75 (preempted) restarts; 0 (done) does not


def test_a_ctrl_c_python_swallowed_still_ends_the_run_at_the_next_step():
    """A KeyboardInterrupt raised inside a __del__ (where a signal may land mid-step) is only printed by
    Python; the next step boundary raises it again, so Ctrl-C never leaves a run training on."""
    import gc

    from alpa_job.launch.preemption import Preemption

    caught = Preemption()

    class Finalised:
        def __del__(self):
            caught.interrupt()

    Finalised()  # "Exception ignored in ... __del__ ... KeyboardInterrupt": lost, as Python does
    gc.collect()
    with pytest.raises(KeyboardInterrupt):
        caught.stop.after_step(7)
