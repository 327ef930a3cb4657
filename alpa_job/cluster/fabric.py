"""The fabric NCCL's collectives cross between nodes, as cluster.yaml's `network:` section declares it.

Declared once, rendered everywhere: `nccl_env()` is the NCCL environment every runtime sets (Ansible's
containers and processes, the KubeRay pods), and tests hold each of them to it. Sockets are a choice
too: `fabric: ethernet` renders NCCL_IB_DISABLE=1, so NCCL never probes for an HCA it was not given.
Every fabric also renders `socket_env()`, the settings of NCCL's socket transport (NCCL_SOCKET_NTHREADS,
NCCL_NSOCKS_PERTHREAD, and the chunk of its point-to-point sends, NCCL_P2P_NET_CHUNKSIZE): sockets carry the
data on ethernet, and on ib/roce whenever NCCL falls back to them. `apply_socket_defaults()` sets those in a
process's own environment where nothing set them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, MutableMapping, Optional

from alpa_job.errors import KitError

# ib: InfiniBand; roce: RDMA over Converged Ethernet (NCCL's IB transport over an Ethernet HCA);
# ethernet: plain TCP sockets.
FABRICS = ("ib", "roce", "ethernet")
RDMA_FABRICS = ("ib", "roce")

# NCCL_IB_HCA's grammar: an optional `^` (exclude) or `=` (exact names), then `device[:port]`, comma-separated.
_HCA_LIST = re.compile(r"[\^=]?[A-Za-z0-9_.-]+(:[0-9]+)?(,[A-Za-z0-9_.-]+(:[0-9]+)?)*")

# NCCL's socket transport defaults to one helper thread with one socket per connection, and a single TCP
# stream cannot fill a fast link. These are NCCL's documented recommendation for generic 100G networks;
# their product may not exceed 64. They affect the socket transport only, so every fabric gets them.
SOCKET_NTHREADS = 4
NSOCKS_PERTHREAD = 4
# The chunk a point-to-point send (a pipeline's hand-off between stages) moves through the network
# transport in one step; NCCL's default is 128 KiB. Over sockets 512 KiB sends a permute of 16 MiB in less
# than half the time. It is a setting of NCCL's network p2p path, so it also applies over InfiniBand, where
# the kit has not measured it (a value in the environment wins, as for the others).
P2P_NET_CHUNKSIZE = 512 * 1024


@dataclass(frozen=True)
class NetworkSpec:
    """cluster.yaml's `network:` section, validated. Build it with `network_from_dict()`."""

    fabric: str
    # The bandwidth the operator declares for each node's link, in Gbit/s; 0 means unknown. Nothing
    # here measures it: it is the figure a measured bandwidth is compared against.
    gbps: float
    # NCCL_IB_HCA: which HCAs (and ports) NCCL uses; "" lets NCCL take every one it finds.
    ib_hca: str
    # NCCL_IB_GID_INDEX (RoCE only): which GID of the port carries RoCE v2; None keeps NCCL's default.
    ib_gid_index: Optional[int]

    @property
    def rdma(self) -> bool:
        """Whether NCCL's IB transport is used, so runtimes must hand the RDMA devices to Ray's workers."""
        return self.fabric in RDMA_FABRICS

    def nccl_env(self) -> Dict[str, str]:
        """The NCCL environment for this fabric; the only place these variables are decided."""
        return dict(self.fabric_env(), **self.socket_env())

    def fabric_env(self) -> Dict[str, str]:
        """NCCL's transport choice: sockets for ethernet, the IB transport (on the declared HCAs) for ib/roce."""
        if not self.rdma:
            return {"NCCL_IB_DISABLE": "1"}
        env = {"NCCL_IB_DISABLE": "0"}
        if self.ib_hca:
            env["NCCL_IB_HCA"] = self.ib_hca
        if self.fabric == "roce" and self.ib_gid_index is not None:
            env["NCCL_IB_GID_INDEX"] = str(self.ib_gid_index)
        return env

    def socket_env(self) -> Dict[str, str]:
        return socket_env()

    def as_dict(self) -> Dict[str, Any]:
        return {"fabric": self.fabric, "gbps": self.gbps, "ib_hca": self.ib_hca, "ib_gid_index": self.ib_gid_index}


def socket_env() -> Dict[str, str]:
    """NCCL's socket transport settings, the same on every fabric (they matter wherever sockets carry data)."""
    return {
        "NCCL_SOCKET_NTHREADS": str(SOCKET_NTHREADS),
        "NCCL_NSOCKS_PERTHREAD": str(NSOCKS_PERTHREAD),
        "NCCL_P2P_NET_CHUNKSIZE": str(P2P_NET_CHUNKSIZE),
    }


def apply_socket_defaults(environ: MutableMapping[str, str] = os.environ) -> Dict[str, str]:
    """Set each of socket_env() that `environ` lacks, before NCCL starts; returns what it set.

    A value already there (the user's, or the node's runtime) wins: this fills gaps, it never overrides.
    No cluster spec is read: the settings are the same for every fabric.
    """
    added = {key: value for key, value in socket_env().items() if key not in environ}
    environ.update(added)
    return added


def network_from_dict(raw: Any, source: str) -> NetworkSpec:
    """Validate cluster.yaml's `network:` mapping; every refusal is one line naming the fix."""
    if not isinstance(raw, dict):
        raise KitError("%s: network must be a mapping (fabric, gbps, ib_hca, ib_gid_index), not %r" % (source, raw))
    missing = [k for k in ("fabric", "gbps", "ib_hca", "ib_gid_index") if k not in raw]
    if missing:
        raise KitError("%s: network lacks %s; add them" % (source, ", ".join(missing)))
    fabric = raw["fabric"]
    if fabric not in FABRICS:
        raise KitError("%s: network.fabric is %r; use one of: %s" % (source, fabric, ", ".join(FABRICS)))
    return NetworkSpec(
        fabric=fabric,
        gbps=_gbps(raw["gbps"], source),
        ib_hca=_ib_hca(raw["ib_hca"], fabric, source),
        ib_gid_index=_gid_index(raw["ib_gid_index"], fabric, source),
    )


def _gbps(value: Any, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise KitError("%s: network.gbps is %r; declare each node's link in Gbit/s (a number, 0 = unknown)" % (source, value))
    return value


def _ib_hca(value: Any, fabric: str, source: str) -> str:
    if not isinstance(value, str):
        raise KitError('%s: network.ib_hca must be a quoted string such as "mlx5_0,mlx5_1", not %r' % (source, value))
    if not value:
        return value
    # A value NCCL would never read is refused rather than left to look as if it did something.
    if fabric not in RDMA_FABRICS:
        raise KitError('%s: network.ib_hca is set but fabric is %s (sockets); set fabric to ib or roce, or ib_hca to ""' % (source, fabric))
    if not _HCA_LIST.fullmatch(value):
        raise KitError(
            "%s: network.ib_hca %r is not an NCCL_IB_HCA list; write [^|=]device[:port],... such as mlx5_0:1,mlx5_1:1" % (source, value)
        )
    return value


def _gid_index(value: Any, fabric: str, source: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise KitError("%s: network.ib_gid_index is %r; use a GID index (a whole number >= 0) or null" % (source, value))
    if fabric != "roce":
        raise KitError(
            "%s: network.ib_gid_index applies to RoCE only and fabric is %s; set fabric to roce, or ib_gid_index to null" % (source, fabric)
        )
    return value
