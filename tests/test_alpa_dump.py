"""Offline reading of Alpa `dump_debug_info` folders (fixtures made from real Alpa objects)."""

import json
import shutil
from pathlib import Path

import pytest

from alpa_job.errors import KitError
from alpa_job.record.alpa_dump import AlpaDump, collect_leaves, dim_axes_of, load_alpa_dump, parse_tree, _sharding_spec
from alpa_job.record.plan import STRATEGY_LABELS

FIXTURES = Path(__file__).resolve().parent / "alpa_fixtures"
NAMES = ["wide_resnet_dp", "pipeshard_zero", "mesh2d_mp"]


def _expected(name):
    return json.loads((FIXTURES / name / "expected.json").read_text())


@pytest.fixture(scope="module", params=NAMES)
def loaded(request):
    name = request.param
    return name, load_alpa_dump(str(FIXTURES / name)), _expected(name)


def test_every_leaf_label_matches_expected(loaded):
    name, dump, exp = loaded
    plan = dump.plan
    got = {leaf.path: plan.strategy_of(leaf) for leaf in plan.leaves}
    assert got == exp["leaves"], name
    got_batch = {leaf.path: plan.strategy_of(leaf) for leaf in plan.batch}
    assert got_batch == exp["batch"], name
    assert set(got.values()) <= set(STRATEGY_LABELS)


def test_meshes_and_batch_axes(loaded):
    name, dump, exp = loaded
    meshes = [{"id": m.mesh_id, "shape": list(m.shape), "batch_axes": list(m.batch_axes)} for m in dump.plan.meshes]
    assert meshes == exp["meshes"], name
    for m in dump.plan.meshes:
        assert m.axes == tuple(str(i) for i in range(len(m.shape)))


def test_collectives_memory_and_kind(loaded):
    name, dump, exp = loaded
    assert isinstance(dump, AlpaDump)
    assert dump.kind == exp["kind"] and dump.prefix == exp["prefix"]
    assert {k: v for k, v in dump.collectives.items() if v["count"]} == exp["collectives"]
    assert dump.memory_gb == exp["memory"]
    if "stage_collectives" in exp:
        got = {stem: {k: v for k, v in c.items() if v["count"]} for stem, c in dump.stage_collectives.items()}
        assert got == exp["stage_collectives"]


def test_paths_and_rows_render(loaded):
    _, dump, _ = loaded
    paths = [leaf.path for leaf in dump.plan.leaves]
    assert any(p.startswith("params/") for p in paths)
    assert any(p.startswith("opt_state/") for p in paths)
    assert all(leaf.path.startswith("batch/") for leaf in dump.plan.batch)
    rows = dump.plan.leaf_rows()  # the renderer-facing API works on what we produce
    assert rows and all(r["bytes_per_device"] <= r["bytes"] for r in rows)
    assert all(r["spec"].startswith("ShardingSpec((") for r in rows)


def test_wide_resnet_details():
    dump = load_alpa_dump(str(FIXTURES / "wide_resnet_dp"))
    leaves = {leaf.path: leaf for leaf in dump.plan.leaves}
    step = leaves["step"]
    assert step.shape == () and step.dtype == "int32"
    # the input placed conv_init/kernel split, the output replicated: the OUTPUT wins
    assert leaves["params/conv_init/kernel"].split_axes == ()
    trace = leaves["opt_state/0/trace/conv_init/kernel"]
    assert trace.dim_axes == ((), (), ("0",), ())
    assert dump.plan.bytes_per_device(trace) == trace.bytes // 2
    assert "batch_stats/bn_init/mean" in leaves
    assert "opt_state/1/count" in leaves  # ScaleByScheduleState(count=...)
    images = {b.path: b for b in dump.plan.batch}["batch/images"]
    assert images.shape == (16, 32, 32, 3) and images.dim_axes[0] == ("0",)


def test_mesh2d_chunked_forms():
    dump = load_alpa_dump(str(FIXTURES / "mesh2d_mp"))
    leaves = {leaf.path: leaf for leaf in dump.plan.leaves}
    assert "Chunked(2,2)" in leaves["params/fc1_0/bias"].spec
    assert leaves["params/fc1_0/bias"].dim_axes == (("1", "0"),)  # outer chunk on mesh axis 1
    assert leaves["params/fc1_0/kernel"].dim_axes == ((), ("1",))
    assert leaves["params/head/kernel"].dim_axes == ((), ("0", "1"))  # Chunked(4) over both
    plan = dump.plan
    assert plan.bytes_per_device(leaves["params/head/kernel"]) == leaves["params/head/kernel"].bytes // 4


def test_pipeshard_multi_mesh_leaf():
    dump = load_alpa_dump(str(FIXTURES / "pipeshard_zero"))
    assert [m.mesh_id for m in dump.plan.meshes] == [0, 1]
    leaves = {leaf.path: leaf for leaf in dump.plan.leaves}
    assert {leaves["params/fc1_0/kernel"].mesh_ids, leaves["params/fc1_1/kernel"].mesh_ids} == {(0,), (1,)}
    # step is on both meshes in the INPUT but on mesh 0 in the output: output wins
    assert leaves["step"].mesh_ids == (0,)
    assert len(dump.stage_collectives) == 4


def test_load_from_spec_file_path():
    f = FIXTURES / "mesh2d_mp" / "train_step_input_placement_specs.txt"
    assert load_alpa_dump(str(f)).prefix == "train_step"


# ------------------------------------------------------------------ parser units
def test_parse_named_tuples_dicts_and_opaque():
    text = (
        "(TrainState(step=PlacementSpec(aval=ShapedArray(int32[], weak_type=True), mesh_ids=(0,), "
        "sharding_specs=(ShardingSpec((), (Replicated(replicas=2),)),)), apply_fn=<bound method "
        "Module.apply of M(\n    # attributes\n    act = <function relu at 0x1>\n    x = (1, 2)\n)>, "
        "params=FrozenDict({\n    Dense_0: {\n        kernel: PlacementSpec(aval=ShapedArray(float32[2,3]), "
        "mesh_ids=(0,), sharding_specs=(ShardingSpec((Chunked(2), NoSharding()), (ShardedAxis(axis=0), "
        "Replicated(replicas=2))),)),\n    },\n}), opt_state=(EmptyState(), [None, 1.5e-3, -2]), "
        "dynamic_scale=None), {'x': PlacementSpec(aval=ShapedArray(bfloat16[4]), mesh_ids=(0,), "
        "sharding_specs=(ShardingSpec((Chunked([2, 2]),), (ShardedAxis(axis=0), ShardedAxis(axis=1))),))})"
    )
    leaves = collect_leaves(parse_tree(text))
    assert [(l.arg, l.path) for l in leaves] == [(0, "step"), (0, "params/Dense_0/kernel"), (1, "x")]
    assert leaves[1].shape == (2, 3) and leaves[2].specs[0].dims == ((2, 2),)


def test_sharding_spec_text_roundtrip_and_axes():
    s = "ShardingSpec((NoSharding(), Chunked(2), Chunked(2)), (ShardedAxis(axis=1), ShardedAxis(axis=0)))"
    spec = _sharding_spec(parse_tree(s))
    assert spec.text() == s
    assert dim_axes_of(spec, (2, 2)) == ((), ("1",), ("0",))
    one = "ShardingSpec((Chunked(2),), (ShardedAxis(axis=0),))"
    assert _sharding_spec(parse_tree(one)).text() == one


# ------------------------------------------------------------------ errors
def test_empty_folder_error(tmp_path):
    with pytest.raises(KitError) as e:
        load_alpa_dump(str(tmp_path))
    msg = str(e.value)
    assert "no *_input_placement_specs.txt in" in msg and str(tmp_path) in msg
    assert "executable.dump_debug_info()" in msg


def test_missing_folder_error(tmp_path):
    with pytest.raises(KitError, match="not a folder"):
        load_alpa_dump(str(tmp_path / "nope"))


def test_unparsable_file_names_file_line_column(tmp_path):
    src = FIXTURES / "wide_resnet_dp"
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    bad = tmp_path / "train_step_func_output_placement_specs.txt"
    lines = bad.read_text().splitlines(True)
    n = next(i for i, line in enumerate(lines) if i > 0 and "mesh_ids=(0,)" in line)
    lines[n] = lines[n].replace("mesh_ids=(0,)", "mesh_ids=(0,", 1)
    bad.write_text("".join(lines))
    with pytest.raises(KitError) as e:
        load_alpa_dump(str(tmp_path))
    msg = str(e.value)
    assert str(bad) in msg and f"line {n + 1}, column" in msg


def test_truncated_and_garbage_files(tmp_path):
    (tmp_path / "f_input_placement_specs.txt").write_text("(TrainState(step=PlacementSpec(")
    with pytest.raises(KitError, match=r"f_input_placement_specs.txt: line 1, column \d+"):
        load_alpa_dump(str(tmp_path))
    (tmp_path / "f_input_placement_specs.txt").write_text("{'a': 1}")
    with pytest.raises(KitError, match="no PlacementSpec"):
        load_alpa_dump(str(tmp_path))


def test_several_prefixes_need_a_choice(tmp_path):
    src = FIXTURES / "mesh2d_mp"
    for suffix in ("_input_placement_specs.txt", "_output_placement_specs.txt"):
        shutil.copy(src / f"train_step{suffix}", tmp_path / f"a{suffix}")
        shutil.copy(src / f"train_step{suffix}", tmp_path / f"b{suffix}")
    with pytest.raises(KitError, match="several functions"):
        load_alpa_dump(str(tmp_path))
    assert load_alpa_dump(str(tmp_path), prefix="b").prefix == "b"
