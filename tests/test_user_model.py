"""A model from outside the kit: a real package's builder (`--model PACKAGE.MODULE:FUNCTION`, or an
installed entry point `--model NAME`), its settings from `--model-arg KEY=VALUE` / YAML `model_args:`
typed by its own declaration, trained end to end; every mistake a one-line error with exit 2."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from typing import Optional

import pytest

from alpa_job.api import API_VERSION
from alpa_job.errors import KitError
from alpa_job.models import model_values
from alpa_job.settings.config import build_config
from alpa_job.setting import ModelArgs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "usermodels"

NET = """
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Tuple

import flax.linen as nn
import numpy as np

from alpa_job import api


@dataclasses.dataclass(frozen=True)
class Args:
    width: int = 16
    layers: int = dataclasses.field(default=1, metadata={"check": api.POSITIVE, "help": "dense pairs"})
    noise: float = 0.1
    shape: Tuple[int, int] = (1, 2)  # no flag carries a tuple: fixed at its default


class Net(nn.Module):
    width: int
    layers: int
    dtype: Any = None
    axes: bool = True

    @nn.compact
    def __call__(self, x):
        up, down = (api.EMBED, api.MLP), (api.MLP, api.EMBED)
        init = nn.initializers.lecun_normal()
        for _ in range(self.layers):
            x = nn.relu(nn.Dense(4 * self.width, dtype=self.dtype,
                                 kernel_init=api.logical(init, up) if self.axes else init)(x))
            x = nn.Dense(self.width, dtype=self.dtype, kernel_init=api.logical(init, down) if self.axes else init)(x)
        return x


def synthetic(args, rng, n):
    x = rng.normal(size=(n, args.width)).astype(np.float32)
    return {"x": x, "y": (0.5 * x + args.noise * rng.normal(size=x.shape)).astype(np.float32)}


def build(args: Args, dtype) -> api.Model:
    return api.Model(Net(args.width, args.layers, dtype), input_field="x", loss=api.mse, synthetic=synthetic)


def build_kw(*, dtype, width: int = 8, layers: int = 1, noise=0.1):
    return build(Args(width, layers, noise), dtype)


@dataclasses.dataclass
class Needs:
    width: int


def build_needs(args: Needs, dtype):
    return build(Args(args.width), dtype)


def build_no_axes(*, dtype, width: int = 512):  # default: a 4 MiB kernel, over the unnamed limit
    return api.Model(Net(width, 1, dtype, axes=False), input_field="x", loss=api.mse,
                     synthetic=lambda args, rng, n: synthetic(Args(width), rng, n))


def build_scalar_loss(*, dtype, width: int = 16):
    return api.Model(Net(width, 1, dtype), input_field="x", loss=lambda out, batch: ((out - batch["y"]) ** 2).mean(),
                     synthetic=lambda args, rng, n: synthetic(Args(width), rng, n))


def build_module(*, dtype):
    return Net(16, 1, dtype)


def build_untyped(config, dtype):
    return build(Args(), dtype)


def build_deep(*, dtype, width: int = 8, layers: int = 6, noise: float = 0.1):
    return dataclasses.replace(build(Args(width, layers, noise), dtype), depth_setting="layers")


def build_bad_depth(*, dtype, width: int = 8):
    return dataclasses.replace(build(Args(width), dtype), depth_setting="depth")
"""

BROKEN = """
import not_a_real_dependency_of_the_kit  # noqa: F401
"""

ENTRY_POINTS = f"""
[alpa_job.models]
tiny = {PACKAGE}.net:build
"""


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """A folder holding the package (`usermodels.net`, `usermodels.broken`) and its installed metadata
    (a dist-info whose entry point `tiny` names usermodels.net:build), as `pip install` leaves them."""
    root = tmp_path_factory.mktemp("site")
    pkg = root / PACKAGE
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "net.py").write_text(textwrap.dedent(NET))
    (pkg / "broken.py").write_text(BROKEN)
    dist = root / f"{PACKAGE}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    return str(root)


def _cli(packages, *args, timeout=300):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=f"{packages}{os.pathsep}{REPO}")
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "alpa_job", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def _train(packages, out, *args):
    return _cli(
        packages,
        "train",
        "--steps",
        "2",
        "--address",
        "none",
        "--num-samples",
        "64",
        "--batch-size",
        "16",
        "--compile-cache",
        "none",
        "-q",
        "--out",
        str(out),
        *args,
    )


def _report(out):
    return json.loads((out / "report.json").read_text())


# ----------------------------------------------------------------------------- trained end to end
def test_a_dataclass_builder_trains_from_the_command_line(packages, tmp_path):
    proc = _train(
        packages,
        tmp_path / "run",
        "--model",
        f"{PACKAGE}.net:build",
        "--model-arg",
        "width=32",
        "--model-arg",
        "layers=2",
        "--strategy",
        "fsdp",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _report(tmp_path / "run")
    assert report["config"]["model"] == f"{PACKAGE}.net:build"
    # Every declared setting is recorded, typed: the given ones and the defaults (the tuple is fixed).
    assert report["config"]["model_args"] == {"width": 32, "layers": 2, "noise": 0.1}
    assert report["versions"]["alpa_job_api"] == API_VERSION
    assert report["status"] == "ok" and report["steps"] == 2 and report["compiles"] == 1
    kernels = [p for p in report["params"] if p["path"].startswith("params/") and p["path"].endswith("kernel")]
    assert kernels and all(any(p["split_axes"]) for p in kernels), kernels  # fsdp split them by their logical axes


def test_plan_takes_a_users_builder_and_its_model_args(packages, tmp_path):
    """`plan --model PKG.MODULE:FN --model-arg K=V` plans that model with those args (it used to end in a
    traceback reading the flags' KEY=VALUE texts as a mapping)."""
    proc = _cli(
        packages,
        "plan",
        "--model",
        f"{PACKAGE}.net:build",
        "--model-arg",
        "width=32",
        "--model-arg",
        "layers=2",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--strategy",
        "data",
        "--batch-size",
        "16",
        "--out",
        str(tmp_path / "plan"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["settings"]["model_args"] == {"width": 32, "layers": 2, "noise": 0.1}  # typed, as train records
    assert plan["model"] == f"{PACKAGE}.net:build"


def test_small_parameters_without_axis_names_stay_whole_under_fsdp_with_a_note(packages, tmp_path):
    """A model whose weights name no logical axes but are small (16 x 64: 4 KiB) trains under fsdp: they stay
    whole on every device, and the report says which."""
    proc = _train(packages, tmp_path / "run", "--model", f"{PACKAGE}.net:build_no_axes", "--model-arg", "width=16", "--strategy", "fsdp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = _report(tmp_path / "run")
    (note,) = [n for n in report["notes"] if "name no logical axes" in n]
    assert "2 parameter(s)" in note and "Dense_0/kernel (16, 64)" in note and "Dense_1/kernel (64, 16)" in note
    kernels = [p for p in report["params"] if p["path"].startswith("params/") and p["path"].endswith("kernel")]
    assert kernels and not any(any(p["split_axes"]) for p in kernels), kernels  # whole on every device


def test_a_keyword_builder_takes_yaml_model_args_and_flags_override_one_key(packages, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {PACKAGE}.net:build_kw\nmodel_args:\n  width: 8\n  noise: 0.2\n")
    proc = _train(packages, tmp_path / "run", "--config", str(job), "--model-arg", "noise=0.3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _report(tmp_path / "run")["config"]["model_args"] == {"width": 8, "layers": 1, "noise": 0.3}


def test_an_installed_entry_point_is_a_model_name(packages, tmp_path):
    proc = _train(packages, tmp_path / "run", "--model", "tiny", "--model-arg", "width=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _report(tmp_path / "run")["config"]["model"] == "tiny"
    helped = _cli(packages, "train", "--help")
    assert "installed: tiny" in " ".join(helped.stdout.split())
    typo = _cli(packages, "train", "--model", "tinny")
    assert typo.returncode == 2
    assert typo.stderr.strip() == (
        "error: --model 'tinny' is not known; use one of: mlp, wide_resnet, gpt, tiny, or "
        "your own builder as PACKAGE.MODULE:FUNCTION (did you mean tiny?)"
    )


def test_the_in_process_runner_trains_a_user_model(packages, tmp_path, monkeypatch):
    from alpa_job.launch.runner import run_job

    monkeypatch.syspath_prepend(packages)
    try:
        config = build_config(
            {},
            {
                "model": f"{PACKAGE}.net:build_kw",
                "model_args": ["width=8"],
                "steps": 2,
                "num_samples": 32,
                "batch_size": 16,
                "address": "none",
                "compile_cache": "none",
                "out": str(tmp_path / "run"),
            },
        )
        record, _paths = run_job(config)
        assert record.steps == 2 and record.compiles == 1
        assert dict(record.config["model_args"]) == {"width": 8, "layers": 1, "noise": 0.1}
    finally:
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]


def test_auto_ranks_a_user_model_on_copies_built_from_its_depth_setting(packages, tmp_path, monkeypatch):
    from alpa_job.launch.runner import run_job

    monkeypatch.syspath_prepend(packages)
    try:
        config = build_config(
            {},
            {
                "model": f"{PACKAGE}.net:build_deep",
                "model_args": ["layers=8"],
                "steps": 2,
                "num_samples": 32,
                "batch_size": 16,
                "address": "none",
                "compile_cache": "none",
                "strategy": "auto",
                "auto_rank_on": "copies",
                "auto_trial_steps": 1,
                "out": str(tmp_path / "run"),
            },
        )
        record, _paths = run_job(config)
        timed = [r for r in record.search if r.step_time_s]
        assert timed and all(r.predicted_from == [1, 3] and "for 8 layers" in r.note for r in timed)
        assert record.steps == 2 and dict(record.config["model_args"])["layers"] == 8  # the copies left it whole
    finally:
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]


def test_checkpoints_resume_a_user_model_only_with_its_settings(packages, tmp_path):
    out = tmp_path / "run"
    model = ["--model", f"{PACKAGE}.net:build", "--checkpoint-every", "2"]
    first = _train(packages, out, *model, "--model-arg", "width=8")
    assert first.returncode == 0, first.stderr[-3000:]
    other = _train(packages, out, *model, "--model-arg", "width=16", "--resume", "--steps", "4")
    assert other.returncode == 2
    assert other.stderr.strip() == (
        f"error: --resume: the checkpoint in {out} is of another model: --model-arg "
        "width=8 (now 16); resume with the same model settings or use another --out"
    )
    same = _train(packages, out, *model, "--model-arg", "width=8", "--resume", "--steps", "4")
    assert same.returncode == 0, same.stderr[-3000:]
    assert _report(out)["resumed_from_step"] == 2 and _report(out)["steps"] == 2


# ----------------------------------------------------------------------------- bad input
BAD = [
    (
        ["--model", "nothere.net:build"],
        r"--model nothere.net:build: cannot import nothere.net \(No module named 'nothere'\); install its package or "
        r"put the folder that holds it on PYTHONPATH .*",
    ),
    (
        ["--model", f"{PACKAGE}.broken:build"],
        rf"--model {PACKAGE}.broken:build: importing {PACKAGE}.broken failed: No module named "
        r"'not_a_real_dependency_of_the_kit'; install what it imports",
    ),
    (
        ["--model", f"{PACKAGE}.net:buld"],
        rf"--model {PACKAGE}.net:buld: {PACKAGE}.net has no buld \(did you mean build\?\); its functions: build, .*",
    ),
    (
        ["--model", f"{PACKAGE}.net:build_module"],
        rf"--model {PACKAGE}.net:build_module returned the flax module Net, not an alpa_job.api.Model; wrap it: .*",
    ),
    (
        ["--model", f"{PACKAGE}.net:build_untyped"],
        r".*build_untyped's parameter 'config' has no type hint or default; declare its settings as a dataclass .*",
    ),
    (
        ["--model", f"{PACKAGE}.net:build", "--model-arg", "widht=3"],
        rf"--model-arg widht: --model {PACKAGE}.net:build has no setting 'widht' \(did you mean width\?\); its "
        r"settings: width, layers, noise",
    ),
    (["--model", f"{PACKAGE}.net:build", "--model-arg", "width=wide"], r"--model-arg width: 'wide' is not a valid int"),
    (["--model", f"{PACKAGE}.net:build", "--model-arg", "layers=0"], r"--model-arg layers must be a positive integer, got 0"),
    (
        ["--model", f"{PACKAGE}.net:build", "--model-arg", "shape=3"],
        r"--model-arg shape: .* declares it as Tuple\[int, int\], which --model-arg cannot give; .*",
    ),
    (
        ["--model", f"{PACKAGE}.net:build_needs"],
        rf"--model {PACKAGE}.net:build_needs needs --model-arg width=<int> \(declared without a default\)",
    ),
    (
        ["--model", f"{PACKAGE}.net:build", "--model-arg", "width"],
        r"--model-arg 'width' is not KEY=VALUE; write e.g. --model-arg num_layers=4",
    ),
    (
        ["--model", f"{PACKAGE}.net:build_no_axes", "--strategy", "tensor"],
        r"--strategy tensor splits parameters by their logical axes, and --model .*build_no_axes's parameter "
        r"Dense_0/kernel \(shape \(512, 2048\), 4\.0 MiB\) carries none; wrap its initializer with "
        r"alpa_job.api.logical.*\(parameters under 1\.0 MiB may go unnamed: they stay whole on every device\)",
    ),
    (
        ["--model", f"{PACKAGE}.net:build_scalar_loss"],
        r"--model .*build_scalar_loss: its loss returns shape \(\) for a batch of 16 rows; return one loss per "
        r"example, shape \(16,\).*",
    ),
    (
        ["--model", f"{PACKAGE}.net:build", "--num-layers", "2"],
        r"--num-layers does nothing here: it sizes --model gpt, and --model .* takes its settings as --model-arg.*",
    ),
    (
        ["--model", f"{PACKAGE}.net:build_bad_depth"],
        r"--model .*build_bad_depth: its Model's depth_setting 'depth' is not one of its int settings \(width\); "
        r"name the setting that counts its repeated layers, or drop depth_setting",
    ),
    (
        ["--model", "gpt", "--model-arg", "num_layer=2"],
        r"--model-arg num_layer: --model gpt has no setting 'num_layer' \(did you mean num_layers\?\); .*",
    ),
]


@pytest.mark.parametrize("args, message", BAD, ids=[" ".join(a[1:]) for a, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(packages, tmp_path, args, message):
    proc = _train(packages, tmp_path / "run", *args)
    # A mistake found when the step is built (after the run directory exists) also leaves the failed run's
    # report, announced on its own line; every other line is the one error.
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("[alpa_job] failed")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.fullmatch("error: " + message, lines[0]), lines[0]
    if "[alpa_job] failed" in proc.stderr:
        assert _report(tmp_path / "run")["status"] == "failed"


# ----------------------------------------------------------------------------- the setting itself
def test_model_args_are_frozen_picklable_and_json():
    config = build_config({"model": f"{PACKAGE}.net:build", "model_args": {"width": 8}}, {"model_args": ["layers=2"]})
    assert config.model_args == {"width": 8, "layers": "2"}  # typed by the builder's declaration, in the driver
    with pytest.raises(TypeError):
        config.model_args["width"] = 4
    assert pickle.loads(pickle.dumps(config)) == config and hash(config) == hash(pickle.loads(pickle.dumps(config)))
    assert json.loads(json.dumps(config.as_dict()))["model_args"] == {"width": 8, "layers": "2"}
    assert isinstance(config.replace(steps=3).model_args, ModelArgs)


def test_a_built_in_takes_its_sizes_as_model_args_too():
    assert model_values(build_config({}, {"model": "gpt", "model_args": ["num_layers=3"]}))["num_layers"] == 3
    assert model_values(build_config({"model": "gpt", "model_args": {"d_model": 64}}, {}))["d_model"] == 64
    with pytest.raises(KitError, match=r"--num-layers 2 and --model-arg num_layers=3 disagree; give one of them"):
        build_config({}, {"model": "gpt", "model_args": ["num_layers=3"]}, {"num_layers": 2})


def test_naming_a_builder_imports_nothing_before_the_run():
    """The config checks `--model PACKAGE.MODULE:FUNCTION` by its form; the builder's module (and jax with
    it) is imported by the runner, which sets the CPU devices first."""
    code = (
        "import sys; from alpa_job.settings.config import build_config; "
        "build_config({'model': 'nothere.net:build', 'model_args': {'a': 1}}, {}); "
        "print('jax' in sys.modules, 'nothere' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "False"]


def test_the_stored_step_is_keyed_by_the_models_source(packages, tmp_path, monkeypatch):
    """A compiled step stored for one version of the user's model never loads for an edited one."""
    import shutil

    from alpa_job.models import source_digest

    copy = tmp_path / "site"
    shutil.copytree(os.path.join(packages, PACKAGE), copy / PACKAGE)
    monkeypatch.syspath_prepend(str(copy))
    try:
        config = build_config({}, {"model": f"{PACKAGE}.net:build"})
        before = source_digest(config)
        assert before and source_digest(build_config({}, {"model": "gpt"})) is None
        (copy / PACKAGE / "net.py").write_text((copy / PACKAGE / "net.py").read_text() + "\n# edited\n")
        from alpa_job.models import builders

        assert builders.source_digest(sys.modules[f"{PACKAGE}.net"].build) != before
    finally:
        for name in [n for n in sys.modules if n == PACKAGE or n.startswith(PACKAGE + ".")]:
            del sys.modules[name]


# ----------------------------------------------------------------------------- declarations, read without jax
@dataclasses.dataclass
class _Args:
    layers: int = 2
    rate: float = 0.5
    tied: bool = False
    name: Optional[str] = None


def _by_dataclass(args: _Args, dtype):
    return args


def _by_keywords(*, dtype, layers: int = 2, rate=0.5, **_ignored):
    return layers


def test_a_declaration_is_read_from_a_dataclass_or_typed_keywords():
    from alpa_job.models import builders

    for function, style in ((_by_dataclass, builders.DATACLASS), (_by_keywords, builders.KEYWORDS)):
        builder = builders.Builder("m", "t:f", function, builders.declaration_of("m", function))
        assert builder.declaration.style == style
        typed = builders.typed_args(builder, {"layers": "3", "rate": "1"})
        assert typed["layers"] == 3 and typed["rate"] == 1.0 and type(typed["rate"]) is float
    dataclass_builder = builders.Builder("m", "t:f", _by_dataclass, builders.declaration_of("m", _by_dataclass))
    typed = builders.typed_args(dataclass_builder, {"tied": "yes", "name": "x"})
    assert dict(typed) == {"layers": 2, "rate": 0.5, "tied": True, "name": "x"}
    assert builders.args_object(dataclass_builder, typed) == _Args(2, 0.5, True, "x")
    with pytest.raises(KitError, match=r"--model-arg tied: 'maybe' is not a valid bool"):
        builders.typed_args(dataclass_builder, {"tied": "maybe"})


@pytest.mark.parametrize(
    "builder, strategy, message",
    [
        ("build_no_axes", "tensor", r"--strategy tensor splits parameters by their logical axes, .* carries none; .*"),
        ("build_scalar_loss", "data", r"--model .*build_scalar_loss: its loss returns shape \(\) for a batch of \d+ rows.*"),
    ],
    ids=["no-logical-axes", "scalar-loss"],
)
def test_a_model_bound_for_ray_is_checked_before_ray_starts(packages, tmp_path, builder, strategy, message):
    # On Ray the engine builds inside the JAX processes; the driver checks the same on abstract shapes
    # first, so the mistake is one line and no Ray (nor run directory) is ever started.
    out = tmp_path / "run"
    proc = _cli(
        packages,
        "train",
        "--address",
        "local",
        "--model",
        f"{PACKAGE}.net:{builder}",
        "--strategy",
        strategy,
        "--steps",
        "2",
        "--num-samples",
        "64",
        "--batch-size",
        "16",
        "--compile-cache",
        "none",
        "--out",
        str(out),
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and re.fullmatch("error: " + message, lines[0]), proc.stderr[-3000:]
    assert not out.exists()  # the run never started: no run directory, no Ray
