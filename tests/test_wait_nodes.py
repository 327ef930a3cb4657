"""`python -m alpa_job.cluster.wait_nodes`: answers within its deadline, both ways."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from helpers_cli import REPO, silent_listener


def test_times_out_with_exit_4_and_reports_what_is_alive():
    """A one-node local Ray never reaches 2 nodes: exit 4 after ~the deadline, not a hang."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "alpa_job.cluster.wait_nodes", "--count", "2", "--timeout", "2", "--address", "local"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert time.monotonic() - start < 90
    report = json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])
    assert len(report["alive"]) == 1
    assert "only 1 of 2 Ray nodes alive after 2 s" in proc.stderr


def test_the_join_itself_is_bounded_by_the_timeout():
    """An address where something answers TCP but no Ray GCS: exit 4 naming it, not Ray's minutes of retries."""
    server, held = silent_listener()
    address = "127.0.0.1:%d" % server.getsockname()[1]
    try:
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "alpa_job.cluster.wait_nodes", "--count", "1", "--timeout", "3", "--address", address],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        took = time.monotonic() - start
    finally:
        server.close()
        for s in held:
            s.close()
    assert proc.returncode == 4, proc.stderr[-2000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(errors) == 1 and address in errors[0] and "within 3 s" in errors[0], proc.stderr[-2000:]
    assert took < 3 + 15, took
