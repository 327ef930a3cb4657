"""Where a run writes: one directory per run, never another run's files (nothing is lost).

Without --out a run gets runs/<UTC time>-<model>-<strategy>/ and runs/latest becomes a symlink to it
(replaced atomically; a real runs/latest folder from an older kit is moved aside under its own time).
An explicit --out that already holds checkpoints belongs to another run: it is refused unless --resume
(continue it: the checkpoint must exist and be of the same model) or --overwrite (its checkpoints and
reports are removed first); --resume auto is --resume when a complete checkpoint is there, else a new run. The
folder is created and probed for writing before Ray starts, and run.json (the job config) is written into it
so a later --resume can tell which model it holds. A folder that holds only an earlier run's reports
(report.json, train.log, run.json, no checkpoints) is refused the same way: --overwrite replaces them,
--resume needs a checkpoint.

One run per folder: the driver holds a lock on --out from the checks until it exits (run_lock.py).

--resume uses the newest checkpoint that verifies (train/checkpoint.py); each newer one that does not
is named (step, file, reason) and moved to OUT/checkpoints-skipped/, so the driver's view of the
latest step (the controller's too) is the one the loop restores.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Dict, Optional

from alpa_job.errors import KitError
from alpa_job import strict_json
from alpa_job.train.run_lock import RunLock, release, utc_stamp  # noqa: F401 - the run's end calls rundir.release

RUNS_ROOT = "runs"
LATEST = "latest"
RUN_META = "run.json"
CHECKPOINTS = "checkpoints"
SKIPPED = "checkpoints-skipped"  # damaged checkpoints set aside (train/checkpoint.py names it too)
FAILED_REPORT = "report.failed.json"
TENSORBOARD = "tensorboard"  # the run's TensorBoard event files (train/metrics_log.py)
# The metrics folders a run writes: an earlier run's go with its reports (--overwrite, --resume auto
# starting fresh), so a new run's curves never join the old ones in one TensorBoard run.
METRICS_DIRS = (TENSORBOARD, "mlruns", "wandb")


def checkpoint_dir(out: str) -> str:
    """Where a run directory keeps its orbax checkpoints."""
    return os.path.join(out, CHECKPOINTS)


REPORT_FILES = ("report.json", "report.md", "report.html", "train.log", "ray.log")


def new_run_dir(config, root: str = RUNS_ROOT) -> str:
    """runs/<UTC time>-<model>-<strategy>, unique (a suffix when two runs start in the same second)."""
    model = re.sub(r"[^\w.-]+", "-", config.model)  # PACKAGE.MODULE:FUNCTION has a colon
    base = os.path.join(root, f"{utc_stamp()}-{model}-{config.strategy}")
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
    from alpa_job.models import model_values
    from alpa_job.train.checkpoint_files import step_folders

    out = config.out
    folders = step_folders(checkpoint_dir(out)) if out else []
    latest = folders[0] if folders else None
    if config.resume:
        if latest is None:
            raise KitError(
                f"--resume: no checkpoint in {checkpoint_dir(out)}; run once with "
                "--checkpoint-every N into this --out first, or drop --resume"
            )
        old = saved_config(out)
        if old is not None:
            differ = [f"--model {old['model']} (now {config.model})"] if old.get("model", config.model) != config.model else []
            if not differ:  # the model's settings, key by key, each with its defaults filled in
                before, now = _saved_model_values(old, config), model_values(config)
                differ += [
                    f"{_spelling(config.model, k, before.get(k))} (now {now.get(k)})"
                    for k in sorted(set(before) | set(now))
                    if before.get(k) != now.get(k)
                ]
            if differ:
                what = ", ".join(differ)
                raise KitError(
                    f"--resume: the checkpoint in {out} is of another model: {what}; "
                    "resume with the same model settings or use another --out"
                )
        start = _usable_checkpoint(out)
        if config.steps is not None and start > config.steps:
            raise KitError(
                f"--resume: the checkpoint in {out} is at step {start}, already past --steps "
                f"{config.steps}; pass --steps above {start} to train on"
            )
        return
    if latest is not None and not config.overwrite:
        raise KitError(
            f"--out {out} holds another run's checkpoints (steps up to {latest}); pass --resume to "
            "continue that run, --overwrite to replace it, or another --out"
        )
    reports = [name for name in REPORT_FILES + (RUN_META,) if out and os.path.isfile(os.path.join(out, name))]
    if reports and not config.overwrite and not _failed_before_first_step(out):
        raise KitError(f"--out {out} holds another run's report ({', '.join(reports)}); pass --overwrite to replace it, or another --out")


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
    from alpa_job.progress.events import display

    display().line(f"[alpa_job] replacing the report in {out}: its run {report.get('status')} before its first step", important=True)
    return True


def _usable_checkpoint(out: str) -> int:
    """The newest checkpoint that verifies; each newer one that does not is named and set aside (the
    loop then restores the same step, and this run's own saves never meet a damaged folder)."""
    from alpa_job.progress.events import display
    from alpa_job.train.checkpoint_files import scan, set_aside

    directory = checkpoint_dir(out)
    good, skipped = scan(directory)
    if not good:
        why = "; ".join(f"step {s.step}: {s.path}: {s.reason}" for s in skipped)
        raise KitError(
            f"--resume: no complete checkpoint in {directory} ({why}); start again with --overwrite, or put back a good checkpoint"
        )
    shown = display()
    for skip in skipped:
        shown.line(skip.line(), important=True)
        if skip.step > good[0]:  # older damaged ones are orbax's to delete as it keeps its last few
            shown.line(f"[alpa_job] checkpoint step {skip.step} moved to {set_aside(directory, skip.step)}", important=True)
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
    kept = os.path.join(out, f"earlier-{utc_stamp()}")
    os.makedirs(kept, exist_ok=True)
    present += [n for n in METRICS_DIRS if os.path.isdir(os.path.join(out, n))]
    for name in present:
        os.replace(os.path.join(out, name), os.path.join(kept, name))
    print(
        f"[alpa_job] --resume auto: no checkpoint in {out}, starting fresh; the earlier run's {', '.join(present)} moved to {kept}",
        flush=True,
    )
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
        for name in METRICS_DIRS:
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
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
        os.rename(link, os.path.join(root, f"{utc_stamp(os.path.getmtime(link))}-previous-latest"))
    tmp = os.path.join(root, f".{LATEST}.{os.getpid()}")
    if os.path.lexists(tmp):
        os.remove(tmp)
    os.symlink(os.path.relpath(run_dir, root), tmp)
    os.replace(tmp, link)
    return link


def _saved_model_values(old: dict, config) -> dict:
    """The model settings a saved run used, typed like the new run's (a run written before the built-ins'
    sizes moved into model_args has them at the top level)."""
    from alpa_job.models import model_values, size_names

    given = {name: old[name] for name in size_names() if name in old}
    given.update(old.get("model_args") or {})
    try:
        return dict(model_values(config.replace(model_args=given)))
    except KitError:  # settings the model no longer declares: compare them as written
        return given


def _spelling(model: str, name: str, value: Any) -> str:
    """A model setting's value as the command line gives it: a built-in's own flag, else --model-arg."""
    from alpa_job.models import is_built_in
    from alpa_job.setting import flag_of

    return f"{flag_of(name)} {value}" if is_built_in(model) else f"--model-arg {name}={value}"
