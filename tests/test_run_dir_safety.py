"""One run per --out folder, checkpoints that survive damage, and a full disk during a save.

Everything here is real: CLI runs in subprocesses (tiny MLP, CPU), a real lock held by a live run, real
orbax checkpoints damaged on disk, a real full disk (a small tmpfs mounted over OUT/checkpoints; root)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from alpa_job.train import disk_full, rundir, run_lock
from alpa_job.train.checkpoint_files import FILES, disk_bytes, latest_complete_step, scan, verify_step

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [
    "--address",
    "none",
    "--hidden-dim",
    "32",
    "--num-samples",
    "64",
    "--batch-size",
    "16",
    "--epochs",
    "10",
    "--progress-every",
    "1",
    "--compile-cache",
    "none",
]


def cli(*args, timeout=240):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=REPO)
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(
        [sys.executable, "-m", "alpa_job", "train", *TINY, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


def losses(out) -> list:
    """The per-step losses a run's report.json holds (the steps this run trained)."""
    return json.loads((out / "report.json").read_text())["losses"]


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# ----------------------------------------------------------------------------- one run per folder
def test_a_second_run_into_a_live_out_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=REPO)
    first = subprocess.Popen(
        [sys.executable, "-m", "alpa_job", "train", *TINY, "--steps", "100000", "--out", str(out)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        lock = out / run_lock.LOCK
        while not lock.exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.2)
        holder = json.loads(lock.read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()

        second = cli("--steps", "2", "--out", str(out), timeout=60)
        assert second.returncode == 2, second.stderr
        line = second.stderr.strip().splitlines()[-1]
        assert f"is in use by another run: host {socket.gethostname()} PID {first.pid}" in line
        assert len(second.stderr.strip().splitlines()) == 1
        assert json.loads(lock.read_text())["pid"] == first.pid  # the live run keeps its lock
    finally:
        first.send_signal(signal.SIGKILL)  # a crash: nothing releases the lock
        first.wait(timeout=30)
    assert lock.exists()

    third = cli("--steps", "2", "--out", str(out), "--overwrite")
    assert third.returncode == 0, third.stderr
    assert f"took over the lock of a run that is gone (host {socket.gethostname()} PID {first.pid}" in third.stderr
    assert "is not running" in third.stderr
    assert not lock.exists()  # released at the end
    assert json.loads((out / "report.json").read_text())["status"] == "ok"


def test_stale_locks_are_judged_by_pid_here_and_by_heartbeat_elsewhere(tmp_path, capsys):
    lock = tmp_path / run_lock.LOCK
    mine = run_lock.RunLock.take(str(tmp_path))
    try:
        with pytest.raises(Exception, match=rf"in use by another run: host {socket.gethostname()} PID {os.getpid()}"):
            run_lock.RunLock.take(str(tmp_path))  # a live holder (this very process)
    finally:
        mine.release()
    assert not lock.exists()

    gone = dead_pid()
    lock.write_text(
        json.dumps(
            {
                "host": socket.gethostname(),
                "pid": gone,
                "pid_ns": run_lock._pid_namespace(),
                "started": "earlier",
                "run_id": "x",
                "heartbeat": time.time(),
            }
        )
    )
    taken = run_lock.RunLock.take(str(tmp_path))
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    taken.release()
    assert f"PID {gone} (started earlier) is not running" in capsys.readouterr().err

    # Another host's run (a shared filesystem): its PID means nothing here, its heartbeat stopped long ago.
    lock.write_text(json.dumps({"host": "other-host", "pid": 1, "started": "earlier", "run_id": "y", "heartbeat": time.time() - 3600}))
    taken = run_lock.RunLock.take(str(tmp_path))
    taken.release()
    assert "host other-host PID 1 (started earlier): no heartbeat for 3600 s" in capsys.readouterr().err


def test_another_runs_reports_are_replaced_only_with_overwrite(tmp_path):
    """Refused here; --overwrite replacing them is the last run of the live-lock test above."""
    out = tmp_path / "prev"
    out.mkdir()
    (out / "report.json").write_text('{"status": "ok", "steps": 7}')
    (out / "train.log").write_text("the earlier run\n")
    refused = cli("--steps", "1", "--out", str(out), timeout=60)
    assert refused.returncode == 2
    assert refused.stderr.strip() == (
        f"error: --out {out} holds another run's report (report.json, train.log); pass --overwrite to replace it, or another --out"
    )
    assert json.loads((out / "report.json").read_text())["steps"] == 7
    assert not (out / run_lock.LOCK).exists()  # a refused run leaves nothing behind


# ----------------------------------------------------------------------------- damaged checkpoints
def _state_array_file(step_dir):
    """The largest array file of a checkpoint's train state (OCDBT data under state/)."""
    files = [
        os.path.join(root, name)
        for root, _dirs, names in os.walk(step_dir / "state")
        for name in names
        if os.sep + "d" + os.sep in os.path.join(root, name) + os.sep and root.endswith("d")
    ]
    return max(files, key=os.path.getsize)


def _truncate(path, keep=0.5):
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def test_resume_skips_damaged_checkpoints_names_them_and_continues_the_same_losses(tmp_path):
    out = tmp_path / "run"
    first = cli("--steps", "6", "--checkpoint-every", "2", "--out", str(out))
    assert first.returncode == 0, first.stderr
    first_losses = losses(out)
    ckpt = out / "checkpoints"
    assert scan(str(ckpt)) == ([6, 4, 2], [])

    # Step 6: an array file cut short; the save's file list catches it before anything restores it.
    damaged_array = _state_array_file(ckpt / "6")
    _truncate(damaged_array)
    problem = verify_step(str(ckpt / "6"))
    assert problem[0] == damaged_array and "the save wrote" in problem[1]
    # Step 4: damage no static check sees (no file list: a save killed before it was sealed), only a restore.
    os.remove(ckpt / "4" / FILES)
    step4_array = _state_array_file(ckpt / "4")
    _truncate(step4_array, keep=0.0)
    assert latest_complete_step(str(ckpt)) == 4  # the driver's view; the loop's restore then falls back

    resumed = cli("--steps", "8", "--checkpoint-every", "2", "--resume", "--out", str(out))
    assert resumed.returncode == 0, resumed.stderr
    lines = resumed.stderr.splitlines()
    six = [x for x in lines if "checkpoint step 6 skipped" in x]
    four = [x for x in lines if "checkpoint step 4 skipped" in x]
    assert six == [f"[alpa_job] checkpoint step 6 skipped: {damaged_array}: {problem[1]}"]
    assert len(four) == 1 and "does not restore" in four[0] and str(ckpt / "4") in four[0]
    assert "resumed from step 2" in resumed.stderr and "Traceback" not in resumed.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "ok" and report["resumed_from_step"] == 2 and report["steps"] == 6
    assert losses(out)[:4] == first_losses[2:6]  # steps 3..6 again, exactly
    assert sorted(x.split("-")[0] for x in os.listdir(out / "checkpoints-skipped")) == ["4", "6"]  # kept aside
    good, bad = scan(str(ckpt))
    assert good[0] == 8 and bad == []  # the resumed run saved 4, 6 and 8 anew

    # A resume whose --steps the checkpoint is already past: one line before anything trains, nothing lost.
    behind = cli("--steps", "6", "--checkpoint-every", "2", "--resume", "--out", str(out))
    assert behind.returncode == 2, behind.stderr
    assert behind.stderr.strip().splitlines()[-1] == (
        f"error: --resume: the checkpoint in {out} is at step 8, already past --steps 6; pass --steps above 8 to train on"
    ), behind.stderr
    assert scan(str(ckpt))[0][0] == 8 and "Traceback" not in behind.stderr


def test_a_failed_resume_keeps_the_earlier_runs_report(tmp_path):
    out = tmp_path / "run"
    first = cli("--steps", "4", "--checkpoint-every", "2", "--out", str(out))
    assert first.returncode == 0, first.stderr
    good = (out / "report.json").read_text()
    ckpt = out / "checkpoints"
    _truncate(ckpt / "4" / "state" / "_METADATA")  # the driver sees it
    os.remove(ckpt / "2" / FILES)  # the driver cannot see this one: only its restore fails
    _truncate(_state_array_file(ckpt / "2"), keep=0.0)

    failed = cli("--steps", "6", "--checkpoint-every", "2", "--resume", "--out", str(out))
    assert failed.returncode == 1
    assert f"checkpoint step 4 skipped: {ckpt / '4' / 'state' / '_METADATA'}: not valid JSON" in failed.stderr
    assert (out / "report.json").read_text() == good
    report = json.loads((out / rundir.FAILED_REPORT).read_text())
    assert report["status"] == "failed" and "no checkpoint in" in report["error"] and "restores" in report["error"]
    assert f"report: {out / rundir.FAILED_REPORT} (the earlier run's report.json is kept)" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert not (out / run_lock.LOCK).exists()


# ----------------------------------------------------------------------------- a full disk
@pytest.fixture
def small_disk(tmp_path):
    """OUT/checkpoints on a tmpfs of a given size (the reports stay on the ordinary disk)."""
    mounted = []

    def make(name, size):
        where = tmp_path / name / "checkpoints"
        where.mkdir(parents=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}); needs root")
        mounted.append(where)
        return tmp_path / name

    yield make
    for where in mounted:
        subprocess.run(["umount", str(where)], check=False)


def _stopped_cleanly(proc, out):
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "Traceback" not in proc.stderr and len(lines) < 12, proc.stderr
    error = lines[-1]
    assert error.startswith("error: checkpoint at step ") and f"no space left in {out / 'checkpoints'}" in error
    assert not [n for n in os.listdir(out / "checkpoints") if "orbax-checkpoint-tmp" in n]
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "failed" and report["error"] == error[len("error: ") :]
    return error


def test_a_save_that_would_not_fit_stops_the_run_before_it_starts(small_disk):
    # The tiny MLP's save takes 270 to 410 KiB (its 27 small arrays land in 7 to 30 data files, by timing), so one
    # fits on 700 KiB; the next needs its size, a margin and two blocks per array (over 560 KiB), and is refused.
    out = small_disk("precheck", "700k")
    proc = cli("--steps", "12", "--checkpoint-every", "1", "--out", str(out))
    error = _stopped_cleanly(proc, out)
    assert error.startswith("error: checkpoint at step 2: "), error
    # The free bytes the kit decided on, as it says them: afterwards orbax's thread may still remove an older
    # checkpoint (a busy machine saw the disk freer after the exit than at the decision).
    m = re.search(r", (\d+) bytes free; a save needs about (\d+) bytes .*the last save's size", error)
    assert m and int(m.group(2)) > int(m.group(1)), error
    assert int(m.group(1)) <= os.statvfs(out / "checkpoints").f_blocks * os.statvfs(out / "checkpoints").f_frsize
    assert "the save was not started" in error
    latest = latest_complete_step(str(out / "checkpoints"))
    assert latest is not None and f"step {latest} stays the latest complete checkpoint" in error


def test_a_saves_need_counts_the_blocks_its_small_files_take(small_disk):
    """The free-space check counts what a save takes on the disk: 40 files of 10 bytes take 40 blocks of a
    tmpfs, not 400 bytes (counting lengths let a save start that then ran out of space)."""
    folder = small_disk("blocks", "1m") / "checkpoints" / "1"
    folder.mkdir()
    for i in range(40):
        (folder / f"f{i}").write_bytes(b"x" * 10)
    block = os.statvfs(folder).f_frsize
    assert disk_bytes(str(folder)) >= 40 * block > 400


def test_a_save_that_fills_the_disk_is_one_line_and_its_partial_folder_goes(small_disk):
    out = small_disk("enospc", "150k")  # not even the first save fits: orbax meets ENOSPC mid-write
    proc = cli("--steps", "12", "--checkpoint-every", "1", "--out", str(out))
    error = _stopped_cleanly(proc, out)
    assert "the partial save was removed" in error and re.search(r"a save needs about \d+ bytes", error)


def _collect_unretrieved(coroutine_function):
    """Run a task to its error on its own loop and let it be collected with the error never retrieved."""
    loop = asyncio.new_event_loop()
    task = loop.create_task(coroutine_function())
    loop.run_until_complete(asyncio.wait([task]))
    loop.close()
    del task
    gc.collect()


def test_a_failed_restores_other_reads_are_not_echoed_by_asyncio(caplog, monkeypatch):
    """A damaged checkpoint fails several of orbax's reads at once: the restore raises the first, and asyncio
    logs each of the others ("Task exception was never retrieved", a traceback each) when its task is
    collected, after the run's one-line error. The checkpointer's filter drops those, and only those."""
    import orbax.checkpoint as ocp

    async def orbax_read():  # fails inside orbax's code, as a read of a damaged array does
        ocp.step.step_from_checkpoint_name("damaged")

    async def users_task():
        raise ValueError("the user's own task")

    def echoed(reported):
        monkeypatch.setitem(disk_full._REPORTED, "failure", reported)
        caplog.clear()
        for task in (orbax_read, users_task):
            _collect_unretrieved(task)
        return [str(r.exc_info[1]) for r in caplog.records if "never retrieved" in r.getMessage()]

    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addFilter(disk_full._QUIET)  # as the checkpointer installs it
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            assert echoed(reported=False) == ["Unrecognized name format: damaged.", "the user's own task"]
            assert echoed(reported=True) == ["the user's own task"]
    finally:
        asyncio_log.removeFilter(disk_full._QUIET)
