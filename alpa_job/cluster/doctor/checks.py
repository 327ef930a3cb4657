"""The doctor's verdict lines, and the pure per-node checks that produce them (plain data in, plain data out).

Imports on the Alpa image's stack (Python 3.9): standard library only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Mapping, Optional, Sequence

from alpa_job.cluster.node_ip import ips_in_cidr

SHM_MIN_BYTES = 1 << 30  # NCCL (and Ray's plasma store) need /dev/shm; Docker's default is 64 MiB
# Compared on every node. cuda/nccl only among nodes that have them (a CPU-only head has neither).
VERSION_KEYS = ("python", "jax", "jaxlib", "ray", "alpa", "cuda", "nccl")
OPTIONAL_VERSION_KEYS = ("cuda", "nccl")


def check(name: str, node: Optional[str], ok: bool, detail: str, fix: str = "", warn: bool = False) -> Dict[str, Any]:
    """One line of the doctor's verdict. `warn`: passes, but worth reading."""
    return {"name": name, "node": node, "ok": bool(ok), "warn": bool(warn and ok), "detail": detail, "fix": fix}


def deadline_check(seconds: float, what: str) -> Dict[str, Any]:
    return check(
        "deadline",
        None,
        False,
        "the %.0f s deadline passed %s; the checks above are what is known" % (seconds, what),
        "raise --deadline, or fix the nodes named above",
    )


def check_node_ip(node: str, ray_ip: str, addresses: Mapping[str, Sequence[str]], cidr: str) -> List[Dict[str, Any]]:
    """Ray's IP of a node must be one of that host's addresses and lie in the cluster CIDR."""
    mine = sorted({ip for ips in addresses.values() for ip in ips})
    in_cidr = ips_in_cidr(mine, cidr)
    hint = in_cidr[0] if len(in_cidr) == 1 else "<its address in %s>" % cidr
    if ray_ip not in mine:
        return [
            check(
                "node_ip",
                node,
                False,
                "Ray IP %s is not an address of this host (its addresses: %s)" % (ray_ip, ", ".join(mine) or "none"),
                "restart it with --node-ip-address=%s" % hint,
            )
        ]
    if ray_ip not in in_cidr:
        return [
            check(
                "node_ip",
                node,
                False,
                "Ray IP %s is not in cluster CIDR %s (its addresses: %s)" % (ray_ip, cidr, ", ".join(mine)),
                "restart it with --node-ip-address=%s (python -m alpa_job.cluster.node_ip prints it)" % hint,
            )
        ]
    return [check("node_ip", node, True, "Ray IP %s is this host's address in %s" % (ray_ip, cidr))]


def compare_versions(per_node: Mapping[str, Mapping[str, Optional[str]]], prefer: Optional[str] = None) -> List[Dict[str, Any]]:
    """One check per package in VERSION_KEYS: equal on every node, else name the odd node(s).

    The reference value is the most common one (ties: `prefer`'s, i.e. the head's). A package missing
    on some nodes only is a skew too, except cuda/nccl, compared among the nodes that have them.
    """
    out = []
    for key in VERSION_KEYS:
        values = {node: (v or {}).get(key) for node, v in per_node.items()}
        if key in OPTIONAL_VERSION_KEYS:
            values = {n: v for n, v in values.items() if v is not None}
        if not values or all(v is None for v in values.values()):
            continue
        ref = _reference(values, prefer)
        odd = sorted(n for n, v in values.items() if v != ref)
        if not odd:
            out.append(check("versions", None, True, "%s %s on every node" % (key, ref)))
            continue
        out.extend(_skew(key, node, values, ref) for node in odd)
    return out


def _reference(values: Mapping[str, Optional[str]], prefer: Optional[str]) -> Optional[str]:
    """The most common value; among tied ones `prefer`'s node's, else the first in sort order."""
    counts = Counter(values.values())
    best = max(counts.values())
    tied = [v for v, c in counts.items() if c == best]
    return values[prefer] if prefer in values and values[prefer] in tied else sorted(tied, key=str)[0]


def _skew(key: str, node: str, values: Mapping[str, Optional[str]], ref: Optional[str]) -> Dict[str, Any]:
    return check(
        "versions",
        node,
        False,
        "%s %s here, %s on %s"
        % (key, values[node] or "missing", ref or "missing", ", ".join(n for n in sorted(values) if values[n] == ref)),
        "install %s %s on %s (one image for every node)" % (key, ref, node)
        if ref
        else "remove %s from %s or install it everywhere (one image for every node)" % (key, node),
    )


def check_shm(node: str, shm: Mapping[str, Any], gpus: int) -> Dict[str, Any]:
    size = shm.get("bytes")
    if size is None:
        return check(
            "shm",
            node,
            gpus == 0,
            "/dev/shm missing (%s)" % shm.get("error", "?"),
            "mount a tmpfs on /dev/shm (docker --shm-size=8g or --ipc=host)",
            warn=True,
        )
    text = "/dev/shm %s" % gib(size)
    if size >= SHM_MIN_BYTES:
        return check("shm", node, True, text)
    # NCCL fails with "posix_fallocate ... No space left" on a small /dev/shm: fatal with GPUs.
    return check(
        "shm",
        node,
        gpus == 0,
        "%s, below %s%s" % (text, gib(SHM_MIN_BYTES), "" if gpus else " (no GPUs here: Ray's object store falls back to disk)"),
        "give the node a larger /dev/shm (docker --shm-size=8g or --ipc=host)",
        warn=True,
    )


def check_gpus(node: str, gpu: Mapping[str, Any], ray_gpus: float) -> Dict[str, Any]:
    seen = gpu.get("count")
    text = "%s GPU(s) by %s, Ray resource GPU=%g" % (seen if seen is not None else "?", gpu.get("source"), ray_gpus)
    if seen and int(ray_gpus) != seen:
        return check("gpus", node, False, text, "restart Ray on %s with --num-gpus=%d" % (node, seen))
    return check("gpus", node, True, text)


def gib(n: float) -> str:
    return "%.1f GiB" % (n / float(1 << 30)) if n >= (1 << 30) else "%d MiB" % (n // (1 << 20))
