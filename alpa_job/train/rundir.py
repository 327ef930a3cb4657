"""Where a run writes: one directory per run, never another run's files (nothing is lost).

Without --out a run gets runs/<UTC time>-<model>-<strategy>/ and runs/latest becomes a symlink to it
(replaced atomically; a real runs/latest folder from an older kit is moved aside under its own time).
An explicit --out that already holds checkpoints belongs to another run: it is refused unless --resume
(continue it: the checkpoint must exist and be of the same model) or --overwrite (its checkpoints and
reports are removed first); --resume auto is --resume when a complete checkpoint is there, else a new run. The folder is created and probed for writing before Ray starts, and
run.json (the job config) is written into it so a later --resume can tell which model it holds.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shutil
from typing import Any, Dict, Optional

from alpa_job.errors import KitError

RUNS_ROOT = "runs"
LATEST = "latest"
RUN_META = "run.json"
CHECKPOINTS = "checkpoints"


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
    from alpa_job.train.checkpoint import latest_complete_step
    from alpa_job.settings.catalog import MODEL_FIELDS
    from alpa_job.settings.setting import flag_of

    out = config.out
    latest = latest_complete_step(checkpoint_dir(out)) if out else None
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
        return
    if latest is not None and not config.overwrite:
        raise KitError(f"--out {out} holds another run's checkpoints (steps up to {latest}); pass --resume to "
                       "continue that run, --overwrite to replace it, or another --out")


def resolve_resume(config):
    """--resume auto (what a restarted job runs): --resume when --out holds a complete checkpoint, else a
    fresh run; a plain --resume stays a must."""
    if config.resume != "auto":
        return config
    from alpa_job.train.checkpoint import latest_complete_step

    return config.replace(resume=latest_complete_step(checkpoint_dir(config.out)) is not None)


def prepare(config, explicit_out: bool, root: str = RUNS_ROOT):
    """Resolve, check and create the run directory; returns the config with `out` set.

    Nothing is written into an existing run's folder until every check passed."""
    if not config.out:
        config = config.replace(out=new_run_dir(config, root))
    config = resolve_resume(config)
    check_out(config, explicit_out)
    out = config.out
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".write-test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise KitError(f"--out {out}: cannot write there ({err.strerror}); pass a writable folder") from None
    if config.overwrite and not config.resume:
        shutil.rmtree(checkpoint_dir(out), ignore_errors=True)
        for name in REPORT_FILES + (RUN_META,):
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
        json.dump(config.as_dict(), f, indent=2, default=str)
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
