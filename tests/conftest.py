"""Shared pytest configuration. Fixtures live in tests/fixtures_*.py; list yours below."""
import sys
from pathlib import Path

# `import alpa_job` from this checkout (also when the package is not pip-installed).
REPO_ROOT = Path(__file__).resolve().parent.parent
for _p in (REPO_ROOT, REPO_ROOT / "tests"):  # tests/: the fixture modules import by bare name
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

pytest_plugins = [
    "fixtures_testbed",  # testbed_factory, testbed, ray_cluster (multi-host test bed; needs root)
]
