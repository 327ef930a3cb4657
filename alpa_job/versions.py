"""Versions of what a node runs, read from package metadata (no engine import needed).

Used in every report and by `doctor`, which requires them equal on all nodes.
"""

from __future__ import annotations

import glob
import os
import platform
import re
from typing import Dict, Optional

from alpa_job.api import API_VERSION

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "ray", "alpa", "numpy", "cupy-cuda113")


def package_version(name: str) -> Optional[str]:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover - Python < 3.8
        return None
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def cuda_version() -> Optional[str]:
    """The CUDA runtime a node has, from the toolkit's version file or libcudart's soname."""
    for path in ("/usr/local/cuda/version.json", "/usr/local/cuda/version.txt"):
        if os.path.isfile(path):
            with open(path) as f:
                match = re.search(r"(\d+\.\d+(\.\d+)?)", f.read())
            if match:
                return match.group(1)
    libs = sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so.*"))
    return os.path.basename(libs[-1]).split(".so.", 1)[1] if libs else None


def nccl_version() -> Optional[str]:
    libs = sorted(glob.glob("/usr/lib/x86_64-linux-gnu/libnccl.so.*") + glob.glob("/usr/local/lib/libnccl.so.*"))
    return os.path.basename(libs[-1]).split(".so.", 1)[1] if libs else None


def collect() -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {"python": platform.python_version()}
    for name in PACKAGES:
        out[name] = package_version(name)
    out["cuda"] = cuda_version()
    out["nccl"] = nccl_version()
    out["alpa_job_api"] = API_VERSION  # the model API (alpa_job/api.py) the run's model was built against
    return out
