"""The cluster spec as tests see it: the package defaults, never the caller's override."""

import pytest

from alpa_job.cluster.spec import SPEC_ENV_VAR, load_spec


@pytest.fixture(autouse=True)
def _no_user_spec(monkeypatch):
    """A user's ALPA_KIT_CLUSTER_SPEC must not change what any test checks."""
    monkeypatch.delenv(SPEC_ENV_VAR, raising=False)


@pytest.fixture
def spec():
    return load_spec()
