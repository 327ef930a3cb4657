"""`python -m alpa_job.cluster.wait_nodes`: answers within its deadline, both ways."""
from __future__ import annotations

import json
import subprocess
import sys
import time

from test_cli import REPO


def test_times_out_with_exit_4_and_reports_what_is_alive():
    """A one-node local Ray never reaches 2 nodes: exit 4 after ~the deadline, not a hang."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "alpa_job.cluster.wait_nodes", "--count", "2", "--timeout", "2",
                           "--address", "local"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 4, proc.stderr[-2000:]
    assert time.monotonic() - start < 90
    report = json.loads([x for x in proc.stdout.splitlines() if x.startswith("{")][-1])
    assert len(report["alive"]) == 1
    assert "only 1 of 2 Ray nodes alive after 2 s" in proc.stderr
