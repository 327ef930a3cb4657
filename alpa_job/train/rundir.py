"""Where a run writes: one directory per run, never another run's files (nothing is lost).

Without --out a run gets runs/<UTC time>-<model>-<strategy>/ and runs/latest becomes a symlink to it
(replaced atomically; a real runs/latest folder from an older kit is moved aside under its own time).
An explicit --out that already holds checkpoints belongs to another run: it is refused unless --resume
(continue it: the checkpoint must exist and be of the same model) or --overwrite (its checkpoints and
reports are removed first); --resume auto is --resume when a complete checkpoint is there, else a new run. The folder is created and probed for writing before Ray starts, and
run.json (the job config) is written into it so a later --resume can tell which model it holds.
A folder that holds only an earlier run's reports (report.json, train.log, run.json, no checkpoints)
is refused the same way: --overwrite replaces them, --resume needs a checkpoint.

One run per folder: the driver holds OUT/.alpa_job.lock (JSON: host, PID, start, run id, a heartbeat
it rewrites every HEARTBEAT_S) from the checks until it exits. A second run into a live --out is
refused in one line naming the holder. A lock is stale, and taken over with a message, when its holder
is gone: on the same host, its PID is not running (or is another process now: the start time differs);
on another host (--out on a shared filesystem), its heartbeat is older than STALE_S by this host's
clock, or it does not change while this run watches it for WATCH_S (clock skew cannot fool that).

--resume uses the newest checkpoint that verifies (train/checkpoint.py); each newer one that does not
is named (step, file, reason) and moved to OUT/checkpoints-skipped/, so the driver's view of the
latest step (the controller's too) is the one the loop restores.
"""
from __future__ import annotations

import atexit
import datetime
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from typing import Any, Dict, List, Optional

from alpa_job.errors import KitError
from alpa_job import strict_json

RUNS_ROOT = "runs"
LATEST = "latest"
RUN_META = "run.json"
CHECKPOINTS = "checkpoints"


LOCK = ".alpa_job.lock"
HEARTBEAT_S = 10.0  # how often the holder rewrites its lock
WATCH_S = 2.5 * HEARTBEAT_S  # an unchanged heartbeat watched this long: the holder on another host is gone
STALE_S = 300.0  # a heartbeat this old by this host's clock is stale at once (far beyond any sane clock skew)
SKIPPED = "checkpoints-skipped"  # damaged checkpoints set aside (train/checkpoint.py names it too)
FAILED_REPORT = "report.failed.json"


def checkpoint_dir(out: str) -> str:
    """Where a run directory keeps its orbax checkpoints."""
    return os.path.join(out, CHECKPOINTS)


REPORT_FILES = ("report.json", "report.md", "report.html", "train.log", "ray.log")


def _stamp(when: Optional[float] = None) -> str:
    moment = datetime.datetime.fromtimestamp(when, datetime.timezone.utc) if when else \
        datetime.datetime.now(datetime.timezone.utc)
    return moment.strftime("%Y%m%d-%H%M%S")


def new_run_dir(config, root: str = RUNS_ROOT) -> str:
    """runs/<UTC time>-<model>-<strategy>, unique (a suffix when two runs start in the same second)."""
    model = re.sub(r"[^\w.-]+", "-", config.model)  # PACKAGE.MODULE:FUNCTION has a colon
    base = os.path.join(root, f"{_stamp()}-{model}-{config.strategy}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def saved_config(out: str) -> Optional[Dict[str, Any]]:
    """The config of the run that wrote OUT: run.json, else report.json's `config` (older kits)."""
    for name, key in ((RUN_META, None), ("report.json", "config")):
        path = os.path.join(out, name)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                continue
            data = data.get(key) if key else data
            if isinstance(data, dict):
                return data
    return None


def check_out(config, explicit_out: bool) -> None:
    """Refuse an --out that would mix two runs, and a --resume with nothing (or another model) to resume."""
    from alpa_job.train.checkpoint_files import step_folders
    from alpa_job.settings.catalog import MODEL_FIELDS
    from alpa_job.settings.setting import flag_of

    out = config.out
    folders = step_folders(checkpoint_dir(out)) if out else []
    latest = folders[0] if folders else None
    if config.resume:
        if latest is None:
            raise KitError(f"--resume: no checkpoint in {checkpoint_dir(out)}; run once with "
                           "--checkpoint-every N into this --out first, or drop --resume")
        old = saved_config(out)
        if old is not None:
            fields = ("model",) + MODEL_FIELDS.get(config.model, ())
            differ = [f"{flag_of(f)} {old[f]} (now {getattr(config, f)})" for f in fields
                      if f in old and old[f] != getattr(config, f)]
            if old.get("model") == config.model:  # a model the user brings: its settings, key by key
                before, now = old.get("model_args") or {}, dict(config.model_args)
                differ += [f"--model-arg {k}={before.get(k)} (now {now.get(k)})" for k in sorted(set(before) | set(now))
                           if before.get(k) != now.get(k)]
            if differ:
                what = ", ".join(differ)
                raise KitError(f"--resume: the checkpoint in {out} is of another model: {what}; "
                               "resume with the same model settings or use another --out")
        _usable_checkpoint(out)
        return
    if latest is not None and not config.overwrite:
        raise KitError(f"--out {out} holds another run's checkpoints (steps up to {latest}); pass --resume to "
                       "continue that run, --overwrite to replace it, or another --out")
    reports = [name for name in REPORT_FILES + (RUN_META,) if out and os.path.isfile(os.path.join(out, name))]
    if reports and not config.overwrite and not _failed_before_first_step(out):
        raise KitError(f"--out {out} holds another run's report ({', '.join(reports)}); pass --overwrite to replace "
                       "it, or another --out")


def _failed_before_first_step(out: str) -> bool:
    """An earlier run here stopped before its first step (a wrong --address, a node that never came): its
    report holds nothing to lose, so rerunning the fixed command into the same --out is not refused."""
    try:
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(report, dict) or report.get("status") in (None, "ok") or report.get("steps"):
        return False
    from alpa_job import progress

    progress.display().line(f"[alpa_job] replacing the report in {out}: its run {report.get('status')} before its "
                            "first step", important=True)
    return True


def _usable_checkpoint(out: str) -> int:
    """The newest checkpoint that verifies; each newer one that does not is named and set aside (the
    loop then restores the same step, and this run's own saves never meet a damaged folder)."""
    from alpa_job import progress
    from alpa_job.train.checkpoint_files import scan, set_aside

    directory = checkpoint_dir(out)
    good, skipped = scan(directory)
    if not good:
        why = "; ".join(f"step {s.step}: {s.path}: {s.reason}" for s in skipped)
        raise KitError(f"--resume: no complete checkpoint in {directory} ({why}); start again with --overwrite, "
                       "or put back a good checkpoint")
    shown = progress.display()
    for skip in skipped:
        shown.line(skip.line(), important=True)
        if skip.step > good[0]:  # older damaged ones are orbax's to delete as it keeps its last few
            shown.line(f"[alpa_job] checkpoint step {skip.step} moved to {set_aside(directory, skip.step)}",
                       important=True)
    _RESUME_FROM[os.path.abspath(out)] = good[0]
    return good[0]


_RESUME_FROM: Dict[str, int] = {}


def resume_start(out: str) -> Optional[int]:
    """The step a --resume into `out` starts from, as the driver's checks found it (None: not a resume)."""
    return _RESUME_FROM.get(os.path.abspath(out))


def resolve_resume(config):
    """--resume auto (what a restarted job runs): --resume when --out holds a complete checkpoint, else a
    fresh run; a plain --resume stays a must."""
    if config.resume != "auto":
        return config
    from alpa_job.train.checkpoint_files import latest_complete_step

    return config.replace(resume=latest_complete_step(checkpoint_dir(config.out)) is not None)


def keep_earlier_reports(out: str) -> Optional[str]:
    """--resume auto with no checkpoint to resume starts fresh (a retried job that never saved): an earlier
    run's reports there are moved into OUT/earlier-<UTC time>/, never replaced. Returns that folder."""
    present = [n for n in REPORT_FILES + (RUN_META,) if os.path.isfile(os.path.join(out, n))]
    if not present:
        return None
    kept = os.path.join(out, f"earlier-{_stamp()}")
    os.makedirs(kept, exist_ok=True)
    for name in present:
        os.replace(os.path.join(out, name), os.path.join(kept, name))
    print(f"[alpa_job] --resume auto: no checkpoint in {out}, starting fresh; the earlier run's "
          f"{', '.join(present)} moved to {kept}", flush=True)
    return kept


def prepare(config, explicit_out: bool, root: str = RUNS_ROOT):
    """Resolve, check and create the run directory; returns the config with `out` set.

    Nothing is written into an existing run's folder until every check passed."""
    if not config.out:
        config = config.replace(out=new_run_dir(config, root))
    auto = config.resume == "auto"
    config = resolve_resume(config)
    out = config.out
    lock = RunLock.take(out) if os.path.isdir(out) else None  # before the checks: two runs never both pass them
    try:
        if auto and not config.resume:
            keep_earlier_reports(out)
        check_out(config, explicit_out)
        try:
            os.makedirs(out, exist_ok=True)
            probe = os.path.join(out, ".write-test")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as err:
            raise KitError(f"--out {out}: cannot write there ({err.strerror}); pass a writable folder") from None
        lock = lock or RunLock.take(out)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    if config.overwrite and not config.resume:
        shutil.rmtree(checkpoint_dir(out), ignore_errors=True)
        shutil.rmtree(os.path.join(out, SKIPPED), ignore_errors=True)
        for name in REPORT_FILES + (RUN_META, FAILED_REPORT):
            if os.path.isfile(os.path.join(out, name)):
                os.remove(os.path.join(out, name))
    if not config.resume or not os.path.isfile(os.path.join(out, RUN_META)):
        write_meta(out, config)
    if not explicit_out:
        point_latest(os.path.dirname(out) or ".", out)
    return config


def write_meta(out: str, config) -> None:
    tmp = os.path.join(out, RUN_META + ".tmp")
    with open(tmp, "w") as f:
        strict_json.dump(config.as_dict(), f, indent=2, default=str)
    os.replace(tmp, os.path.join(out, RUN_META))


def point_latest(root: str, run_dir: str) -> str:
    """root/latest -> run_dir (relative), replaced atomically; an old real `latest` folder is kept aside."""
    link = os.path.join(root, LATEST)
    if os.path.isdir(link) and not os.path.islink(link):
        os.rename(link, os.path.join(root, f"{_stamp(os.path.getmtime(link))}-previous-latest"))
    tmp = os.path.join(root, f".{LATEST}.{os.getpid()}")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.relpath(run_dir, root), tmp)
    os.replace(tmp, link)
    return link


# ----------------------------------------------------------------------------- one run per folder
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
            info = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
                    "pid_ns": _pid_namespace(), "started": _stamp(), "run_id": uuid.uuid4().hex[:12],
                    "heartbeat": time.time(), "beats": 0}
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
                    raise KitError(f"--out {out} is in use by another run: {_holder(holder)}; wait for it to end or "
                                   f"pass another --out (a lock whose run is gone is taken over: {path})")
                if _read_lock(path) == raw:  # still the stale one (another run may have taken it over just now)
                    os.remove(path)
                    from alpa_job import progress

                    progress.display().line(f"[alpa_job] took over the lock of a run that is gone ({why}): {path}",
                                            important=True)
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
    from alpa_job import progress

    progress.display().line(f"[alpa_job] --out is locked by {_holder(info)}; watching its heartbeat for up to "
                            f"{WATCH_S:.0f} s to see whether that run is alive", important=True)
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
