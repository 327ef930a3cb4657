"""Both engines behind one interface (alpa_job/engines/base.py), driven by one loop (train/loop.py).

* `Engine` is an ABC in two parts, the running part (`EngineRunner`) and the reporting part
  (`EngineReport`): Python itself refuses to make an engine that lacks an abstract member.
* The loop itself is proven with the real JAX engine (here and in test_train_core.py: ragged
  epochs, resume, checkpoints, compile once); its result is the typed ProcessResult.
* The Alpa engine cannot run here (no Alpa CUDA jaxlib), so it is held to the interface on the
  class under Python 3.11 (no abstract member left, the same parameters as the interface), and as an
  instance under the Alpa image's Python 3.9 (.venv39: real alpa 0.2.3 package, flax 0.6.2).
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any, Dict, List, Set

import pytest

from alpa_job.engines.alpa_engine import AlpaEngine, alpa_session
from alpa_job.engines.base import Engine, EngineReport, EngineRunner
from alpa_job.errors import KitError
from helpers_train import tiny_config

REPO = Path(__file__).resolve().parent.parent
VENV39_PY = REPO / ".venv39" / "bin" / "python"
NEEDS_VENV39 = pytest.mark.skipif(
    not VENV39_PY.exists(), reason=f"{VENV39_PY} not found (scripts/setup --test creates it: Python 3.9 with the real alpa 0.2.3 package)"
)


def _members(part: type) -> Set[str]:
    """The public names a part of the interface declares: methods, properties and annotated attributes."""
    return {n for n in list(vars(part)) + list(getattr(part, "__annotations__", {})) if not n.startswith("_")}


def signature_gaps(cls: type) -> List[str]:
    """How `cls`'s members differ in shape from the interface's (which the ABC does not check): a method
    takes the same parameters by name, and a property stays a property (or a class attribute)."""
    gaps: List[str] = []
    for name in sorted(_members(EngineRunner) | _members(EngineReport)):
        want = inspect.getattr_static(Engine, name, None)
        have = inspect.getattr_static(cls, name, None)
        if want is None or have is None:  # instance attributes (strategy, stats): Engine.__init__ sets them
            continue
        if isinstance(want, property):
            if callable(have) and not isinstance(have, property):
                gaps.append(f"{name}: is a method, the interface reads it as a property")
        elif callable(want):
            wanted, got = list(inspect.signature(want).parameters), list(inspect.signature(have).parameters)
            if wanted != got:
                gaps.append(f"{name}{tuple(got)}: the interface has {name}{tuple(wanted)}")
    return gaps


def test_the_interface_is_the_members_the_loop_uses_in_two_parts():
    running = {
        "name",
        "strategy",
        "checkpoints",
        "abstract_state",
        "compile",
        "init_state",
        "put_batch",
        "step",
        "to_floats",
        "wait",
        "wait_for_every_process",
        "eval_loss",
        "eval_sums",
    }
    reporting = {"stats", "watch_compiles", "plan", "topology", "extra_report", "notes", "peak_memory_bytes", "finish"}
    assert _members(EngineRunner) == running and _members(EngineReport) == reporting
    assert Engine.__abstractmethods__ == {
        "name",
        "abstract_state",
        "compile",
        "init_state",
        "put_batch",
        "step",
        "to_floats",
        "wait",
        "watch_compiles",
        "plan",
        "topology",
    }


def test_an_engine_that_lacks_a_member_cannot_be_made():
    """The ABC is the conformance check: a missing method or name is a TypeError naming it; the
    signature check names a renamed parameter and a method where the loop reads a property."""

    class Half(Engine):
        name = "half"

        def abstract_state(self):  # a method: the loop reads engine.abstract_state
            return None

        def step(self, state, batches):  # the loop calls step(state, batch)
            return state, 0.0

    with pytest.raises(TypeError, match=r"abstract method.*compile"):
        Half("data")
    gaps = "\n".join(signature_gaps(Half))
    assert "step('self', 'state', 'batches')" in gaps and "abstract_state: is a method" in gaps

    class Nameless(Engine):  # every method, but no `name`
        abstract_state = None
        compile = init_state = put_batch = step = to_floats = wait = watch_compiles = plan = topology = lambda self, *args: None

    with pytest.raises(TypeError, match=r"abstract method.*name"):
        Nameless("data")


def test_alpa_engine_class_has_the_whole_interface():
    assert issubclass(AlpaEngine, Engine) and not inspect.isabstract(AlpaEngine)
    assert signature_gaps(AlpaEngine) == []
    assert AlpaEngine.name == "alpa" and AlpaEngine.checkpoints is False


def test_one_loop_drives_the_jax_engine_to_a_typed_result():
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.record.run_record import ProcessResult
    from alpa_job.launch.runner import run_in_process

    assert issubclass(JaxEngine, Engine) and not inspect.isabstract(JaxEngine)
    assert signature_gaps(JaxEngine) == []
    engines: List[Any] = []

    def build(config, model, data):  # the default factory, keeping the engine for the asserts below
        from alpa_job.train.loop import build_jax_engine

        engines.append(build_jax_engine(config, model, data))
        return engines[0]

    from alpa_job.train.loop import train_process

    config = tiny_config("mlp", num_samples=40, epochs=2, remainder="pad")
    result = train_process(config, build_engine=build)
    assert isinstance(engines[0], Engine) and engines[0].strategy == "data"
    assert isinstance(result, ProcessResult)
    assert result.engine == "jax" and result.steps == 6 and result.samples_seen == 80  # 16+16+8 per epoch
    assert result.compiles == 1 and result.backend_compiles_during_loop == 0
    assert result.collectives is not None and result.memory.peak_estimate_bytes > 0
    assert result.process.id == 0 and result.devices.count == 8
    json.dumps(result.to_dict())  # plain data all the way down
    assert isinstance(run_in_process(config.replace(steps=1)), ProcessResult)


def test_loop_refuses_a_factory_that_returns_no_engine():
    from alpa_job.train.loop import train_process

    with pytest.raises(TypeError, match=r"object is not an alpa_job.engines.base.Engine: subclass it"):
        train_process(tiny_config("mlp", steps=1), build_engine=lambda config, model, data: object())


def test_checkpoint_flags_refused_for_alpa_before_joining(spec):
    """Alpa's state lives in DistributedArrays orbax cannot save: the session refuses the flags
    first (before the version guard, before Ray), instead of silently not checkpointing."""
    config = tiny_config("mlp", engine="alpa", strategy="data", checkpoint_every=2, address="10.0.0.1:6379")
    with pytest.raises(KitError, match="alpa engine does not checkpoint.*--engine jax"):
        with alpa_session(config, config.address, spec):
            pass


# ----------------------------------------------------------------------------- AlpaEngine's inspection
FIXTURE = REPO / "tests" / "alpa_fixtures" / "pipeshard_zero"  # a real alpa 0.2.3 pipeshard dump (make_dumps.py)


class DumpExecutable:
    """What AlpaEngine reads from a compiled pipeshard executable, answered from a dump folder's
    files (the placement specs are `str()` of the same PlacementSpec trees; alpa cannot run here)."""

    def __init__(self, folder: Path, hlo_error: Exception = None):
        self.folder, self.hlo_error, self.dumped_to = folder, hlo_error, None

    def _text(self, suffix: str) -> str:
        return (self.folder / f"train_step{suffix}").read_text()

    def get_input_placement_specs(self):
        return self._text("_input_placement_specs.txt")

    def get_output_placement_specs(self):
        return self._text("_output_placement_specs.txt")

    def get_stage_allocation_size(self):
        return [int(self.memory_gib()[i] * 1024**3) for i in range(4)]

    def memory_gib(self):
        return [float(self._text(f"_stage_{i}.mem_usage.txt").split(":")[1].split()[0]) for i in range(4)]

    def get_hlo_text(self):
        if self.hlo_error is not None:
            raise self.hlo_error
        return [self._text(f"_stage_{i}.hlo") for i in range(4)]

    def dump_debug_info(self, folder: str):
        self.dumped_to = folder


def _alpa_engine_on(executable):
    from alpa_job.engines.alpa_engine import AlpaCluster
    from alpa_job.models import get_model
    from alpa_job.train.loop import prepare_data

    config = tiny_config("mlp", engine="alpa", strategy="pipeshard-auto", micro_batches=2)
    data = prepare_data(config)
    engine = AlpaEngine(config, get_model(config), data.example, AlpaCluster(2, 1, "10.0.0.2", "A100"))
    engine.executable = executable  # what compile() would have set
    engine.read_executable(executable)
    return config, engine


def test_alpa_engine_inspection_feeds_the_loop_result(tmp_path):
    """AlpaEngine's own inspection code (read_executable, plan, topology, extra_report, finish) on
    a real pipeshard dump, through the loop's result builder: the typed ProcessResult."""
    from alpa_job.train.loop import _result, loop_statistics

    executable = DumpExecutable(FIXTURE)
    config, engine = _alpa_engine_on(executable)
    result = _result(config, engine, None, 0, 0, 1.25, loop_statistics(2, 32, 0, 0.5, [2.0, 1.5]))
    expected = json.loads((FIXTURE / "expected.json").read_text())
    assert result.engine == "alpa" and result.strategy == "pipeshard-auto"
    assert {r.path: r.strategy for r in result.params} == expected["leaves"]
    assert {r.path: r.strategy for r in result.batch_sharding} == expected["batch"]
    assert [m.shape for m in result.meshes] == [m["shape"] for m in expected["meshes"]]
    for kind, want in expected["collectives"].items():  # summed over the 4 stage executables
        assert (result.collectives[kind].count, result.collectives[kind].bytes) == (want["count"], want["bytes"])
    stage_bytes = executable.get_stage_allocation_size()
    assert result.memory.stage_allocation_bytes == stage_bytes
    assert result.memory.total_allocation_bytes == sum(stage_bytes)
    assert (result.mesh.shape, result.devices.count, result.devices.kind) == ([2, 1], 2, "A100")
    assert result.alpa_method == {"strategy": "pipeshard-auto", "micro_batches": 2, "layer_num": 4}
    assert result.eval_loss == 1.25 and result.losses == [2.0, 1.5] and result.process.count == 1
    engine.finish(str(tmp_path))
    assert executable.dumped_to == str(tmp_path / "alpa_dump")


def test_alpa_engine_unreadable_workers_are_a_note_naming_the_log(capsys):
    """The workers' KeyError (a stage never built there) costs the HLO and memory numbers, not the
    run: a note that points at that node's worker log."""
    err = KeyError("ray::MeshHostWorker.get_exec_hlo_text() (pid=4242, ip=10.0.0.3) KeyError: 17")
    _config, engine = _alpa_engine_on(DumpExecutable(FIXTURE, hlo_error=err))
    assert engine.stats.collectives() is None
    assert "worker-*-4242.err" in capsys.readouterr().err
    assert engine.plan().leaves  # the plan comes from the placement specs, which stayed readable


ALPA_ON_PY39 = """
    import json, sys
    from alpa_job.settings.config import JobConfig
    from alpa_job.engines.alpa_engine import AlpaCluster, AlpaEngine
    import inspect
    from alpa_job.engines.base import Engine
    from alpa_job.models import get_model
    from alpa_job.train.loop import prepare_data
    import jax

    config = JobConfig(model="mlp", model_args={"hidden_dim": 16}, num_samples=40, batch_size=8, engine="alpa",
                       strategy="pipeshard-manual", micro_batches=2).validated()
    data = prepare_data(config)
    engine = AlpaEngine(config, get_model(config), data.example, AlpaCluster(2, 2, "10.0.0.2", "A100"))
    state = engine.init_state(0)
    abstract = engine.abstract_state
    print("JSON" + json.dumps({
        "python": list(sys.version_info[:2]),
        "is_engine": isinstance(engine, Engine),
        "abstract": sorted(AlpaEngine.__abstractmethods__) + [inspect.isabstract(AlpaEngine)],
        "alpa_imported": "alpa" in sys.modules,
        "strategy": engine.strategy,
        "settings": engine.settings,
        "topology": engine.topology(),
        "same_shapes": [jax.numpy.shape(a) for a in jax.tree_util.tree_leaves(state)]
                       == [a.shape for a in jax.tree_util.tree_leaves(abstract)],
        "batch_is_host": engine.put_batch(data.example) is data.example,
    }))
"""


@NEEDS_VENV39
def test_alpa_engine_is_an_engine_on_python39():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=str(REPO))
    r = subprocess.run(
        [str(VENV39_PY), "-c", textwrap.dedent(ALPA_ON_PY39)], cwd=str(REPO), env=env, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr[-4000:]
    out: Dict[str, Any] = json.loads(r.stdout.split("JSON", 1)[1])
    assert out["python"] == [3, 9]
    assert out["is_engine"] and out["abstract"] == [False]
    assert not out["alpa_imported"]  # building the engine needs no Alpa runtime; compile() imports it
    assert out["strategy"] == "pipeshard-manual"
    assert out["settings"] == {"strategy": "pipeshard-manual", "micro_batches": 2, "stages": 2, "boundaries": [1]}
    assert out["topology"] == {
        "mesh": {"shape": [2, 2], "axes": ["node", "gpu"]},
        "process": {"id": 0, "count": 1, "local_devices": []},
        "devices": {"count": 4, "platform": "gpu", "kind": "A100"},
    }
    assert out["same_shapes"] and out["batch_is_host"]
