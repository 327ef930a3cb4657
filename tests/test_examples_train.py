"""The example packages trained by the kit as a user runs them: `python -m alpa_job train --model
llama_example.model:build --model-arg ...` with the example's folder on PYTHONPATH (what `pip install -e`
or `ray job submit --working-dir` gives), on 8 emulated CPU devices, every strategy; the report's labels
show the sharding; ResNet-50's BatchNorm with --pad-remainder compiles once; a checkpoint resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from alpa_job import api

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")
for _name in ("llama", "resnet"):
    if os.path.join(EXAMPLES, _name) not in sys.path:
        sys.path.insert(0, os.path.join(EXAMPLES, _name))

from llama_example import model as llama  # noqa: E402
from resnet_example import model as resnet  # noqa: E402

TINY_LLAMA = ["num_layers=2", "d_model=32", "num_heads=4", "num_kv_heads=2", "seq_len=16", "vocab_size=64"]
TINY_RESNET = ["stage_sizes=1,1,1,1", "base_width=8"]


def train(example, model_args, *flags, timeout=600):
    """One `python -m alpa_job train` run of an example, in-process (--address none); returns (proc, report)."""
    package = {"llama": "llama_example", "resnet": "resnet_example"}[example]
    args = [
        sys.executable,
        "-m",
        "alpa_job",
        "train",
        "--model",
        f"{package}.model:build",
        "--address",
        "none",
        "--devices",
        "8",
        "--batch-size",
        "16",
        "--num-samples",
        "64",
        "--compile-cache",
        "none",
    ]
    for arg in model_args:
        args += ["--model-arg", arg]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=os.pathsep.join([os.path.join(EXAMPLES, example), REPO]))
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(args + list(flags), capture_output=True, text=True, timeout=timeout, env=env)
    out = flags[list(flags).index("--out") + 1]
    report = None
    if os.path.isfile(os.path.join(out, "report.json")):
        with open(os.path.join(out, "report.json")) as f:
            report = json.load(f)
    return proc, report


def labels(report, prefix="params/"):
    return {row["path"]: row["strategy"] for row in report["params"] if row["path"].startswith(prefix)}


def test_the_builders_return_the_public_model_spec():
    import jax
    import jax.numpy as jnp

    for module, args, field in ((llama, llama.LlamaArgs(), "tokens"), (resnet, resnet.ResNetArgs(), "image")):
        spec = module.build(args, jnp.float32)
        assert isinstance(spec, api.Model) and spec.input_field == field
        batch = spec.synthetic(args, np.random.default_rng(0), 4)
        assert all(len(v) == 4 for v in batch.values())
        mode = {"train": False} if spec.batch_stats else {}  # BatchNorm reads its statistics, updates none
        variables = jax.eval_shape(lambda: spec.module.init(jax.random.PRNGKey(0), batch[field], **mode))
        outputs = jax.eval_shape(lambda v: spec.module.apply(v, batch[field], **mode), variables)
        assert jax.eval_shape(spec.loss, outputs, batch).shape == (4,)
    assert resnet.build(resnet.ResNetArgs(), jnp.float32).batch_stats is True


def test_llama_settings_and_their_checks():
    assert llama.mlp_dim_of(llama.LlamaArgs()) == 176  # 8/3 x 64 = 170.7, up to a multiple of 16
    assert llama.mlp_dim_of(llama.LlamaArgs(mlp_dim=100)) == 100
    with pytest.raises(ValueError, match="num_kv_heads=3 does not divide num_heads=4"):
        llama.build(llama.LlamaArgs(num_kv_heads=3), None)
    with pytest.raises(ValueError, match="stage_sizes='3,x' is not a list of block counts"):
        resnet.build(resnet.ResNetArgs(stage_sizes="3,x"), None)


def test_the_synthetic_data_are_learnable_patterns():
    tokens = llama.synthetic(llama.LlamaArgs(), np.random.default_rng(0), 8)["tokens"]
    stride = (tokens[:, 1:2] - tokens[:, :1]) % 256
    assert tokens.shape == (8, 33) and np.all((tokens[:, 1:] - tokens[:, :-1]) % 256 == stride)
    first = resnet.synthetic(resnet.ResNetArgs(), np.random.default_rng(1), 500)
    second = resnet.synthetic(resnet.ResNetArgs(), np.random.default_rng(2), 500)
    # The class colours agree between calls (processes): a class's mean image is the same in both.
    for data in (first, second):
        assert data["image"].shape == (500, 32, 32, 3) and data["label"].max() < 10
    c = first["label"][0]
    np.testing.assert_allclose(
        first["image"][first["label"] == c].mean(axis=(0, 1, 2)), second["image"][second["label"] == c].mean(axis=(0, 1, 2)), atol=0.05
    )


@pytest.mark.parametrize(
    "strategy, label",
    [
        ("data", "ZeRO"),  # its sharded update keeps every weight split over the data axis between steps
        ("fsdp", "ZeRO"),  # every weight split over the data axis
        ("tensor", "MP"),  # heads, mlp and vocab over the model axis
        pytest.param("auto", None, marks=pytest.mark.slow),
    ],
)
def test_llama_trains_with_every_strategy(strategy, label, tmp_path):
    out = str(tmp_path / "run")
    # auto on 2 devices: its 3 candidates (data, fsdp, tensor) prove a user's model searches as well as 8's many
    devices = ["--devices", "2"] if strategy == "auto" else []
    proc, report = train("llama", TINY_LLAMA, "--strategy", strategy, "--steps", "2", "--out", out, *devices)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["status"] == "ok" and report["steps"] == 2 and report["compiles"] == 1
    found = labels(report)
    if label is not None:
        assert label in found.values(), found
    if strategy == "tensor":
        assert found["params/layer_0/mlp/gate/kernel"] == "MP" and found["params/layer_0/attention/query/kernel"] == "MP"
    if strategy == "fsdp":
        assert found["params/layer_0/attention/out/kernel"] == "ZeRO"


def test_llama_declares_its_depth_so_auto_can_rank_on_copies(tmp_path):
    out = str(tmp_path / "run")
    deep = [a for a in TINY_LLAMA if not a.startswith("num_layers=")] + ["num_layers=6"]
    proc, report = train(
        "llama",
        deep,
        "--strategy",
        "auto",
        "--auto-rank-on",
        "copies",
        "--auto-trial-steps",
        "1",
        "--devices",
        "2",
        "--steps",
        "2",
        "--out",
        out,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    timed = [row for row in report["search"] if row["step_time_s"]]
    assert timed and all(row["predicted_from"] == [1, 3] for row in timed), report["search"]
    assert report["status"] == "ok" and report["steps"] == 2 and report["compiles"] == 1


def test_the_seeds_resnet50_trains_with_pad_remainder_in_one_compile_and_inspects(tmp_path):
    # The full ResNet-50 (3-4-6-3 bottlenecks, width 64) on CIFAR-10 shapes: 12 samples in batches of 8
    # leave a ragged last batch each epoch, padded and masked; with BatchNorm's statistics under fsdp, the
    # step still compiles once over both epochs.
    out = str(tmp_path / "run")
    proc, report = train(
        "resnet", [], "--batch-size", "8", "--num-samples", "12", "--epochs", "2", "--pad-remainder", "--strategy", "fsdp", "--out", out
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["compiles"] == 1 and report["steps"] == 4 and report["samples_dropped"] == 0
    assert "ZeRO" in labels(report).values()
    assert report["config"]["model_args"]["stage_sizes"] == "3,4,6,3"
    params = [row for row in report["params"] if row["path"].startswith("params/")]
    assert sum(int(np.prod(row["shape"])) for row in params) == 23_520_842
    assert report["versions"]["alpa_job_api"] == api.API_VERSION
    shown = subprocess.run(
        [sys.executable, "-m", "alpa_job", "inspect", out, "--format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    read = json.loads(shown.stdout)  # inspect reads the run back without the example on its path
    assert read["config"]["model"] == "resnet_example.model:build"
    assert labels(read) == labels(report)


def test_llama_checkpoint_resumes(tmp_path):
    out = str(tmp_path / "run")
    proc, first = train("llama", TINY_LLAMA, "--steps", "2", "--epochs", "4", "--checkpoint-every", "1", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, resumed = train("llama", TINY_LLAMA, "--steps", "4", "--epochs", "4", "--checkpoint-every", "1", "--resume", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 2
