"""Shared pytest configuration. Fixtures live in tests/fixtures_*.py; list yours below."""
import os
import sys
from pathlib import Path

# In-process engine tests see 8 emulated CPU devices; must be set before anything imports jax.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# `import alpa_job` from this checkout (also when the package is not pip-installed).
REPO_ROOT = Path(__file__).resolve().parent.parent
for _p in (REPO_ROOT, REPO_ROOT / "tests"):  # tests/: the fixture modules import by bare name
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

pytest_plugins = [
    "fixtures_spec",  # spec (package defaults); no test sees a user's ALPA_KIT_CLUSTER_SPEC
    "fixtures_testbed",  # testbed_factory, testbed, ray_cluster (multi-host test bed; needs root)
    "fixtures_multihost",  # mgmt_cluster (2 hosts with a management NIC), run_doctor helper
    "fixtures_ssh",  # ssh_bed: sshd inside 3 test-bed hosts (Ansible over real SSH)
]
