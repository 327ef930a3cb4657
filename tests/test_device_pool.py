"""The GPU pool sized by the last identical run (engines/device_pool.py): what is remembered, when it is used, and
that the kit's own allocator setting never changes the stored step's key. The reservation itself needs a GPU
(bench/gpu_warm_start.py measures it); here the devices are CPUs, which keep no pool."""

import os

import pytest

from alpa_job.engines import executable_store
from alpa_job.settings.config import JobConfig
from alpa_job.engines import device_pool


@pytest.fixture
def config(tmp_path, monkeypatch):
    for name in device_pool.USER_CHOICES:
        monkeypatch.setenv(name, "")  # so that teardown restores each, whatever choose() set meanwhile
        monkeypatch.delenv(name)
    return JobConfig(model="mlp", compile_cache=str(tmp_path / "cache"), address="none").validated()


def test_a_gpu_runs_peak_is_reserved_by_the_next_identical_run_with_the_allocator_growing(config, monkeypatch):
    assert device_pool.choose(config) is None  # nothing remembered: JAX's default reservation
    device_pool.remember(config, 3_000_000_000, "cpu")
    assert device_pool.choose(config) is None  # CPU devices keep no pool: nothing to remember
    device_pool.remember(config, 3_000_000_000, "gpu")
    assert device_pool.choose(config) == int(3_000_000_000 * device_pool.MARGIN)
    assert os.environ[device_pool.GROW] == "false"  # the allocator grows from the reserved region
    # The next run's allocator peak counts its own reservation: the hint stands unless the run went past it.
    device_pool.remember(config, int(3_000_000_000 * device_pool.MARGIN), "gpu")
    os.environ.pop(device_pool.GROW)  # a new process (the fixture restores what was there before)
    assert device_pool.choose(config) == int(3_000_000_000 * device_pool.MARGIN)
    device_pool.remember(config, 4_000_000_000, "gpu")
    os.environ.pop(device_pool.GROW)
    assert device_pool.choose(config) == int(4_000_000_000 * device_pool.MARGIN)


def test_another_setting_or_the_users_own_allocator_choice_keeps_jaxs_default(config, monkeypatch):
    device_pool.remember(config, 3_000_000_000, "gpu")
    assert device_pool.choose(config.replace(batch_size=config.batch_size * 2)) is None  # another run's peak
    assert device_pool.choose(config.replace(seed=config.seed + 1)) is not None  # the seed does not reach memory
    os.environ.pop(device_pool.GROW)  # set by choose(); the fixture restores what was there before
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    assert device_pool.choose(config) is None and device_pool.GROW not in os.environ
    assert device_pool.choose(config.replace(compile_cache="none")) is None


def test_the_allocators_growth_never_reaches_the_stored_steps_key(config, monkeypatch):
    import jax

    from alpa_job.engines.jax_engine import make_mesh

    mesh = make_mesh((len(jax.devices()), 1), ("data", "model"))
    example = {"x": jax.ShapeDtypeStruct((8, 4), "float32")}
    before = executable_store.key_digest(executable_store.step_key(config, 10, "data", mesh, example))
    monkeypatch.setenv(device_pool.GROW, "false")
    assert executable_store.key_digest(executable_store.step_key(config, 10, "data", mesh, example)) == before
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nonexistent")
    assert executable_store.key_digest(executable_store.step_key(config, 10, "data", mesh, example)) != before
