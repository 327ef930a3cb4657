"""The Alpa engine, our side of the contract (no GPU, no Alpa CUDA jaxlib: no Alpa run happens here).

* alpa_engine.py is valid Python 3.9 (compiled by the real 3.9 interpreter when .venv39 exists)
  and imports nothing of alpa at module level (importing it leaves `alpa` out of sys.modules).
* Method settings: boundaries by layer counts, stage/device divisibility, micro-batches.
* Engine/strategy validation: jax strategies refused on alpa and alpa methods on jax.
* In-process inspection from REAL alpa 0.2.3 PlacementSpec objects (alpa/parallel_plan.py loaded
  standalone in .venv39, with jax 0.4.13's ShardingSpec and a real flax TrainState), converted
  by alpa_job.record.alpa_live -- labels checked against the intent computed by make_dumps.py.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from alpa_job.settings.config import JobConfig, build_config
from alpa_job.engines import alpa_engine
from alpa_job.errors import KitError
from helpers_train import job_config

REPO = Path(__file__).resolve().parent.parent
VENV39_PY = REPO / ".venv39" / "bin" / "python"
ENGINE = REPO / "alpa_job" / "engines" / "alpa_engine.py"
# What the Alpa driver imports: the engine, its guards and plan cache, the interface and the one loop.
ALPA_FILES = [
    ENGINE,
    REPO / "alpa_job/engines/alpa_guards.py",
    REPO / "alpa_job/engines/plan_cache.py",
    REPO / "alpa_job/record/alpa_live.py",
    REPO / "alpa_job/engines/base.py",
    REPO / "alpa_job/train/loop.py",
]
NEEDS_VENV39 = pytest.mark.skipif(
    not VENV39_PY.exists(),
    reason=f"{VENV39_PY} not found: create it (python3.9 -m venv .venv39; .venv39/bin/pip install --no-deps "
    "alpa==0.2.3; .venv39/bin/pip install -r requirements/alpa-fixtures-py39.txt) to test against real "
    "alpa 0.2.3 objects",
)


def run39(code: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=f"{REPO}:{REPO / 'tests' / 'alpa_fixtures'}")
    r = subprocess.run(
        [str(VENV39_PY), "-c", textwrap.dedent(code)], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, f"py3.9 script failed:\n{r.stdout[-3000:]}\n{r.stderr[-4000:]}"
    return r


# ----------------------------------------------------------------------------- module hygiene
@pytest.mark.parametrize("path", ALPA_FILES, ids=lambda p: p.name)
def test_no_top_level_alpa_import_and_py39_grammar(path):
    tree = ast.parse(path.read_text(), feature_version=(3, 9))
    for node in tree.body:
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        assert not any(n == "alpa" or n.startswith("alpa.") for n in names), f"{path.name}: top-level {names}"


@NEEDS_VENV39
def test_compiles_and_imports_on_python39_without_alpa():
    files = " ".join(repr(str(p)) for p in ALPA_FILES)
    r = run39(f"""
        import py_compile, sys
        for f in [{files.replace(" ", ", ")}]:
            py_compile.compile(f, doraise=True)
        import alpa_job.engines.alpa_engine, alpa_job.engines.plan_cache, alpa_job.record.alpa_live, alpa_job.train.loop
        assert 'alpa' not in sys.modules, 'importing the engine imported alpa'
        print(sys.version_info[:2])
    """)
    assert "(3, 9)" in r.stdout


def test_importing_engine_does_not_import_alpa():
    r = subprocess.run(
        [sys.executable, "-c", "import sys, alpa_job.engines.alpa_engine as e; print('alpa' in sys.modules, 'jax' in sys.modules)"],
        cwd=str(REPO),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


# ----------------------------------------------------------------------------- method settings
def test_boundaries_by_layer_counts():
    assert alpa_engine.boundary_after(4, 2) == [1]
    assert alpa_engine.boundary_after(10, 3) == [2, 5]
    assert alpa_engine.boundary_after(4, 1) == []
    with pytest.raises(KitError, match="does not fit a model of 4 layers"):
        alpa_engine.boundary_after(4, 5)


def test_method_settings():
    cfg = JobConfig(strategy="pipeshard-manual", engine="alpa", micro_batches=4).validated()
    s = alpa_engine.method_settings(cfg, num_nodes=2, devices_per_node=2)
    assert s == {"strategy": "pipeshard-manual", "micro_batches": 4, "stages": 2, "boundaries": [1]}
    cfg = job_config(strategy="pipeshard-auto", engine="alpa", model="gpt", num_layers=6).validated()
    assert alpa_engine.method_settings(cfg, 2, 4)["layer_num"] == 6
    cfg = cfg.replace(pipeline_layers=3)
    assert alpa_engine.method_settings(cfg, 2, 4)["layer_num"] == 3
    bad = JobConfig(strategy="pipeshard-manual", engine="alpa", pipeline_stages=3).validated()
    with pytest.raises(KitError, match="does not divide the 4 GPUs"):
        alpa_engine.method_settings(bad, 2, 2)
    odd = JobConfig(strategy="data", engine="alpa", micro_batches=3).validated()
    with pytest.raises(KitError, match="not divisible by --micro-batches 3"):
        alpa_engine.method_settings(odd, 1, 4)
    wrn = job_config(model="wide_resnet", depth=16).validated()
    assert alpa_engine.model_layer_count(wrn) == 6


@pytest.mark.parametrize(
    "engine,strategy,msg",
    [
        ("alpa", "fsdp", "is a JAX-engine strategy; with --engine alpa use one of: data, shard, pipeshard-manual"),
        ("alpa", "tensor", "JAX-engine strategy"),
        ("jax", "shard", "is an Alpa method; use --engine alpa"),
        ("jax", "pipeshard-auto", "is an Alpa method"),
    ],
)
def test_engine_strategy_refusals(engine, strategy, msg):
    with pytest.raises(KitError, match=msg):
        build_config({}, {"engine": engine, "strategy": strategy})


def test_engine_strategy_accepts():
    assert build_config({}, {"engine": "alpa", "strategy": "pipeshard-auto", "plan_cache": "/x"}).plan_cache == "/x"
    assert build_config({}, {"engine": "jax", "strategy": "data"}).strategy == "data"
    assert build_config({}, {"engine": "alpa", "strategy": "data"}).strategy == "data"


def test_cli_refuses_alpa_method_on_jax(capsys):
    from alpa_job.cli import main

    assert main(["train", "--engine", "jax", "--strategy", "pipeshard-manual", "--address", "none"]) != 0
    assert "is an Alpa method" in capsys.readouterr().err


# ----------------------------------------------------------------------------- live inspection
LIVE_SCRIPT = """
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    import jax, jax.numpy as jnp, optax
    from flax.training import train_state
    import make_dumps as md          # loads alpa 0.2.3's own parallel_plan.py (real PlacementSpec)
    from alpa_job.record.alpa_live import dump_from_placement_specs

    model = md.MLPStack(hidden=16, num_layers=2, vocab=32)
    tokens = jnp.zeros((8, 12), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    batch = {"input_ids": tokens, "labels": tokens}
    out = {}
    for name, meshes in (("2d", {0: (2, 2)}), ("two_meshes", {0: (1, 2), 1: (1, 2)})):
        two = len(meshes) == 2
        def rule(inputs):
            def r(arg, path, aval):
                mesh = 1 if two and ("_1" in path or "head" in path) else 0
                if arg == 1:
                    if inputs:
                        return md.on_many(0, 1) if two else md.on(0, d0=(0,))
                    return md.on(mesh)
                if "fc1" in path and path.endswith("kernel") and "opt_state" not in path:
                    return md.on(mesh, d1=(1,))                    # column-parallel: MP
                if "fc1" in path and path.endswith("kernel"):
                    return md.on(mesh, d0=(0,), d1=(1,)) if not two else md.on(mesh, d1=(1,))
                if path.endswith("embedding"):
                    return md.on(mesh, d0=(0,)) if not two else md.on(mesh)
                return md.on(mesh)
            return r
        in_tree, in_rows = md.placement_tree((state, batch), rule(True), meshes)
        out_tree, out_rows = md.placement_tree((state, {"loss": jnp.float32(0)}), rule(False), meshes)
        assert type(jax.tree_util.tree_leaves(in_tree)[0]).__module__ == "alpa_parallel_plan"
        plan = dump_from_placement_specs(in_tree, out_tree).plan
        want = json.loads(md.expected(meshes, in_rows, out_rows, {}))
        out[name] = {"got": {r["path"]: r["strategy"] for r in plan.leaf_rows()},
                     "want": want["leaves"],
                     "meshes": plan.mesh_rows()}
    print("JSON" + json.dumps(out))
"""


@NEEDS_VENV39
def test_live_inspection_from_real_placement_specs():
    r = run39(LIVE_SCRIPT)
    out = json.loads(r.stdout.split("JSON", 1)[1])
    for name, case in out.items():
        assert case["got"] == case["want"], name
        assert any(p.startswith("params/") for p in case["got"])
        assert any(p.startswith("opt_state/") for p in case["got"])
    d2 = out["2d"]["got"]
    assert d2["params/fc1_0/kernel"] == "MP"
    assert d2["params/embed/embedding"] == "ZeRO"
    assert d2["opt_state/0/mu/fc1_0/kernel"] == "MP+ZeRO"
    assert d2["params/head/bias"] == "DP"
    assert out["2d"]["meshes"][0]["batch_axes"] == ["0"]
    assert len(out["two_meshes"]["meshes"]) == 2


def test_stage_layout_from_seed_dp_result():
    from alpa_job.record.alpa_live import stage_layout

    dp = (
        None,
        [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
        [(1, 2), (1, 2)],
        [(1, 2), (1, 2)],
        [{"force_batch_dim_to_mesh_dim": 0}, {"force_batch_dim_to_mesh_dim": 0}],
    )
    rows = stage_layout(dp, [10, 20, 30, 40])
    assert rows[0].layers == list(range(8)) and rows[1].submesh_shape == [1, 2]
    assert rows[0].memory_bytes_forward == 10 and rows[0].memory_bytes_backward == 40
    assert stage_layout((None, None, None, None, None)) == []


@pytest.mark.slow
def test_alpa_side_actor_death_is_named_with_host_ip_and_node(tmp_path):
    """The Alpa engine's mesh workers are Ray actors the kit does not own: a RayActorError about one is
    turned into a line naming its host, node IP, Ray node id and pid (real local Ray, a real actor death)."""
    code = r"""
import os, socket, ray
from alpa_job.launch.failures import actor_error_message
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

@ray.remote(num_cpus=0)
class MeshWorker:
    def pid(self):
        return os.getpid()
    def crash(self):
        os._exit(1)

w = MeshWorker.remote()
pid = ray.get(w.pid.remote())
try:
    ray.get(w.crash.remote())
except ray.exceptions.RayActorError as err:
    print("MSG " + actor_error_message(err))
print("EXPECT %s %s %d" % (socket.gethostname(), ray.get_runtime_context().get_node_id(), pid))
ray.shutdown()
"""
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=str(Path(__file__).resolve().parent.parent),
        env=dict(os.environ, RAY_USAGE_STATS_ENABLED="0"),
    )
    msg = [x[4:] for x in p.stdout.splitlines() if x.startswith("MSG ")]
    expect = [x.split()[1:] for x in p.stdout.splitlines() if x.startswith("EXPECT ")]
    assert msg and expect, p.stdout[-2000:] + p.stderr[-3000:]
    host, node_id, pid = expect[0]
    assert msg[0].startswith("an Alpa mesh worker (MeshWorker) died on host %s" % host), msg[0]
    assert "Ray node id %s" % node_id in msg[0] and "pid %s" % pid in msg[0] and "\n" not in msg[0]
