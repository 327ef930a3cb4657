"""The watchdog's slow tests' shared part (test_watchdog on a local Ray, test_watchdog_testbed on the
node-loss bed): train, SIGSTOP the victim once a checkpoint is complete, wait for the driver."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Optional

import pytest

GONE_WAIT_S = 30.0  # Ray's kill of a stopped worker is asynchronous: the raylet ends it after the driver left


def _stop_and_wait(
    argv,
    out: Path,
    find_victim,
    stop,
    cont,
    alive,
    timeout: float = 400,
    after_checkpoint: int = 20,
    popen=None,
    again_after_steps: Optional[int] = None,
):
    """Train; SIGSTOP the victim once checkpoint `after_checkpoint` is complete (and, with `again_after_steps`,
    the victim's successor once a checkpoint that many steps past the first stop's is); wait for the driver.
    Returns (rc, output, seconds from the last stop to the driver's exit, the stopped pids, whether every
    one was gone, still stopped, within GONE_WAIT_S of the exit). Every victim is continued in the end."""
    from alpa_job.train.checkpoint_files import latest_complete_step

    log = open(str(out) + ".driver.log", "w+")
    p = (popen or subprocess.Popen)(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    thresholds = [after_checkpoint]
    victims: list = []
    stopped_at = None
    gone = False
    try:
        while p.poll() is None and time.monotonic() < deadline:
            latest = latest_complete_step(str(out / "checkpoints")) or 0
            if len(victims) < len(thresholds) and latest >= thresholds[len(victims)]:
                victim = find_victim(exclude=victims)
                if victim is not None:
                    stop(victim)
                    victims.append(victim)
                    stopped_at = time.monotonic()
                    if again_after_steps is not None and len(thresholds) == 1:
                        thresholds.append(latest + again_after_steps)
            time.sleep(0.1)
        if p.poll() is None:
            p.kill()
            pytest.fail(f"the job did not end within {timeout} s")
        ended = time.monotonic()
        while any(alive(v) for v in victims) and time.monotonic() - ended < GONE_WAIT_S:
            time.sleep(0.5)
        gone = bool(victims) and not any(alive(v) for v in victims)
    finally:
        for victim in victims:
            cont(victim)  # never leave a stopped process behind on a shared bed
        log.seek(0)
        text = log.read()
        log.close()
    assert len(victims) == len(thresholds) == 1 + (again_after_steps is not None), (
        f"the job ended before checkpoint {thresholds[len(victims)]} (stopped {victims}):\n{text[-4000:]}"
    )
    return p.returncode, text, ended - stopped_at, victims, gone
