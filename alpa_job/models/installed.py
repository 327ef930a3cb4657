"""Models that installed packages expose through the `alpa_job.models` entry-point group.

A package declares `[project.entry-points."alpa_job.models"] llama = "llama_example.model:build"`;
`--model llama` then trains it. Only the packages' metadata is read here (no target is imported), so
`--help` and the checks before Ray can list them without importing jax.
"""

from __future__ import annotations

from typing import Dict

GROUP = "alpa_job.models"


def installed_models() -> Dict[str, str]:
    """Entry-point name -> `MODULE:FUNCTION`, sorted by name (the first dist wins a repeated name)."""
    from importlib import metadata

    found = metadata.entry_points()
    if hasattr(found, "select"):  # Python 3.10+
        points = found.select(group=GROUP)
    else:  # Python 3.9: a dict of group -> entry points
        points = found.get(GROUP, ())
    out: Dict[str, str] = {}
    for point in points:
        out.setdefault(point.name, point.value)
    return dict(sorted(out.items()))
