"""The plain-text table the bench scripts print and record (bench/RESULTS.md)."""

from __future__ import annotations

from typing import List, Sequence


def print_table(header: Sequence[str], rows: List[Sequence[object]]) -> str:
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    text = "\n".join(lines)
    print(text)
    return text
