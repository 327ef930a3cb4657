"""The run record as a file: assemble it from the processes' results, serialise it, read it back.

Training returns `ProcessResult`s; this module merges them into the `RunRecord` the user reads
(report.json is `RunRecord.to_dict()`). Rendering it (report.md, report.html, plots) is the readers'
job (`alpa_job.inspect.write`). Nothing here imports an engine, so `inspect` works anywhere.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Iterable, List, Optional

from alpa_job.errors import KitError
from alpa_job.record.run_record import RunRecord
from alpa_job import strict_json

REPORT_FILE = "report.json"


def created_now() -> str:
    """A record's `created`: now, UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def build_report(config, results: Iterable[Any], address: Optional[str] = None) -> RunRecord:
    """Merge per-process results (ProcessResult, or the plain dicts of older producers) into one record."""
    return RunRecord.from_processes(results, config.as_dict(), created=created_now(), address=address)


def failed_report(
    config,
    engine: str,
    status: str,
    error: str,
    steps_done: int,
    address: Optional[str] = None,
    losses: Optional[List[float]] = None,
    restarts: Optional[list] = None,
) -> RunRecord:
    """The record of a run that stopped part-way: what was asked, how far it got, and why it stopped
    (`losses`: those it read back, where the error carried them: a diverged run's curve; `restarts`: those
    it did before it failed)."""
    from alpa_job import versions

    record = RunRecord(
        engine=engine,
        strategy=config.strategy,
        requested_strategy=config.strategy,
        steps=int(steps_done or 0),
        config=config.as_dict(),
        created=created_now(),
        address=address,
        status=status,
        error=error,
        versions=versions.collect(),
        losses=list(losses or []),
        restarts=list(restarts or []),
    )
    record.summary = record.summarize()
    return record


def report_json(record: RunRecord) -> str:
    return strict_json.dumps(record.to_dict(), indent=2, sort_keys=False, default=str)


def load_report(run_dir: str) -> RunRecord:
    """The RunRecord of a run directory (or a report.json path)."""
    path = os.path.join(run_dir, REPORT_FILE) if os.path.isdir(run_dir) else run_dir
    if not os.path.isfile(path):
        raise KitError(
            f"{run_dir}: no {REPORT_FILE}; point inspect at a run directory (the --out of a train run) or at an Alpa dump_debug_info folder"
        )
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise KitError(f"{path}: not valid JSON (line {err.lineno}); re-run the job or restore the file") from None
    return RunRecord.from_dict(data, where=path)
