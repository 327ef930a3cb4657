"""Is --out one directory that every JAX process sees? (checkpoints across hosts need that)

Each process writes a probe file `<out>/.alpa_job-probes/<token>/<index>` holding its host name, then
every process reads them all. Orbax's multi-process save has every process write its shards under one
directory and process 0 rename it into place: on a directory that is only local to each host, the
checkpoint would be silently incomplete (and a restart would restore nothing). Checked before training.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, List, Sequence

from alpa_job.errors import KitError

PROBE_DIR = ".alpa_job-probes"


def probe_path(out: str, token: str) -> str:
    return os.path.join(os.path.abspath(out), PROBE_DIR, token)


def write_probe(out: str, token: str, index: int, host: str) -> None:
    """Run in process `index`: leave a file the others must see."""
    folder = probe_path(out, token)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, "%d.tmp" % index)
    with open(tmp, "w") as f:
        f.write(host)
    os.replace(tmp, os.path.join(folder, str(index)))


def missing_probes(out: str, token: str, count: int) -> List[int]:
    """Run in every process: the indices whose probe file this process cannot see."""
    folder = probe_path(out, token)
    return [i for i in range(count) if not os.path.isfile(os.path.join(folder, str(i)))]


def check_shared(out: str, seen: Dict[int, List[int]], hosts: Sequence[str]) -> None:
    """`seen`: process index -> the probe indices it could NOT see. A one-line KitError naming the host(s)
    whose view of --out differs from process 0's (the driver's node: where the report is written)."""
    odd = sorted(i for i in seen if i != 0 and (0 in seen[i] or i in seen.get(0, [])))
    if not odd:  # process 0 agrees with everyone: name whoever else misses a file
        odd = sorted(i for i in seen if i != 0 and set(seen[i]) - {i})
    if odd:
        names = ", ".join("%s (process %d)" % (hosts[i], i) for i in odd)
        raise KitError(
            "--out %s is not one shared directory: on host %s it is a different folder than on host %s "
            "(probe files written there are not seen by the others); checkpoints across hosts need a "
            "directory every node mounts (NFS, a shared volume): pass --out on it" % (out, names, hosts[0])
        )


def remove_probes(out: str, token: str) -> None:
    shutil.rmtree(probe_path(out, token), ignore_errors=True)
    try:
        os.rmdir(os.path.join(os.path.abspath(out), PROBE_DIR))
    except OSError:  # another run's probes, or already gone
        pass
