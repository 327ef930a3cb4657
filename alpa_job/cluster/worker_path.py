"""The PYTHONPATH that Ray actors of this kit get on every node.

Actors must import `alpa_job` from the driver's source tree when the package is not installed on
the node. Ray's runtime_env env_vars REPLACE the node's own value, which would hide what the
node's `ray start` environment put on its path (a real package skew the node's jobs see), so the
node's value is kept last via Ray's ${VAR} expansion (Ray >= 2.6). Older Ray (the Alpa image's
2.1.0) keeps "${PYTHONPATH}" literally: a path that does not exist, harmless.
"""

from __future__ import annotations

import os


def package_root() -> str:
    """The folder holding the `alpa_job` package (the repository root for a source checkout)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_pythonpath() -> str:
    return os.pathsep.join(p for p in [package_root(), os.environ.get("PYTHONPATH", ""), "${PYTHONPATH}"] if p)
