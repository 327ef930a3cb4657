"""Shared bits of the benchmark scripts: machine facts, a table printer, and result recording."""
from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from typing import Dict, List, Sequence

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))


def machine() -> Dict[str, object]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def print_table(header: Sequence[str], rows: List[Sequence[object]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    print(text)
    return text


def record(name: str, results: Dict[str, object], table: str, title: str) -> str:
    """Save results/<name>-<time>.json and append a section to RESULTS.md with the command."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], os.path.dirname(BENCH_DIR))] + sys.argv[1:])
    payload = {"name": name, "created": stamp, "command": command, "machine": machine(), "results": results}
    os.makedirs(os.path.join(BENCH_DIR, "results"), exist_ok=True)
    path = os.path.join(BENCH_DIR, "results", f"{name}-{stamp}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    with open(os.path.join(BENCH_DIR, "RESULTS.md"), "a") as f:
        f.write(f"\n## {title} ({stamp})\n\nCommand: `{command}`  \nMachine: {json.dumps(payload['machine'])}  \n"
                f"Raw: `bench/results/{os.path.basename(path)}`\n\n```\n{table}\n```\n")
    return path
