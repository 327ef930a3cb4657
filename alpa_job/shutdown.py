"""Ending the process in bounded time, whatever background threads are left.

Python's exit joins every non-daemon thread before its atexit handlers run, and waits as long as
they take. Some threads never end on their own: orbax's save threads wait (up to its own 10-minute
timeout) for a signal from a save step that failed, so a run whose checkpoint save failed printed its
result and then never exited. `exit_within(code)` is the entry point's way out: it starts a daemon
deadline thread and exits normally; if the normal exit (the joins, then Ray's and JAX's atexit
handlers) has not ended the process by the deadline, the deadline thread names what is still
running in one line and ends the process with `os._exit(code)`. That skips what was left of the
exit, which is the point: a thread blocked on a condition that nothing will set cannot be stopped
from outside, and the report and logs were written before.

`expect_stuck(why)` is said by code that abandoned work whose threads will not end (a save that
failed or did not finish in time): the deadline is then short (nothing good comes of waiting) and
the line says why.

Standard library only: it runs at the very end of every command.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import List, Optional, Union

EXIT_DEADLINE_S = 60.0  # a healthy exit (local Ray's shutdown included) takes a few seconds
STUCK_DEADLINE_S = 5.0  # when work was abandoned: its threads are known not to end

_stuck: List[str] = []


def expect_stuck(why: str) -> None:
    """Threads of abandoned work (`why`, e.g. "the checkpoint save of step 10") will not end by themselves."""
    _stuck.append(why)


def stuck_reasons() -> List[str]:
    return list(_stuck)


def _lingering() -> List[str]:
    main = threading.main_thread()
    return sorted(t.name for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive())


def _as_int(code: Union[int, str, None]) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def exit_within(code: Union[int, str, None], deadline_s: Optional[float] = None) -> None:
    """sys.exit(code), ended by os._exit(code) if the interpreter's own exit runs past the deadline."""
    if deadline_s is None:
        deadline_s = STUCK_DEADLINE_S if _stuck else EXIT_DEADLINE_S

    def last_resort() -> None:
        time.sleep(deadline_s)
        names = _lingering()
        what = "; ".join(_stuck) + "; " if _stuck else ""
        try:
            sys.stdout.flush()
            print(
                f"[alpa_job] exiting without waiting longer for {what}{len(names)} background thread(s) still "
                f"running after {deadline_s:.0f} s ({', '.join(names[:6]) or 'exit handlers'}); exit code "
                f"{_as_int(code)}",
                file=sys.stderr,
                flush=True,
            )
        finally:
            os._exit(_as_int(code))

    threading.Thread(target=last_resort, name="exit-deadline", daemon=True).start()
    sys.exit(code)
