"""One run per folder: the driver holds OUT/.alpa_job.lock (JSON: host, PID, start, run id, a heartbeat
it rewrites every HEARTBEAT_S) from the checks until it exits. A second run into a live --out is
refused in one line naming the holder. A lock is stale, and taken over with a message, when its holder
is gone: on the same host, its PID is not running (or is another process now: the start time differs);
on another host (--out on a shared filesystem), its heartbeat is older than STALE_S by this host's
clock, or it does not change while this run watches it for WATCH_S (clock skew cannot fool that).
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import socket
import threading
import time
import uuid
from typing import Any, Dict, Optional

from alpa_job.errors import KitError

LOCK = ".alpa_job.lock"
HEARTBEAT_S = 10.0  # how often the holder rewrites its lock
WATCH_S = 2.5 * HEARTBEAT_S  # an unchanged heartbeat watched this long: the holder on another host is gone
STALE_S = 300.0  # a heartbeat this old by this host's clock is stale at once (far beyond any sane clock skew)


def utc_stamp(when: Optional[float] = None) -> str:
    """UTC time to the second as YYYYmmdd-HHMMSS (run folders, lock files): now, or `when`."""
    moment = datetime.datetime.fromtimestamp(when, datetime.timezone.utc) if when else datetime.datetime.now(datetime.timezone.utc)
    return moment.strftime("%Y%m%d-%H%M%S")


def _pid_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): a PID reused by another
    process has another one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _read_lock(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return ""


def _parse(raw: Optional[str]) -> Optional[Dict[str, Any]]:
    try:
        data = json.loads(raw or "")
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _holder(info: Dict[str, Any]) -> str:
    return f"host {info.get('host', '?')} PID {info.get('pid', '?')} (started {info.get('started', '?')})"


class RunLock:
    """OUT/.alpa_job.lock, held by the driver of the run writing into OUT (see the module's docstring)."""

    _held: Dict[str, "RunLock"] = {}

    def __init__(self, out: str, info: Dict[str, Any]):
        self.out = out
        self.path = os.path.join(out, LOCK)
        self.info = info
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def take(cls, out: str) -> "RunLock":
        path = os.path.join(out, LOCK)
        for _ in range(5):  # each round either takes the lock, refuses, or removes a stale one
            info = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "pid_start": _pid_start(os.getpid()),
                "pid_ns": _pid_namespace(),
                "started": utc_stamp(),
                "run_id": uuid.uuid4().hex[:12],
                "heartbeat": time.time(),
                "beats": 0,
            }
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                raw = _read_lock(path)
                if raw is None:
                    continue  # released meanwhile
                why = _stale(path, raw)
                if why is None and _read_lock(path) is None:
                    continue  # its run ended while this one watched: take it now
                if why is None:
                    holder = _parse(raw) or {}
                    raise KitError(
                        f"--out {out} is in use by another run: {_holder(holder)}; wait for it to end or "
                        f"pass another --out (a lock whose run is gone is taken over: {path})"
                    )
                if _read_lock(path) == raw:  # still the stale one (another run may have taken it over just now)
                    os.remove(path)
                    from alpa_job.progress.events import display

                    display().line(f"[alpa_job] took over the lock of a run that is gone ({why}): {path}", important=True)
                continue
            except OSError as err:
                raise KitError(f"--out {out}: cannot write there ({err.strerror}); pass a writable folder") from None
            with os.fdopen(fd, "w") as f:
                json.dump(info, f)
            lock = cls(out, info)
            lock._start()
            return lock
        raise KitError(f"--out {out}: another run keeps taking {path}; pass another --out")

    def _start(self) -> None:
        RunLock._held[os.path.abspath(self.out)] = self
        self._thread = threading.Thread(target=self._beat, name="alpa-job-lock", daemon=True)
        self._thread.start()
        atexit.register(self.release)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            if not self.owned():
                return  # taken over (this process looked gone to another run): nothing of it to refresh
            self.info.update(heartbeat=time.time(), beats=self.info["beats"] + 1)
            tmp = f"{self.path}.{self.info['run_id']}"
            try:
                with open(tmp, "w") as f:
                    json.dump(self.info, f)
                os.replace(tmp, self.path)
            except OSError:
                pass  # a full disk or a vanished folder: the next beat tries again

    def owned(self) -> bool:
        return (_parse(_read_lock(self.path)) or {}).get("run_id") == self.info["run_id"]

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        RunLock._held.pop(os.path.abspath(self.out), None)
        try:
            if self.owned():
                os.remove(self.path)
        except OSError:
            pass


def _stale(path: str, raw: str) -> Optional[str]:
    """Why the lock `raw` (read from `path`) belongs to a run that is gone, or None while its holder lives."""
    info = _parse(raw)
    if info is None:  # a holder killed between creating and writing it, or one writing it right now
        age = time.time() - os.path.getmtime(path) if os.path.exists(path) else 0.0
        if age > WATCH_S:
            return f"an unreadable lock last written {age:.0f} s ago"
        time.sleep(1.0)
        again = _read_lock(path)
        return None if again and _parse(again) else "an unreadable lock"
    pid = info.get("pid")
    same_host = info.get("host") == socket.gethostname() and info.get("pid_ns") == _pid_namespace()
    if same_host and isinstance(pid, int):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"{_holder(info)} is not running"
        except PermissionError:
            pass  # another user's live process
        start = info.get("pid_start")
        if start is not None and _pid_start(pid) not in (None, start):
            return f"{_holder(info)} is another process now"
        return None
    age = time.time() - float(info.get("heartbeat") or 0)
    if age > STALE_S:
        return f"{_holder(info)}: no heartbeat for {age:.0f} s"
    from alpa_job.progress.events import display

    display().line(
        f"[alpa_job] --out is locked by {_holder(info)}; watching its heartbeat for up to {WATCH_S:.0f} s to see whether that run is alive",
        important=True,
    )
    deadline = time.monotonic() + WATCH_S
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = _read_lock(path)
        if now != raw:
            return None  # refreshed (alive) or released (the caller sees which): not stale
    return f"{_holder(info)}: its heartbeat did not change in {WATCH_S:.0f} s"


def release(out: Optional[str]) -> None:
    """Release the lock this process holds on `out` (the run is over); nothing when it holds none."""
    lock = RunLock._held.get(os.path.abspath(out)) if out else None
    if lock is not None:
        lock.release()
