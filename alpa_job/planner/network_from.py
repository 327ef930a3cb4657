"""`plan --network-from FILE`: the network figure a plan uses, read from `doctor --network --format json`'s
result instead of typed in. The doctor measures each link between two nodes; the plan's network term is per
GPU, so a node's link is shared by its GPUs (a cluster with a NIC per GPU has more than this: say so with
--network-gbps)."""

from __future__ import annotations

import json
from typing import Tuple

from alpa_job.errors import KitError


def network_gbps_from(path: str, gpus_per_node: int) -> Tuple[float, str]:
    """(Gb/s per GPU, the plan's assumption line saying where it came from)."""
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as err:
        raise KitError(
            f"--network-from {path}: cannot read it ({err.strerror}); write it with python -m alpa_job "
            "doctor --network --format json > FILE"
        ) from None
    except ValueError:
        raise KitError(
            f"--network-from {path} is not JSON; write it with python -m alpa_job doctor --network --format json > FILE"
        ) from None
    network = result.get("network") if isinstance(result, dict) else None
    median = (network or {}).get("median_gbps")
    if not network:
        raise KitError(
            f"--network-from {path} holds no link measurements: run the doctor with --network "
            "(python -m alpa_job doctor --network --format json > FILE)"
        )
    if not median:
        raise KitError(
            f"--network-from {path}: the doctor measured no link ({network.get('directions', 0)} tried); "
            "fix what its checks name and run it again"
        )
    per_gpu = median / gpus_per_node
    line = (
        f"network {per_gpu:.3g} Gb/s per GPU: the median of {network.get('measured')} node-to-node links the doctor "
        f"measured ({median:.3g} Gb/s, slowest {network.get('min_gbps'):.3g}; {path}) shared by {gpus_per_node} "
        "GPU(s) a node"
    )
    return per_gpu, line
