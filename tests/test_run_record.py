"""The typed run record: every report any path writes validates against the shipped JSON Schema
(alpa_job/record/report.schema.json), report.json round-trips through RunRecord, old reports
still load, and `inspect DUMP_DIR` carries memory and stages."""

from __future__ import annotations

import copy
import dataclasses
import glob
import json
import os
import re

import pytest

from alpa_job.errors import KitError
from alpa_job.record import run_record as rec
from alpa_job.record.run_record import GIB, SCHEMA_VERSION, MemoryRecord, ProcessResult, RunRecord
from helpers_report import assert_valid_report, schema_errors, without_input
from helpers_train import tiny_config
from helpers_cli import run_cli

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "alpa_fixtures")
DUMPS = sorted(d for d in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, d, "expected.json")))


# ----------------------------------------------------------------------------- train run dirs (JAX engine)
@pytest.fixture(scope="module")
def train_runs(tmp_path_factory):
    """One real in-process run per JAX strategy (auto included) and a resumed run, via run_job
    (the path `python -m alpa_job train` takes): {name: run dir}."""
    from alpa_job.launch.runner import run_job

    runs = {}
    for name, overrides in (("data", {}), ("fsdp", {}), ("tensor", {"model_parallel": 2}), ("auto", {}), ("ckpt", {"checkpoint_every": 1})):
        out = str(tmp_path_factory.mktemp(f"run-{name}"))
        strategy = "data" if name == "ckpt" else name
        run_job(tiny_config("mlp", steps=2, strategy=strategy, out=out, auto_trial_steps=1, **overrides))
        runs[name] = out
    resume = tiny_config("mlp", steps=3, strategy="data", out=runs["ckpt"], checkpoint_every=1, resume=True)
    run_job(resume)
    runs["resumed"] = runs.pop("ckpt")
    return runs


def _report(run_dir):
    with open(os.path.join(run_dir, "report.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name", ["data", "fsdp", "tensor", "auto", "resumed"])
def test_train_report_validates_and_round_trips(train_runs, name):
    data = _report(train_runs[name])
    assert_valid_report(data)
    assert data["schema_version"] == SCHEMA_VERSION and list(data)[0] == "schema_version"
    record = RunRecord.from_dict(data)
    assert record.to_dict() == data  # report.json is exactly the record's serialization
    assert isinstance(record.params[0], rec.Leaf) and isinstance(record.memory, MemoryRecord)
    assert record.memory.peak_estimate_bytes > 0 and record.stages == []
    # optional in the schema (older reports lack them), but every training run writes them
    assert record.input is not None and record.input.rows_read == record.processes[0].rows_read > 0
    if name == "auto":
        assert record.search and sum(c.chosen for c in record.search) == 1
        assert isinstance(record.search[0], rec.SearchCandidate)
    if name == "resumed":
        assert record.resumed_from_step == 2 and record.steps == 1


def test_train_report_says_where_the_start_up_went(train_runs):
    """timing.startup_breakdown: the phases to the first step, adding up to it; report.md words it in one row."""
    data = _report(train_runs["data"])
    breakdown = data["timing"]["startup_breakdown"]
    assert sum(breakdown["sequence_s"].values()) == pytest.approx(breakdown["process_to_first_step_s"], abs=0.01)
    assert breakdown["process_to_first_step_s"] == data["timing"]["phases_s"]["process_to_first_step"]
    with open(os.path.join(train_runs["data"], "report.md")) as f:
        assert "| start-up | " in f.read()


def test_inspect_run_dir_prints_the_same_valid_record(train_runs):
    out = run_cli("inspect", train_runs["tensor"], "--format", "json", timeout=120)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert_valid_report(printed)
    assert printed == _report(train_runs["tensor"])


# ----------------------------------------------------------------------------- Alpa dump folders
def _inspect_dump(name):
    out = run_cli("inspect", os.path.join(FIXTURES, name), "--format", "json", timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("name", DUMPS)
def test_inspect_dump_dir_report_validates(name):
    report = _inspect_dump(name)
    assert_valid_report(report)
    assert report["engine"] == "alpa" and report["memory"] is not None and report["stages"]
    assert RunRecord.from_dict(report).to_dict() == report


def _fixture_gib(name):
    """The total_allocation_size numbers of a fixture's *.mem_usage.txt files, in stage order."""
    paths = sorted(
        glob.glob(os.path.join(FIXTURES, name, "*.mem_usage.txt")),
        key=lambda p: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)],
    )
    return [float(open(p).read().split(":")[1].split()[0]) for p in paths]


def test_inspect_dump_dir_carries_pipeshard_memory_and_stages():
    """pipeshard_zero: 2 meshes, 4 executable stages (forward 0,1 then backward 2,3), one
    train_step_stage_<i>.mem_usage.txt each."""
    report = _inspect_dump("pipeshard_zero")
    gib = _fixture_gib("pipeshard_zero")
    assert gib == [0.004, 0.005, 0.011, 0.009]
    stage_bytes = [round(g * GIB) for g in gib]
    assert report["memory"]["stage_allocation_bytes"] == stage_bytes
    assert report["memory"]["total_allocation_bytes"] == sum(stage_bytes)
    stages = report["stages"]
    assert [(s["stage"], s["mesh"], s["submesh_shape"]) for s in stages] == [(0, 0, [2]), (1, 1, [2])]
    # forward stage i pairs with backward stage 2n-1-i on the same mesh
    assert (stages[0]["memory_bytes_forward"], stages[0]["memory_bytes_backward"]) == (stage_bytes[0], stage_bytes[3])
    assert (stages[1]["memory_bytes_forward"], stages[1]["memory_bytes_backward"]) == (stage_bytes[1], stage_bytes[2])
    assert stages[1]["memory_bytes"] == stage_bytes[1] + stage_bytes[2]
    # per-stage collectives come from that stage pair's HLO (expected.json: stage 1 all-gathers, 2 reduce-scatters)
    assert stages[1]["collectives"]["all-gather"]["count"] == 1
    assert stages[1]["collectives"]["reduce-scatter"]["count"] == 8
    assert report["devices"]["count"] == 4


def test_inspect_dump_dir_carries_shard_parallel_memory_and_stage():
    report = _inspect_dump("mesh2d_mp")
    assert report["memory"]["total_allocation_bytes"] == round(0.007 * GIB)
    assert report["memory"]["stage_allocation_bytes"] is None
    (stage,) = report["stages"]
    assert stage["mesh"] == 0 and stage["submesh_shape"] == [2, 2]
    assert stage["memory_bytes"] == round(0.007 * GIB)
    assert stage["collectives"] == report["collectives"]


@pytest.mark.parametrize("fmt", ["md", "table"])
def test_dump_memory_and_stages_are_rendered(fmt):
    out = run_cli("inspect", os.path.join(FIXTURES, "pipeshard_zero"), "--format", fmt, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "allocation 31138512 B" in out.stdout  # 0.029 GiB over 4 stages
    assert ("Pipeline stages" if fmt == "md" else "pipeline stages") in out.stdout


# ----------------------------------------------------------------------------- the live Alpa plan
class _FixtureExecutable:
    """What AlpaEngine reads from a compiled pipeshard executable, from a dump folder's files (the
    files are `str()` of the same PlacementSpec trees; alpa itself cannot run here)."""

    def __init__(self, folder):
        self.folder = folder

    def _text(self, suffix):
        with open(os.path.join(self.folder, "train_step" + suffix)) as f:
            return f.read()

    def get_input_placement_specs(self):
        return self._text("_input_placement_specs.txt")

    def get_output_placement_specs(self):
        return self._text("_output_placement_specs.txt")

    def get_stage_allocation_size(self):
        return [round(g * GIB) for g in _fixture_gib(os.path.basename(self.folder))]

    def get_hlo_text(self):
        return [self._text(f"_stage_{i}.hlo") for i in range(4)]


class _LiveAlpaEngine:
    """The inspection half of AlpaEngine on a fixture executable: the same helpers
    (alpa_live.dump_from_placement_specs, stage_layout, MemoryRecord) in the same places."""

    name, strategy, checkpoints = "alpa", "pipeshard-auto", False

    def __init__(self, executable, readable=True):
        from alpa_job.engines.base import CompileStats

        self.executable = executable
        self.stats = CompileStats(compiles=1, compile_seconds=1.5)
        self.stage_memory = None
        if readable:  # else: reading HLO/memory from the workers failed (a note, no numbers)
            self.stage_memory = executable.get_stage_allocation_size()
            memory = MemoryRecord.from_stage_bytes(self.stage_memory)
            self.stats.memory = {k: v for k, v in dataclasses.asdict(memory).items() if v is not None}
            self.stats.hlo_texts = executable.get_hlo_text()

    def plan(self):
        from alpa_job.record.alpa_live import dump_from_placement_specs

        return dump_from_placement_specs(self.executable.get_input_placement_specs(), self.executable.get_output_placement_specs()).plan

    def topology(self):
        return {
            "mesh": {"shape": [2, 2], "axes": ["node", "gpu"]},
            "process": {"id": 0, "count": 1, "local_devices": []},
            "devices": {"count": 4, "platform": "gpu", "kind": "A100"},
        }

    def extra_report(self):
        from alpa_job.record.alpa_live import stage_layout

        dp_result = (None, [[0, 1], [2, 3]], [(1, 2), (1, 2)], [(2,), (2,)], [{"force_batch_dim_to_mesh_dim": 0}] * 2)
        return {
            "alpa_method": {"strategy": "pipeshard-auto", "micro_batches": 2, "layer_num": 4},
            "stages": stage_layout(dp_result, self.stage_memory),
            "plan_cache": {"dir": "/tmp/plans", "key": "abc", "decision": "miss", "key_inputs": {}},
        }


@pytest.mark.parametrize("readable", [True, False], ids=["measured", "workers-unreadable"])
def test_live_alpa_plan_report_validates(readable, tmp_path):
    from alpa_job.inspect.write import write_report
    from alpa_job.record.report_file import build_report
    from alpa_job.train.loop import _result

    config = tiny_config("mlp", engine="alpa", strategy="pipeshard-auto", out=str(tmp_path))
    engine = _LiveAlpaEngine(_FixtureExecutable(os.path.join(FIXTURES, "pipeshard_zero")), readable)
    loop = {
        "steps": 2,
        "samples_seen": 32,
        "samples_dropped": 0,
        "loop_seconds": 0.5,
        "step_time_s": 0.25,
        "throughput": 64.0,
        "losses": [2.0, 1.5],
    }
    result = _result(config, engine, None, 0, 0, 1.25, loop)
    assert isinstance(result, ProcessResult)
    record = build_report(config, [result], address="local")
    write_report(record, str(tmp_path))
    data = _report(str(tmp_path))
    assert_valid_report(data)
    # the same leaves and labels as `inspect DUMP_DIR` on the folder the specs came from
    dump = _inspect_dump("pipeshard_zero")
    assert [(r["path"], r["strategy"]) for r in data["params"]] == [(r["path"], r["strategy"]) for r in dump["params"]]
    if readable:
        assert data["memory"]["stage_allocation_bytes"] == dump["memory"]["stage_allocation_bytes"]
        assert data["stages"][0]["layers"] == [0, 1] and data["stages"][1]["memory_bytes_backward"] > 0
        assert data["collectives"] == dump["collectives"]
    else:
        assert data["memory"] is None and data["collectives"] is None
        assert data["stages"][0]["memory_bytes_forward"] is None


# ----------------------------------------------------------------------------- old reports, drift, errors
def test_old_report_without_schema_version_loads(train_runs, tmp_path):
    """A report from before the typed record: no schema_version/stages/eval_loss/input/evals, the
    Alpa engine's older memory shape, `stages: null` from the old dump reader."""
    old = without_input(_report(train_runs["data"]))
    for key in ("schema_version", "stages", "eval_loss", "alpa_method", "plan_cache", "source"):
        old.pop(key)
    old["memory"] = {"stage_0": 100, "stage_1": 200}
    old["stages"] = None
    (tmp_path / "report.json").write_text(json.dumps(old))
    out = run_cli("inspect", str(tmp_path), "--format", "json", timeout=120)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert_valid_report(printed)
    assert printed["schema_version"] == SCHEMA_VERSION and printed["stages"] == []
    assert printed["memory"]["stage_allocation_bytes"] == [100, 200]
    assert printed["memory"]["total_allocation_bytes"] == 300
    assert printed["params"] == old["params"]
    assert printed["input"] is None and printed["evals"] == [] and printed["processes"][0]["rows_read"] is None


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d.update(schema_version=99), "schema_version 99 is newer than this kit reads"),
        (lambda d: d.pop("engine"), "not a run report"),
        (lambda d: d.update(params=[{"path": "x"}]), "does not match schema_version 1"),
    ],
)
def test_unreadable_report_is_a_one_line_error(train_runs, tmp_path, change, message):
    data = _report(train_runs["data"])
    change(data)
    (tmp_path / "report.json").write_text(json.dumps(data))
    out = run_cli("inspect", str(tmp_path), timeout=120)
    assert out.returncode != 0
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    with pytest.raises(KitError):
        RunRecord.from_dict(data)


@pytest.mark.parametrize(
    "where, mutate",
    [
        ("params/0", lambda d: d["params"][0].update(owner="me")),  # an extra key in a leaf row
        ("processes/0", lambda d: d["processes"][0].update(rank=0)),  # ... in a process row
        ("params/0", lambda d: d["params"][0].pop("strategy")),  # a missing key
        ("params/0/strategy", lambda d: d["params"][0].update(strategy="FSDP")),  # an unknown label
        ("memory/peak_estimate_bytes", lambda d: d["memory"].update(peak_estimate_bytes="12 MB")),  # a wrong type
        ("<root>", lambda d: d.update(extra_field=1)),  # a new top-level key nobody declared
    ],
)
def test_schema_catches_drift(train_runs, where, mutate):
    data = copy.deepcopy(_report(train_runs["data"]))
    mutate(data)
    errors = schema_errors(data)
    assert errors and any(e.startswith(where + ":") for e in errors), errors


SCHEMA_DEFS = {
    "meshShape": rec.MeshShape,
    "meshRecord": rec.MeshRecord,
    "leaf": rec.Leaf,
    "collective": rec.Collective,
    "memory": rec.MemoryRecord,
    "stage": rec.StageRecord,
    "process": rec.ProcessInfo,
    "devices": rec.DeviceInfo,
    "searchCandidate": rec.SearchCandidate,
    "summary": rec.Summary,
    "restart": rec.RestartRecord,
    "input": rec.InputRecord,
    "evalPoint": rec.EvalPoint,
}

# Keys added to schema_version 1 after reports were already written: declared, but optional, so a report
# from before them still validates as it is on disk (the kit writes them always: the record's to_dict).
ADDED_LATER = {
    "<root>": {
        "input",
        "evals",
        "notes",
        "stopped_at_step",
        "tensorboard",
        "compiler_options",
        "weight_gather",
        "network_traffic",
        "pipeline",
        "network_measured",
        "stragglers",
    },
    "process": {"rows_read", "bytes_read", "stopped_at_step", "nccl", "step_source"},
    "searchCandidate": {"predicted_from", "copy_step_time_s", "whole_compile_s"},
}


def test_schema_and_dataclasses_name_the_same_fields():
    """Rows a given report may lack (search candidates, stages) still cannot drift from the schema."""
    schema = rec.load_schema()
    for name, cls in SCHEMA_DEFS.items():
        fields = {f.name for f in dataclasses.fields(cls)}
        assert set(schema["$defs"][name]["properties"]) == fields, name
        assert set(schema["$defs"][name]["required"]) == fields - ADDED_LATER.get(name, set()), name
        assert schema["$defs"][name]["additionalProperties"] is False, name
    run_fields = {f.name for f in dataclasses.fields(RunRecord)} - {"final_state"}
    assert set(schema["properties"]) == run_fields
    assert set(schema["required"]) == run_fields - ADDED_LATER["<root>"]


def test_schema_ships_as_package_data():
    import tomllib

    with open(os.path.join(os.path.dirname(FIXTURES), "..", "pyproject.toml"), "rb") as f:
        globs = tomllib.load(f)["tool"]["setuptools"]["package-data"]["alpa_job"]
    assert "record/*.json" in globs
    assert os.path.isfile(rec.SCHEMA_PATH) and rec.SCHEMA_PATH.endswith(os.path.join("record", "report.schema.json"))


def test_process_results_merge_led_by_process_zero(train_runs):
    """Several processes' results (any order) -> one record of process 0 with every process listed."""
    base = ProcessResult.from_dict(_report(train_runs["data"]))
    results = []
    for pid, ip in ((2, "10.0.0.3"), (0, "10.0.0.1"), (1, "10.0.0.2")):
        r = copy.deepcopy(base)
        r.process = rec.ProcessInfo(id=pid, count=3, host=f"h{pid}", ip=ip)
        r.steps = 10 + pid
        results.append(r)
    record = RunRecord.from_processes(results, {"model": "mlp"}, created="now")
    assert record.process.id == 0 and record.steps == 10
    assert [p.id for p in record.processes] == [0, 1, 2]
    assert record.summary.processes == 3 and record.summary.hosts == 3
    assert_valid_report(record.to_dict())
    with pytest.raises(KitError, match="no process returned a result"):
        RunRecord.from_processes([], {})
