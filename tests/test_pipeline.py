"""Pipeline stages in the JAX engine (`--strategy pipeline`): the repeated blocks cut into stages over the
mesh's `stage` axis, GPipe's schedule over micro-batches. Same numbers as `data` on the same global batch;
one line for what cannot be pipelined; the report says where each block runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jsonschema
import numpy as np
import pytest

from alpa_job import strategies
from alpa_job.data import epoch_batches, synthetic
from alpa_job.errors import KitError
from alpa_job.record.run_record import load_schema
from alpa_job.settings.config import JobConfig
from helpers_train import tiny_config

REPO = Path(__file__).resolve().parent.parent
GPT4 = dict(num_layers=4, batch_size=32, num_samples=128)


def _losses(config, strategy, mesh, steps=20):
    """Per-step losses of `steps` steps (fp32) over the epoch's batches, and the engine."""
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.models import get_model

    model = get_model(config)
    batches = [b for b, _ in epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0)]
    engine = JaxEngine(config, model, batches[0], strategy, mesh)
    engine.compile()
    state, losses = engine.init_state(0), []
    for step in range(steps):
        state, loss = engine.step(state, engine.put_batch(batches[step % len(batches)]))
        losses.append(float(loss))
    return losses, engine, state, batches


@pytest.fixture(scope="module")
def gpt_data():
    return _losses(tiny_config("gpt", **GPT4), "data", (8, 1))[0]


@pytest.mark.parametrize(
    "strategy, mesh, micro, repeats",
    [
        ("pipeline", (2, 4), 4, 1),
        ("pipeline", (4, 2), 2, 1),
        ("pipeline-fsdp", (2, 4), 4, 1),
        ("pipeline", (2, 4), 2, 2),
        ("pipeline", (2, 4), 4, 2),
    ],
)
def test_a_pipelined_gpt_computes_the_losses_data_does(gpt_data, strategy, mesh, micro, repeats):
    """2 stages x data 4 (two blocks a stage, 4 micro-batches) and 4 stages x data 2 (one block a stage),
    2 x 4 with each stage's state split over its 4 devices (pipeline-fsdp), and the circular schedule (each
    stage two chunks of one block, the micro-batches going round twice, handed back from the last stage with
    no tick to wait (M = S) or kept two ticks (M = 2S)): 20 steps, fp32, equal to data's to 1e-5 relative."""
    config = tiny_config("gpt", micro_batches=micro, pipeline_repeats=repeats, **GPT4)
    losses, engine, state, batches = _losses(config, strategy, mesh)
    np.testing.assert_allclose(losses, gpt_data, rtol=1e-5)
    if repeats > 1:  # stage s holds chunks s and s + 2, in the model's order: (repeats, layers) over stages
        from alpa_job.inspect.render import pipeline_text

        described = engine.pipeline.describe([[0], [0]])
        assert described["layers"][0]["blocks"] == ["DecoderBlock_0", "DecoderBlock_2"]
        jsonschema.validate(described, load_schema()["properties"]["pipeline"])  # as the report holds it
        assert described["bubble_fraction"] == round(1 / (2 * micro + 1), 4)
        assert pipeline_text(described) == (
            f"2 stages x {micro} micro-batches (circular, bubble {1 / (2 * micro + 1):.0%}): stage 0: DecoderBlock_0 "
            "+ DecoderBlock_2 on process(es) 0; stage 1: DecoderBlock_1 + DecoderBlock_3 on process(es) 0"
        )
        specs = {leaf.sharding.spec[:2] for leaf in jax.tree_util.tree_leaves(state.params["pipeline_blocks"])}
        assert specs == {(None, "stage")}, specs
    if strategy == "pipeline-fsdp":  # the stage's devices hold a quarter of its state each, or close to it
        from alpa_job.engines.jax_engine import JaxEngine  # the plain pipeline's state, built, not compiled

        plain = JaxEngine(engine.config, engine.model, batches[0], "pipeline", mesh)
        assert engine.state_bytes_per_device < 0.35 * plain.state_bytes_per_device
        blocks = state.params["pipeline_blocks"]
        specs = [leaf.sharding.spec for leaf in jax.tree_util.tree_leaves(blocks) if leaf.ndim > 2]
        assert specs and all(spec[0] == "stage" and "data" in spec[1:] for spec in specs), specs
    assert gpt_data[-1] < gpt_data[0]  # it trained
    # Eval through the same stages: the mean over the batch's rows is the step's loss before its update.
    total, rows = engine.eval_sums(state, engine.put_batch(batches[0]))
    assert float(rows) == 32 and np.isfinite(float(total))


def test_the_blocks_stay_on_their_stage_and_the_report_says_where(tmp_path):
    """The stacked blocks (and their optimizer state) are split over stages, the shell is whole; the
    report names each stage's blocks and processes and the bubble, as do inspect and the mesh picture."""
    out = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "alpa_job",
        "train",
        "--model",
        "gpt",
        "--num-layers",
        "4",
        "--d-model",
        "32",
        "--num-heads",
        "4",
        "--seq-len",
        "16",
        "--vocab-size",
        "64",
        "--strategy",
        "pipeline",
        "--devices",
        "8",
        "--batch-size",
        "32",
        "--micro-batches",
        "4",
        "--steps",
        "3",
        "--address",
        "none",
        "--out",
        str(out),
    ]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["mesh"] == {"shape": [2, 4], "axes": ["stage", "data"]}
    pipeline = report["pipeline"]
    assert pipeline["stages"] == 2 and pipeline["micro_batches"] == 4 and pipeline["schedule"] == "gpipe"
    assert pipeline["bubble_fraction"] == pytest.approx(1 / 5)
    assert [row["blocks"] for row in pipeline["layers"]] == [["DecoderBlock_0", "DecoderBlock_1"], ["DecoderBlock_2", "DecoderBlock_3"]]
    by_path = {leaf["path"]: leaf for leaf in report["params"]}
    blocks = [leaf for path, leaf in by_path.items() if path.startswith("params/pipeline_blocks/")]
    shell = [leaf for path, leaf in by_path.items() if path.startswith("params/") and "pipeline_blocks" not in path]
    assert blocks and all(leaf["shape"][0] == 4 and leaf["split_axes"][0] == ["stage"] for leaf in blocks)
    assert all(leaf["strategy"] == "MP" for leaf in blocks)  # split by layers over the stages
    assert shell and all(not any(leaf["split_axes"]) for leaf in shell)
    assert "2 stages x 4 micro-batches (gpipe, bubble 20%)" in (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    assert "stage 1: DecoderBlock_2..DecoderBlock_3, process(es) 0" in page


def test_a_users_model_pipelines_through_its_declared_blocks():
    """The LLaMA example (a user's package) declares repeated_blocks: its pipelined losses equal data's."""
    sys.path.insert(0, str(REPO / "examples" / "llama"))
    try:
        args = {"num_layers": "2", "d_model": "32", "num_heads": "4", "num_kv_heads": "2", "seq_len": "16", "vocab_size": "64"}
        config = JobConfig(
            model="llama_example.model:build",
            model_args=args,
            batch_size=16,
            num_samples=64,
            epochs=1,
            address="none",
            devices=8,
            learning_rate=3e-3,
            micro_batches=2,
        ).validated()
        data, *_ = _losses(config, "data", (8, 1), steps=5)
        pipelined, *_ = _losses(config, "pipeline", (2, 4), steps=5)
    finally:
        sys.path.remove(str(REPO / "examples" / "llama"))
    np.testing.assert_allclose(pipelined, data, rtol=1e-5)


def test_stage_counts_default_to_one_per_host_and_refuse_idle_devices():
    pipeline = strategies.get("pipeline")
    assert pipeline.mesh_shape(6, devices_per_process=2) == (3, 2)  # one stage a host
    assert pipeline.mesh_shape(8) == (2, 4)  # one host: two stages
    assert pipeline.mesh_shape(8, stages=4) == (4, 2)
    assert pipeline.batch_ways((3, 2)) == 6  # each process reads its own rows, as under data
    with pytest.raises(KitError, match=r"--pipeline-stages 3 does not divide the 8 devices.*use one of: 2, 4, 8"):
        pipeline.mesh_shape(8, stages=3)
    with pytest.raises(KitError, match=r"on 3 hosts would put one stage on parts of two hosts"):
        pipeline.mesh_shape(6, devices_per_process=2, stages=2)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--model", "mlp"], "--model mlp declares none: set repeated_blocks"),
        (["--num-layers", "3"], "--pipeline-stages 2 does not split --model gpt's 3 repeated blocks evenly; use one of: 3"),
        (["--micro-batches", "3"], "does not split into 3 micro-batches on each of the pipeline's 4 data-parallel slot(s)"),
        (["--pipeline-stages", "3"], "--pipeline-stages 3 does not divide the 8 devices"),
        (
            ["--pipeline-repeats", "3"],
            "--pipeline-repeats 3 x 2 stages does not split --model gpt's 4 repeated blocks into equal chunks; use one of: 2",
        ),
        (["--pipeline-repeats", "2", "--micro-batches", "1"], "needs at least a micro-batch a stage: --micro-batches 1"),
    ],
)
def test_what_cannot_be_pipelined_is_one_line_exit_2(tmp_path, argv, words):
    base = ["--model", "gpt", "--num-layers", "4", "--d-model", "32", "--num-heads", "4", "--seq-len", "16", "--vocab-size", "64"]
    if argv[:2] == ["--model", "mlp"]:
        base = []
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "alpa_job",
            "train",
            *base,
            *argv,
            "--strategy",
            "pipeline",
            "--devices",
            "8",
            "--batch-size",
            "32",
            "--steps",
            "1",
            "--address",
            "none",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and err and words in err[-1], p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_a_pipelined_run_resumes_from_its_checkpoint_to_the_same_losses(tmp_path):
    """Checkpoints hold the stacked blocks split over stages; --resume continues to the losses of a run
    that never stopped."""

    def train(out, steps, *extra):
        argv = [
            sys.executable,
            "-m",
            "alpa_job",
            "train",
            "--model",
            "gpt",
            "--num-layers",
            "2",
            "--d-model",
            "32",
            "--num-heads",
            "4",
            "--seq-len",
            "16",
            "--vocab-size",
            "64",
            "--strategy",
            "pipeline",
            "--devices",
            "8",
            "--batch-size",
            "16",
            "--micro-batches",
            "2",
            "--num-samples",
            "64",
            "--checkpoint-every",
            "2",
            "--steps",
            str(steps),
            "--address",
            "none",
            "--out",
            str(out),
            *extra,
        ]
        p = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=REPO)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads((out / "report.json").read_text())

    whole = train(tmp_path / "whole", 6)
    train(tmp_path / "parts", 4)
    resumed = train(tmp_path / "parts", 6, "--resume")
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == 2
    np.testing.assert_allclose(resumed["losses"], whole["losses"][4:], rtol=1e-5)


def test_a_bf16_run_sums_the_gradients_between_stages_in_bf16():
    """The shell's gradients (the tied embedding: stage 0's lookup, the last stage's head) cross between the
    stages in the compute dtype, half fp32's bytes over the network, as XLA sums data's on GPUs. The step is
    lowered, not compiled: XLA:CPU would widen the sum back to f32, where XLA:GPU keeps it."""
    import re

    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.models import get_model

    config = tiny_config("gpt", dtype="bfloat16", micro_batches=2, **GPT4)
    batch = next(epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0))[0]
    engine = JaxEngine(config, get_model(config), batch, "pipeline", (2, 4))
    text = engine._lower("train_step", engine._abstract_batch())[1].as_text()
    summed = re.findall(r"stablehlo\.all_reduce.*?\}\) : \(tensor<([^>]*)>", text, re.S)
    vocab, width = config.model_args["vocab_size"], config.model_args["d_model"]
    assert f"{vocab}x{width}xbf16" in summed and f"{vocab}x{width}xf32" not in summed, summed
