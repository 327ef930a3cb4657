"""Running the kit's command line as a user does (a fresh process, this checkout on its path), and a port
that answers nothing, for the tests that need them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, timeout=300, env=None):
    full_env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=REPO)
    full_env.pop("RAY_ADDRESS", None)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "alpa_job", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=full_env
    )


def silent_listener():
    """A TCP port that accepts and never speaks: what a wrong port (not Ray's GCS) looks like."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, held
