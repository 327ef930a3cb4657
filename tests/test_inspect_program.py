"""`alpa_job.inspect.plan_of`: a hand-written jax.jit train step, with its own NamedShardings on a
(4, 2) ("data", "model") mesh, gets the run record a training run gets -- the right per-leaf labels,
the mesh and its batch axes, collectives, memory -- and the same report files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from alpa_job.errors import KitError
from alpa_job.inspect import plan_of, write_report
from helpers_train import job_config
from helpers_report import assert_valid_report

MESH = Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
PARAM_SHAPES = {"w1": (16, 32), "w2": (32, 8)}
BATCH = {"x": (32, 16), "y": (32, 8)}


def named(*spec):
    return NamedSharding(MESH, P(*spec))


def train_step(state, batch):
    """Plain JAX: a two-layer MLP, SGD with momentum; the optimizer state is (momentum, step count)."""
    params, (momentum, count) = state["params"], state["opt_state"]

    def loss_fn(p):
        hidden = jnp.tanh(batch["x"] @ p["w1"])
        return jnp.mean((hidden @ p["w2"] - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    momentum = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, momentum, grads)
    params = jax.tree_util.tree_map(lambda p, m: p - 0.01 * m, params, momentum)
    return {"params": params, "opt_state": (momentum, count + 1)}, loss


def state_shardings(param_spec):
    params = {name: named(*param_spec) for name in PARAM_SHAPES}
    return {"params": params, "opt_state": (params, named())}


def abstract(tree_of_shapes):
    """ShapeDtypeStructs: the step compiles without allocating a single array."""
    return jax.tree_util.tree_map(
        lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
        tree_of_shapes,
        is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x),
    )


def example_state():
    params = abstract(PARAM_SHAPES)
    return {"params": params, "opt_state": (params, jax.ShapeDtypeStruct((), jnp.int32))}


def jitted(param_spec, batch_spec=("data",)):
    return jax.jit(train_step, in_shardings=(state_shardings(param_spec), named(*batch_spec)))


# Each split of the parameters (and so of their momentum) and the label it must get, the batch's
# rows split over "data".
SPLITS = [((), "DP"), (("data",), "ZeRO"), ((None, "model"), "MP"), (("data", "model"), "MP+ZeRO")]


@pytest.fixture(scope="module")
def records():
    return {label: plan_of(jitted(spec), example_state(), abstract(BATCH)) for spec, label in SPLITS}


@pytest.mark.parametrize("spec,label", SPLITS, ids=[label for _s, label in SPLITS])
def test_each_split_gets_its_label(records, spec, label):
    record = records[label]
    rows = {r.path: r.strategy for r in record.params}
    assert rows == {
        "params/w1": label,
        "params/w2": label,
        "opt_state/0/w1": label,
        "opt_state/0/w2": label,
        "opt_state/1": "DP",
    }  # the step count is a replicated scalar
    assert record.strategy == label
    assert record.summary.strategy_counts["params"] == {label: 2}
    assert record.engine == "jax" and record.compiles == 1 and record.summary.one_compile


def test_the_mesh_and_the_batch_rows_come_from_the_shardings(records):
    record = records["ZeRO"]
    assert (record.mesh.shape, record.mesh.axes) == ([4, 2], ["data", "model"])
    [mesh] = record.meshes
    assert mesh.batch_axes == ["data"] and mesh.devices == 8
    assert {r.path: r.split_axes for r in record.batch_sharding} == {"batch/x": [["data"], []], "batch/y": [["data"], []]}
    w1 = next(r for r in record.params if r.path == "params/w1")
    assert w1.split_axes == [["data"], []] and w1.bytes_per_device == w1.bytes // 4


@pytest.mark.parametrize("label", [label for _s, label in SPLITS])
def test_collectives_are_counted_where_the_split_needs_them(records, label):
    # The batch is split over "data": every plan reduces gradients (or gathers parameters) across it.
    collectives = records[label].collectives
    assert sum(c.count for c in collectives.values()) > 0
    assert records[label].memory.peak_estimate_bytes > 0


def test_nothing_split_is_replicated_and_needs_no_collective():
    record = plan_of(jitted((), batch_spec=()), example_state(), abstract(BATCH))
    assert {r.strategy for r in record.params} == {"replicated"} and record.strategy == "replicated"
    assert record.meshes[0].batch_axes == []
    assert sum(c.count for c in record.collectives.values()) == 0


def _rows(record):
    return [(r.path, r.strategy, r.split_axes, r.spec) for r in record.params + record.batch_sharding]


def test_jitted_lowered_and_compiled_give_the_same_record(records):
    step = jitted(("data", "model"))
    lowered = step.lower(example_state(), abstract(BATCH))
    for program in (lowered, lowered.compile()):
        record = plan_of(program)
        assert _rows(record) == _rows(records["MP+ZeRO"])
        assert record.strategy == "MP+ZeRO" and record.config == {"model": "train_step"}
        assert record.compile_seconds is None or program is lowered  # measured only where it compiled


def test_arrays_carry_their_shardings_without_in_shardings():
    # A step jitted with no shardings at all, called on arrays the user placed.
    params = {"w1": jnp.ones(PARAM_SHAPES["w1"]), "w2": jnp.ones(PARAM_SHAPES["w2"])}
    params = jax.device_put(params, {"w1": named("data"), "w2": named(None, "model")})
    state = {"params": params, "opt_state": (params, jnp.zeros((), jnp.int32))}
    batch = jax.device_put({k: jnp.ones(s) for k, s in BATCH.items()}, named("data"))
    record = plan_of(jax.jit(train_step), state, batch)
    labels = {r.path: r.strategy for r in record.params}
    assert labels["params/w1"] == "ZeRO" and labels["params/w2"] == "MP" and labels["opt_state/0/w1"] == "ZeRO"


def test_separate_state_arguments_are_named():
    def step(params, opt_state, batch):
        new_state, loss = train_step({"params": params, "opt_state": opt_state}, batch)
        return new_state["params"], new_state["opt_state"], loss

    shardings = state_shardings(("data",))
    program = jax.jit(step, in_shardings=(shardings["params"], shardings["opt_state"], named("data")))
    state = example_state()
    record = plan_of(
        program, state["params"], state["opt_state"], abstract(BATCH), state_argnums=(0, 1), names=("params", "opt_state", "batch")
    )
    assert {r.path: r.strategy for r in record.params}["opt_state/0/w2"] == "ZeRO"
    assert record.summary.strategy_counts == {"params": {"ZeRO": 2}, "opt_state": {"ZeRO": 2, "DP": 1}}
    assert [r.path for r in record.batch_sharding] == ["batch/x", "batch/y"]
    unnamed = plan_of(program, state["params"], state["opt_state"], abstract(BATCH), state_argnums=(0, 1))
    assert {r.path.split("/")[0] for r in unnamed.params} == {"arg0", "arg1"}


def test_a_sharding_over_another_mesh_of_the_same_devices_is_read_per_device():
    # One axis over all eight devices: on the (4, 2) mesh that is "data" and "model" together.
    flat = NamedSharding(Mesh(MESH.devices.reshape(8), ("all",)), P("all"))
    params = {"w1": flat, "w2": named()}
    program = jax.jit(train_step, in_shardings=({"params": params, "opt_state": (params, named())}, named("data")))
    record = plan_of(program, example_state(), abstract(BATCH), mesh=MESH)
    w1 = next(r for r in record.params if r.path == "params/w1")
    assert w1.split_axes == [["data", "model"], []] and w1.strategy == "MP+ZeRO"


def test_report_files_are_written_and_valid(records, tmp_path):
    paths = write_report(records["MP"], str(tmp_path))
    assert sorted(paths) == ["html", "json", "md"] and all(os.path.isfile(p) for p in paths.values())
    with open(paths["json"]) as f:
        data = json.load(f)
    assert_valid_report(data)
    assert [(r["path"], r["strategy"]) for r in data["params"]][:2] == [("opt_state/0/w1", "MP"), ("opt_state/0/w2", "MP")]
    assert "MP" in open(paths["md"]).read() and "<html" in open(paths["html"]).read()
    from alpa_job.inspect.load import load_any

    assert _rows(load_any(str(tmp_path))) == _rows(records["MP"])  # `python -m alpa_job inspect DIR` reads it


def test_the_jax_engine_and_plan_of_agree_on_its_own_step():
    from alpa_job.data import epoch_batches, synthetic
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.models import get_model

    config = job_config(model="mlp", hidden_dim=16, num_samples=16, batch_size=8, steps=1, address="none", compile_cache="none").validated()
    batch, _ = next(epoch_batches(synthetic(config), 8, "drop", 0, 0))
    engine = JaxEngine(config, get_model(config), batch, "fsdp", (4, 2))
    engine.compile_step()
    engine_plan = engine.plan()
    record = plan_of(engine._compiled)
    assert [(r.path, r.strategy) for r in record.params] == [(r.path, r.strategy) for r in engine_plan.leaf_records()]
    assert record.meshes == engine_plan.mesh_records()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: plan_of(train_step, example_state(), abstract(BATCH)), r"plan_of got a function; pass a jax\.jit-ed"),
        (lambda: plan_of("step.py"), r"plan_of got a str; pass a jax\.jit-ed function with example arguments"),
        (lambda: plan_of(jitted(())), r"needs the step's example arguments"),
        (lambda: plan_of(jitted(()).lower(example_state(), abstract(BATCH)).compile(), example_state()), r"already has its arguments"),
        (lambda: plan_of(jitted(()), example_state(), abstract(BATCH), names=("state",)), r"needs one name per positional argument \(2\)"),
        (lambda: plan_of(jitted(()), example_state(), abstract(BATCH), state_argnums=(2,)), r"state_argnums=\(2,\) names no argument"),
    ],
)
def test_a_wrong_argument_is_a_one_line_error_naming_what_to_pass(call, message):
    with pytest.raises(KitError, match=message) as caught:
        call()
    assert "\n" not in str(caught.value)


def test_importing_the_readers_imports_no_jax():
    code = "import sys, alpa_job.inspect as i; assert callable(i.__getattr__); print('jax' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert out.stdout.strip() == "False"


def test_the_readme_example_runs_as_written(tmp_path, monkeypatch, capsys):
    readme = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")).read()
    section = readme.split("### Inspect your own JAX program", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out
    assert "params/w1        P('data', 'model')       MP+ZeRO" in printed and "MP\n" in printed
    with open(tmp_path / "plan-report" / "report.json") as f:
        assert_valid_report(json.load(f))
