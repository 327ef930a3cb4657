"""Guards for the Alpa seed failures (alpa_job/engines/alpa_guards.py), GPU-free.

Real where it can be: the installed alpa 0.2.3's version metadata and its own global_env.py
(loaded standalone in .venv39) reading the XLA port range; a real Ray actor raising the KeyError
`MeshHostWorker.get_exec_hlo_text` raises (same contract: `self.executables[uuid]`).
"""

import os
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

from alpa_job.launch.connect import connect
from alpa_job.cluster.spec import load_spec
from alpa_job.data import Dataset, epoch_batches
from alpa_job.engines import alpa_guards as g
from alpa_job.engines.alpa_engine import join_cluster
from alpa_job.errors import KitError

REPO = Path(__file__).resolve().parent.parent
VENV39_PY = REPO / ".venv39" / "bin" / "python"
NEEDS_VENV39 = pytest.mark.skipif(
    not VENV39_PY.exists(), reason=f"{VENV39_PY} not found (see requirements/alpa-fixtures-py39.txt for the three commands that create it)"
)


def run39(code: str, env_extra=None) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO), **(env_extra or {}))
    r = subprocess.run([str(VENV39_PY), "-c", textwrap.dedent(code)], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


# ----------------------------------------------------------------------------- version (#701)
@pytest.mark.parametrize("old", ["0.2.2", "0.2.0", "0.1.6", "0.2.2rc1"])
def test_refuses_old_alpa_with_reason(old):
    with pytest.raises(KitError, match=r"errno 99.*#701.*alpa==0.2.3"):
        g.check_alpa_version(old)


def test_refuses_missing_alpa():
    with pytest.raises(KitError, match="not installed"):
        g.check_alpa_version(None)


@pytest.mark.parametrize("ok", ["0.2.3", "0.2.3+cuda113", "1.0.0.dev0"])
def test_accepts_fixed_alpa(ok):
    assert g.check_alpa_version(ok) >= (0, 2, 3)


@NEEDS_VENV39
def test_version_guard_on_the_real_installed_alpa():
    out = run39("""
        from alpa_job.engines import alpa_guards as g
        v = g.installed_alpa_version()
        print(v, g.check_alpa_version(v))
    """)
    assert out.split()[0] == "0.2.3"
    # and the version string Alpa itself carries (alpa/version.py, read without importing alpa)
    text = (VENV39_PY.parent.parent / "lib" / "python3.9" / "site-packages" / "alpa" / "version.py").read_text()
    assert '__version__ = "0.2.3"' in text


# ----------------------------------------------------------------------------- XLA ports
def test_xla_ports_from_spec_into_env_and_global_config():
    env_from_spec = load_spec().xla_env()
    environ = {}

    class Cfg:
        xla_server_port_start = 20000
        xla_server_port_end = 25000

    start, end = g.apply_xla_port_env(env_from_spec, environ=environ, global_config=Cfg)
    assert environ == env_from_spec
    assert (Cfg.xla_server_port_start, Cfg.xla_server_port_end) == (start, end)
    assert start == int(env_from_spec["XLA_SERVER_PORT_START"]) and end > start
    assert g.ray_env_vars(env_from_spec) == env_from_spec


def test_xla_ports_bad_range():
    with pytest.raises(KitError, match="not valid"):
        g.apply_xla_port_env({"XLA_SERVER_PORT_START": "25000", "XLA_SERVER_PORT_END": "20000"}, environ={})
    with pytest.raises(KitError, match="no valid XLA port range"):
        g.apply_xla_port_env({}, environ={})


@NEEDS_VENV39
def test_real_alpa_global_env_reads_the_ports_we_set_before_import():
    """Set the env from the spec (as alpa_session does before `import alpa`), then load alpa 0.2.3's own
    global_env.py: its global_config must carry the spec's range."""
    out = run39("""
        import importlib.util, os
        from alpa_job.cluster.spec import load_spec
        from alpa_job.engines import alpa_guards as g
        env = load_spec().xla_env()
        g.apply_xla_port_env(env)
        spec = importlib.util.find_spec("alpa")
        path = os.path.join(list(spec.submodule_search_locations)[0], "global_env.py")
        s = importlib.util.spec_from_file_location("alpa_global_env", path)
        m = importlib.util.module_from_spec(s); s.loader.exec_module(m)
        print(m.global_config.xla_server_port_start, m.global_config.xla_server_port_end,
              env["XLA_SERVER_PORT_START"], env["XLA_SERVER_PORT_END"])
    """)
    a, b, c, d = out.split()
    assert (a, b) == (c, d)


# ----------------------------------------------------------------------------- Ray Client (#886)
def test_refuses_ray_client_for_alpa():
    with pytest.raises(KitError, match="#886"):
        g.refuse_ray_client("ray://head:10001")
    with pytest.raises(KitError, match="Ray Client"):
        connect("ray://head:10001", "alpa")
    with pytest.raises(KitError, match="ray job submit"):
        join_cluster("ray://head:10001", load_spec().xla_env())
    g.refuse_ray_client("10.0.0.1:6379")


# ----------------------------------------------------------------------------- cluster shape
NODES = [
    {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0}},  # CPU-only head
    {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 16.0, "GPU": 4.0}},
    {"Alive": True, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 16.0, "GPU": 4.0}},
    {"Alive": False, "NodeManagerAddress": "10.0.0.4", "Resources": {"GPU": 4.0}},
]


def test_cluster_shape_skips_cpu_head_and_dead_nodes():
    assert g.cluster_shape(NODES) == (2, 4)


def test_cluster_shape_errors():
    with pytest.raises(KitError, match="no alive Ray node has a GPU"):
        g.cluster_shape(NODES[:1])
    uneven = NODES[:3] + [{"Alive": True, "NodeManagerAddress": "10.0.0.5", "Resources": {"GPU": 2.0}}]
    with pytest.raises(KitError, match="--num-gpus 2"):
        g.cluster_shape(uneven)


def test_driver_must_be_on_a_cluster_node():
    g.check_driver_on_cluster("10.0.0.1", NODES)
    with pytest.raises(KitError, match="not a node of the Ray cluster.*ray job submit"):
        g.check_driver_on_cluster("192.168.1.9", NODES)


# ----------------------------------------------------------------------------- second search (#776)
def _dataset(n):
    rng = np.random.default_rng(0)
    return Dataset({"x": rng.normal(size=(n, 8)).astype(np.float32), "y": rng.normal(size=(n, 8)).astype(np.float32)})


@pytest.mark.parametrize("policy", ["drop", "pad"])
def test_kit_batching_never_trips_the_guard(policy):
    guard = g.SearchGuard(auto_search=True)
    signatures = []
    for epoch in range(2):
        for batch, _ in epoch_batches(_dataset(100), 32, policy, 0, epoch):
            signatures.append(g.shape_signature(batch))
            guard.check(signatures[-1])  # raises on a second shape
    # 100 rows / 32: 3 full batches per epoch, plus the padded ragged one under "pad"; all one shape.
    assert len(signatures) == {"drop": 6, "pad": 8}[policy]
    assert set(signatures) == {guard.first}
    assert dict((p, s) for p, s, _ in guard.first) == {"x": (32, 8), "y": (32, 8), "mask": (32,)}


def test_ragged_last_batch_stops_before_second_search():
    ds = _dataset(100)
    guard = g.SearchGuard(auto_search=True)
    batches = [b for b, _ in epoch_batches(ds, 32, "drop", 0, 0)]
    for b in batches:
        guard.check(g.shape_signature(b))
    ragged = {k: v[:4] for k, v in batches[0].items()}  # what a naive loader's last batch would be
    with pytest.raises(KitError) as err:
        guard.check(g.shape_signature(ragged))
    msg = str(err.value)
    assert "#776" in msg and "existing physical meshes" in msg
    assert "x: ((32, 8), 'float32') -> ((4, 8), 'float32')" in msg
    assert "--plan-cache" in msg and "--pad-remainder" in msg


def test_no_guard_without_auto_search():
    first, other = g.shape_signature({"x": np.zeros((4, 2))}), g.shape_signature({"x": np.zeros((3, 2))})
    guard = g.SearchGuard(auto_search=False)
    guard.check(first)
    guard.check(other)  # recompiles are allowed there: no exception
    assert guard.first == first
    searching = g.SearchGuard(auto_search=True)  # the same two shapes are refused only with auto search
    searching.check(first)
    with pytest.raises(KitError, match="second Alpa auto search"):
        searching.check(other)


# ----------------------------------------------------------------------------- dump_debug_info
class _MeshHostWorker:
    """The contract of alpa's MeshHostWorker.get_exec_hlo_text: `self.executables[uuid].get_hlo_text()`."""

    def __init__(self):
        self.executables = {}

    def get_exec_hlo_text(self, uuid):
        return self.executables[uuid].get_hlo_text()


class _Executable:
    def __init__(self, worker, uuid):
        self.worker, self.uuid = worker, uuid

    def dump_debug_info(self, folder):
        os.makedirs(folder, exist_ok=True)
        return self.worker.get_exec_hlo_text(self.uuid)


def test_dump_keyerror_points_at_worker_log(tmp_path):
    exe = _Executable(_MeshHostWorker(), 1234567)
    with pytest.raises(KitError) as err:
        g.safe_dump_debug_info(exe.dump_debug_info, str(tmp_path / "dump"), hosts=["10.0.0.2"])
    msg = str(err.value)
    assert "KeyError" in msg and "10.0.0.2" in msg and "/tmp/ray/session_latest/logs/worker-*.err" in msg
    assert isinstance(err.value.__cause__, KeyError)


def test_dump_no_attribute_compiled_points_at_worker_log():
    class Half:
        def __del__(self):
            pass

    def dump(_folder):
        return Half().compiled  # AttributeError: 'Half' object has no attribute 'compiled'

    with pytest.raises(KitError, match="no attribute 'compiled'.*worker-\\*.err"):
        g.safe_dump_debug_info(dump, "unused")


def test_dump_other_errors_pass_through():
    def dump(_folder):
        raise PermissionError("read-only")

    with pytest.raises(PermissionError):
        g.safe_dump_debug_info(dump, "unused")


def test_dump_keyerror_through_a_real_ray_actor(tmp_path):
    """The KeyError raised inside a Ray actor (as MeshHostWorker is) reaches the driver as a
    RayTaskError carrying the worker's ip and pid: the message names that node and log."""
    ray = pytest.importorskip("ray")
    saved_env = dict(os.environ)  # ray.init() writes RAY_AUTH_MODE=token (and more) into os.environ
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:

        class MeshHostWorker:  # defined here so Ray ships it by value (same contract as above)
            def __init__(self):
                self.executables = {}

            def get_exec_hlo_text(self, uuid):
                return self.executables[uuid].get_hlo_text()

        worker = ray.remote(MeshHostWorker).remote()

        def dump(_folder):
            return ray.get(worker.get_exec_hlo_text.remote(42))

        with pytest.raises(KitError) as err:
            g.safe_dump_debug_info(dump, str(tmp_path))
        msg = str(err.value)
        cause = err.value.__cause__
        assert isinstance(cause, KeyError)
        import re

        pid, ip = re.search(r"pid=(\d+), ip=([0-9.]+)", str(cause)).groups()
        assert f"on {ip}:" in msg and f"worker-*-{pid}.err" in msg
    finally:
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved_env)
