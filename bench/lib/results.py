"""The bench's one result writer: every script's numbers go to a JSON file NAME-<time>.json, in
bench/results or the folder the script was given (a GPU machine's $OUT), with the command that produced
them; the scripts run on this machine also append their table to bench/RESULTS.md.

- ``record``: a result as {name, created, command, machine, results}, plus a section in RESULTS.md;
- ``save_run``: the same JSON without the RESULTS.md section (for a script told where to write);
- ``save_result``: a GPU script's result: the device and JAX version beside the result's own fields;
- ``write_json`` / ``result_path``: a script whose JSON has a shape of its own, or a file beside it;
- ``append_row``: one JSON line per finished case, so a campaign cut short keeps what it measured;
- ``append_to_results_md``: a RESULTS.md section in a script's own words.

Each script keeps its own file names and JSON fields: RESULTS.md and other files cite them.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Dict, Optional, Sequence

BENCH_DIR = Path(__file__).resolve().parents[1]
RESULTS_DIR = BENCH_DIR / "results"
RESULTS_MD = BENCH_DIR / "RESULTS.md"
_ROOT = BENCH_DIR.parent  # commands are written as typed from here

_MACHINE_FACTS = {
    "host": platform.node,
    "cpus": os.cpu_count,
    "python": platform.python_version,
    "kernel": platform.release,
    "loadavg_1m": lambda: round(os.getloadavg()[0], 2),  # the machine may be shared: say how busy it was
}


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def machine(*facts: str) -> Dict[str, object]:
    """The machine the numbers come from: host, cpus, python, loadavg_1m unless other facts are named
    (any of those and kernel)."""
    return {name: _MACHINE_FACTS[name]() for name in facts or ("host", "cpus", "python", "loadavg_1m")}


def command(python: str = "python", args: Optional[Sequence[str]] = None, script: Optional[str] = None) -> str:
    """The command that ran the script, as typed from the checkout's root: `python bench/NAME.py ARGS`
    (``args``: the arguments when main() was given its own, else the command line's)."""
    path = os.path.relpath(os.path.abspath(script or sys.argv[0]), _ROOT)
    return " ".join(shlex.quote(a) for a in [python, path, *(sys.argv[1:] if args is None else args)])


def result_path(name: str, out_dir: Optional[str] = None, stamp: Optional[str] = None, suffix: str = ".json") -> Path:
    """OUT/NAME-<stamp><suffix> (OUT: ``out_dir``, else bench/results), its folder made."""
    folder = Path(out_dir) if out_dir else RESULTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}-{stamp or utc_stamp()}{suffix}"


def write_json(name: str, payload: dict, out_dir: Optional[str] = None, stamp: Optional[str] = None) -> str:
    """``payload`` to OUT/NAME-<stamp>.json (see result_path); returns the path."""
    path = result_path(name, out_dir, stamp)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return str(path)


def append_row(path: str, row: dict) -> None:
    """One more JSON line in ``path`` (written at once: what was measured survives a later crash)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def append_to_results_md(section: str) -> None:
    with open(RESULTS_MD, "a") as f:
        f.write(section)


def _run_payload(name: str, results: Dict[str, object], stamp: str) -> dict:
    return {"name": name, "created": stamp, "command": command(), "machine": machine(), "results": results}


def save_run(name: str, results: Dict[str, object], out_dir: Optional[str] = None) -> str:
    """{name, created, command, machine, results} to OUT/NAME-<UTC time>.json; returns the path."""
    stamp = utc_stamp()
    return write_json(name, _run_payload(name, results, stamp), out_dir, stamp)


def record(name: str, results: Dict[str, object], table: str, title: str) -> str:
    """save_run to bench/results, and a section in RESULTS.md with the title, the command, the machine,
    the raw file and the table; returns the JSON's path."""
    stamp = utc_stamp()
    payload = _run_payload(name, results, stamp)
    path = write_json(name, payload, stamp=stamp)
    append_to_results_md(
        f"\n## {title} ({stamp})\n\nCommand: `{payload['command']}`  \n"
        f"Machine: {json.dumps(payload['machine'])}  \n"
        f"Raw: `bench/results/{os.path.basename(path)}`\n\n```\n{table}\n```\n"
    )
    return path


def save_result(name: str, out: str, result: dict) -> str:
    """A GPU script's result + the device, the JAX version and the command, to OUT/NAME-<UTC time>.json;
    returns the path."""
    import jax  # the GPU scripts' own dependency: the other scripts never load it

    payload = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, **result, "command": command("python3")}
    return write_json(name, payload, out)
