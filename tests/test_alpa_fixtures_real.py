"""The committed Alpa dump fixtures are exactly what real Alpa/jax objects print.

Regenerates every fixture with tests/alpa_fixtures/make_dumps.py in the Python 3.9 venv
(.venv39, pinned by requirements/alpa-fixtures-py39.txt: alpa 0.2.3's parallel_plan.py,
jax/jaxlib 0.4.13, flax 0.6.2, optax 0.1.5) and compares byte for byte, so the fixtures cannot
drift from real Alpa output. Skipped where that venv does not exist.
"""

import filecmp
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV39_PY = REPO / ".venv39" / "bin" / "python"
FIXTURES = REPO / "tests" / "alpa_fixtures"
MAKE = FIXTURES / "make_dumps.py"

pytestmark = pytest.mark.skipif(
    not VENV39_PY.exists(),
    reason=f"{VENV39_PY} not found: create it (python3.9 -m venv .venv39; pip install --no-deps "
    f"alpa==0.2.3; pip install -r requirements/alpa-fixtures-py39.txt) to check the Alpa "
    f"fixtures against real Alpa/jax objects",
)


def _fixture_files():
    return sorted(
        p.relative_to(FIXTURES) for p in FIXTURES.rglob("*") if p.is_file() and p.parent != FIXTURES and "__pycache__" not in p.parts
    )


def test_regenerated_dumps_are_byte_identical(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run([str(VENV39_PY), str(MAKE), str(tmp_path)], env=env, cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"make_dumps.py failed:\n{r.stdout}\n{r.stderr[-4000:]}"
    committed = _fixture_files()
    assert len({p.parts[0] for p in committed}) >= 3
    regenerated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert regenerated == committed, "fixture file list differs; rerun make_dumps.py and commit"
    differ = [str(p) for p in committed if not filecmp.cmp(FIXTURES / p, tmp_path / p, shallow=False)]
    assert not differ, (
        f"fixtures drifted from real Alpa output: {differ}; rerun .venv39/bin/python tests/alpa_fixtures/make_dumps.py and commit"
    )
