"""XLA's scheduler told what the step's collectives across hosts cost, so it overlaps them with compute.

XLA:GPU orders a step's instructions with a latency-hiding scheduler: each asynchronous collective starts
early enough for the compute it estimates will cover it. Its estimates assume the fast links of one
machine, so across hosts a collective that takes milliseconds on the network is given a matmul or two to
hide behind, and the rest of its time is the step's. XLA also reads measured latencies (a
"profile-guided" schedule, `xla_gpu_pgle_profile_file_or_directory_path`): a file naming instructions and
their cost. The kit writes one for the collectives that cross hosts, each costed at its network bytes over
the bandwidth the user states, and compiles the step again with it. Every other instruction keeps XLA's
own estimate.

The instructions are named by a first compile of the same program (names are deterministic: every process
of the job derives the same file, and so compiles the same program).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
from typing import Dict, Iterator, Optional, Sequence

from alpa_job.record import traffic

PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
LAUNCH_US = 50.0  # a collective's fixed cost across hosts (NCCL's launch and the network's round trip), roughly


def collective_costs(hlo_text: str, node_of: Sequence[int], gbps: float) -> Dict[str, float]:
    """{collective instruction name: microseconds} for each collective of the compiled step that sends
    bytes between hosts (`node_of[d]`: the host of the device at mesh position d), at `gbps` Gbit/s."""
    bytes_per_us = gbps * 1e9 / 8 / 1e6
    per_host = max(sum(1 for n in node_of if n == node_of[0]), 1)
    rows = traffic.named_step_traffic(hlo_text, len(node_of), per_host, node_of)
    return {name: round(LAUNCH_US + row.network_bytes / bytes_per_us, 1) for name, row in rows if row.network_bytes > 0}


def profile_text(costs: Dict[str, float]) -> str:
    """XLA's profiled-instructions file (a ProfiledInstructionsProto in text form)."""
    return "".join(f'costs {{ name: "{name}" cost_us: {cost} }}\n' for name, cost in sorted(costs.items()))


def written_profile(costs: Dict[str, float], folder: Optional[str] = None) -> str:
    """The profile in a file named by its content (the same costs, the same path: a compile cache's key
    stays put), in `folder` (default: the system's temporary folder)."""
    text = profile_text(costs)
    folder = folder or os.path.join(tempfile.gettempdir(), "alpa_job-network-schedule")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"network-{hashlib.sha256(text.encode()).hexdigest()[:16]}.pbtxt")
    if not os.path.exists(path):
        partial = f"{path}.{os.getpid()}.partial"
        with open(partial, "w") as f:
            f.write(text)
        os.replace(partial, path)  # another process writing the same costs writes the same bytes
    return path


@contextlib.contextmanager
def profile_warnings_dropped() -> Iterator[None]:
    """XLA warns once for every instruction a profile does not name (all but the collectives: thousands of
    lines for a large step). While compiling with the profile, the process's stderr goes to a file; after,
    every line but those is written back, in order (anything else said meanwhile is delayed, not lost)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines(True) if "profile_guided_latency" not in line]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()
