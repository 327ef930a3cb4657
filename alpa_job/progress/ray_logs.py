"""Ray's own output kept out of the user's way: the progress display speaks for the run.

Ray's environment (no dedup summaries, no colour codes in a log), its Python loggers (warnings only
with -v) and what native code writes to fd 2 (to a log file unless -v): the launcher sets them up before
it connects to Ray.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Dict, Optional

from alpa_job.progress.display import VERBOSE


def ray_noise_env(verbosity: int, tty: bool) -> Dict[str, str]:
    """Environment for Ray's own output: without -v no dedup summaries; never colour codes in a log."""
    env = {"RAY_DEDUP_LOGS": "0"}
    if not tty:
        env["RAY_COLOR_PREFIX"] = "0"
    return env


def quiet_ray_loggers(verbosity: int) -> None:
    """Ray's Python warnings (the token-auth notice, ...) only with -v."""
    if verbosity < VERBOSE:
        import ray  # noqa: F401 - importing ray sets its logger's level, so ours must come after

        logging.getLogger("ray").setLevel(logging.ERROR)


class NativeStderr:
    """Send what native code writes to fd 2 (Ray's C++ retry spam, raylet/GCS child processes, XLA)
    to a log file, while Python's sys.stderr keeps going to the user. Undone by `restore`."""

    def __init__(self, log_path: str):
        self.log_path = log_path
        self._saved_fd: Optional[int] = None
        self._saved_stderr = None

    def start(self) -> "NativeStderr":
        sys.stderr.flush()
        self._saved_fd = os.dup(2)
        self._saved_stderr = sys.stderr
        user = os.fdopen(os.dup(self._saved_fd), "w", buffering=1, errors="replace")
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        sys.stderr = user  # a Display without its own stream follows sys.stderr
        return self

    def restore(self) -> None:
        if self._saved_fd is None:
            return
        sys.stderr.flush()
        os.dup2(self._saved_fd, 2)
        os.close(self._saved_fd)
        self._saved_fd = None
        sys.stderr = self._saved_stderr
