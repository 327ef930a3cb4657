"""What a checkpoints folder holds, read without orbax: which step folders are complete, and why not.

A step folder counts as complete only when it verifies (`verify_step`): orbax's commit marker, its
metadata files readable, and, once the save has finished, every file at the size the save wrote
(FILES, written beside them by process 0 when the save is sealed), so a truncated array file is caught
before anything restores it. The driver (before Ray, to decide whether a restart resumes) and the
training loop (to restore) read the same verdict.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import stat
from typing import Dict, List, Optional, Tuple

COMMIT_MARKER = "commit_success.txt"  # orbax writes it last, just before the rename to <step>
STEP_METADATA = "_CHECKPOINT_METADATA"
FILES = "alpa_job.files.json"  # every file of a finished save and its size
TMP_MARK = ".orbax-checkpoint-tmp"
SKIPPED_DIR = "checkpoints-skipped"  # beside the checkpoints folder: orbax never lists it
ITEM_METADATA = {"state": "_METADATA", "default": "_METADATA", "data": "metadata"}


@dataclasses.dataclass
class Skipped:
    """A checkpoint `--resume` could not use, and why."""

    step: int
    path: str  # the file (or folder) at fault
    reason: str

    def line(self) -> str:
        return f"[alpa_job] checkpoint step {self.step} skipped: {self.path}: {self.reason}"


def _read_json(path: str) -> Optional[str]:
    """None when `path` holds JSON, else why not."""
    try:
        with open(path) as f:
            json.load(f)
    except FileNotFoundError:
        return "missing"
    except (OSError, ValueError, UnicodeDecodeError) as err:
        return (
            f"unreadable ({type(err).__name__}: {str(err)[:120]})"
            if not isinstance(err, ValueError)
            else f"not valid JSON ({os.path.getsize(path) if os.path.exists(path) else 0} bytes; truncated?)"
        )
    return None


def verify_step(step_dir: str) -> Optional[Tuple[str, str]]:
    """(file, reason) of the first thing that makes this step folder unusable, or None when it is complete."""
    if not os.path.isfile(os.path.join(step_dir, COMMIT_MARKER)):
        return os.path.join(step_dir, COMMIT_MARKER), "missing: the save never committed"
    problem = _read_json(os.path.join(step_dir, STEP_METADATA))
    if problem and problem != "missing":  # orbax before 0.5 wrote none
        return os.path.join(step_dir, STEP_METADATA), problem
    items = [name for name in ITEM_METADATA if os.path.isdir(os.path.join(step_dir, name))]
    if "state" not in items and "default" not in items:
        return os.path.join(step_dir, "state"), "missing: no train state in this checkpoint"
    for item in items:
        path = os.path.join(step_dir, item, ITEM_METADATA[item])
        problem = _read_json(path)
        if problem:
            return path, problem
    sizes = _saved_sizes(step_dir)
    for rel, size in sizes.items():
        path = os.path.join(step_dir, rel)
        try:
            now = os.path.getsize(path)
        except OSError:
            return path, "missing (listed in the save's file list)"
        if now != size:
            return path, f"{now} bytes, the save wrote {size} (truncated or overwritten)"
    return None


def _saved_sizes(step_dir: str) -> Dict[str, int]:
    try:
        with open(os.path.join(step_dir, FILES)) as f:
            sizes = json.load(f)["files"]
        return {str(k): int(v) for k, v in sizes.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}  # a save not sealed yet (or by an older kit): the metadata checks stand alone


def step_folders(directory: str) -> List[int]:
    """Every step folder under `directory`, newest first, complete or not (a save in flight or killed
    mid-way is still a `*.orbax-checkpoint-tmp*` folder and is not listed)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted((int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n))), reverse=True)


def scan(directory: str) -> Tuple[List[int], List[Skipped]]:
    """(the complete steps, newest first; the step folders that do not verify, each with the reason)."""
    good: List[int] = []
    skipped: List[Skipped] = []
    for step in step_folders(directory):
        problem = verify_step(os.path.join(directory, str(step)))
        if problem is None:
            good.append(step)
        else:
            skipped.append(Skipped(step, *problem))
    return good, skipped


def latest_complete_step(directory: str) -> Optional[int]:
    """The highest step saved completely under `directory` (verified as `verify_step` does), or None."""
    good, _ = scan(directory)
    return good[0] if good else None


def set_aside(directory: str, step: int) -> str:
    """Move a damaged step folder out of orbax's sight (kept for a look, never deleted); returns where."""
    aside = os.path.join(os.path.dirname(os.path.abspath(directory)), SKIPPED_DIR)
    os.makedirs(aside, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    target = os.path.join(aside, f"{step}-{stamp}")
    n = 1
    while os.path.exists(target):
        n += 1
        target = os.path.join(aside, f"{step}-{stamp}-{n}")
    os.rename(os.path.join(directory, str(step)), target)
    return target


def _files_and_disk_bytes(path: str) -> Tuple[Dict[str, int], int]:
    """One walk of `path`: every file (relative) and its length, and what the folder takes on its disk: every
    file's and folder's allocated blocks, or a file's length where the file system reports fewer. A save of many
    small files takes far more than their lengths (each rounds up to a block), and the free-space check must
    count what a save will take, not what its files hold."""
    sizes: Dict[str, int] = {}
    total = 0
    for root, dirs, files in os.walk(path):
        for name in [root] + [os.path.join(root, n) for n in dirs + files]:
            try:
                st = os.lstat(name)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                sizes[os.path.relpath(name, path)] = st.st_size
            total += _on_disk(st)
    return sizes, total


def _on_disk(st: os.stat_result) -> int:
    """A file's or folder's allocated blocks, or a file's length where the file system reports fewer."""
    return max(st.st_blocks * 512, 0 if stat.S_ISDIR(st.st_mode) else st.st_size)


def disk_bytes(path: str) -> int:
    """What the folder takes on its disk (`_files_and_disk_bytes`)."""
    return _files_and_disk_bytes(path)[1]


def seal(step_dir: str) -> int:
    """Write FILES (every file of a finished save and its size) into the step folder; returns what the save
    takes on its disk (`disk_bytes`, FILES included), from the walk that listed the files."""
    found, total = _files_and_disk_bytes(step_dir)
    sizes = {k: v for k, v in found.items() if k != FILES}
    tmp = os.path.join(step_dir, FILES + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": sizes}, f)
    written = os.path.join(step_dir, FILES)
    os.replace(tmp, written)
    return total + _on_disk(os.lstat(written))
