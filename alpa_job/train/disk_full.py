"""A full disk during an orbax save, told once: recognise it, and silence orbax's and TensorStore's echoes.

Orbax logs a failed save from each of its background threads, and TensorStore reports every chunk in
flight as an unraisable error: hundreds of tracebacks for one full disk. The checkpointer reports it in
one line; these filters keep the rest off the screen. A restore of a damaged checkpoint echoes the same
way: the first failed read is reported, and asyncio logs each of the others when its task is collected.
"""

from __future__ import annotations

import errno
import logging
import os
import sys


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` (or what caused it: orbax wraps TensorStore's error) is a full disk or quota."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(err)
        if "No space left on device" in text or "os_error_code='28'" in text or "Disk quota exceeded" in text:
            return True
        err = err.__cause__ or err.__context__
    return False


class _QuietEchoes(logging.Filter):
    """Orbax logs a full disk from each of its background threads with a traceback (dozens of lines per
    save), and asyncio logs each of a failed restore's other reads ("Task exception was never retrieved",
    when the task is collected, after the run's own error). The run reports the failure once, in one line,
    so those records are dropped here."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and (is_disk_full(exc) or _late_callback(exc, record.exc_info[2])):
            return False
        text = record.getMessage()
        return not ("No space left on device" in text or "os_error_code='28'" in text)


_QUIET = _QuietEchoes()


_REPORTED = {"failure": False}  # a save or restore failure was named in one line: orbax's echoes of it are noise


def _late_callback(exc: BaseException, tb) -> bool:
    """A TensorStore callback of a failed save reaching its asyncio loop after orbax closed it, or (once the
    failure was reported) an orbax coroutine of the failed save or restore collected with its error."""
    names, files = [], []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        files.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed" and "call_soon_threadsafe" in names:
        return True
    return _REPORTED["failure"] and any(f"{os.sep}orbax{os.sep}" in f for f in files)


def _install_unraisable_hook() -> None:
    """TensorStore reports each of those late callbacks' errors as unraisable (one bare traceback per chunk
    in flight: hundreds after a full disk); they say nothing the save's own error does not."""
    previous = sys.unraisablehook
    if getattr(previous, "_alpa_job_quiet", False):
        return

    def hook(unraisable):
        if not _late_callback(unraisable.exc_value, unraisable.exc_traceback):
            previous(unraisable)

    hook._alpa_job_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook
