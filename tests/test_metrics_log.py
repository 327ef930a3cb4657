"""The run's metrics log: TensorBoard event files read back with TensorBoard's own reader, --no-tensorboard,
an eval run's eval curve, a diverged run's curve, the learning rate against optax, --track.

Runs are real (run_job in this process, tiny models on the 8 emulated CPU devices, `--address none`);
the local-Ray path is checked on test_cli's default run."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers_train import tiny_config
from helpers_report import close_to, read_events

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = dict(num_layers=1, d_model=32, num_heads=4, seq_len=16, vocab_size=64)


def run(**overrides):
    from alpa_job.launch.runner import run_job

    report, _ = run_job(tiny_config(**overrides))
    return report


def test_event_files_hold_the_reports_losses_and_the_run(tmp_path):
    """60 steps (timing windows of 3): every step's loss as the report has it, its learning rate, a point
    per window for step time and samples/s, the setup phases, the settings and the status as text."""
    from alpa_job.engines.optimizer import learning_rate_at, schedule_steps

    out = tmp_path / "run"
    report = run(model="mlp", num_samples=320, batch_size=16, epochs=3, out=str(out))
    assert report.steps == 60 and report.tensorboard == str(out / "tensorboard")
    scalars, texts = read_events(out / "tensorboard")
    loss = scalars["train/loss"]
    assert [s for s, _ in loss] == list(range(1, 61))
    assert all(close_to(v, r) for (_, v), r in zip(loss, report.losses)), (loss[:3], report.losses[:3])
    config = tiny_config(model="mlp", num_samples=320, batch_size=16, epochs=3)
    horizon = schedule_steps(config, 20)
    assert [s for s, _ in scalars["train/learning_rate"]] == list(range(1, 61))
    assert all(close_to(v, learning_rate_at(config.learning_rate, horizon, s - 1)) for s, v in scalars["train/learning_rate"])
    # One point per timing window after the first step (3 steps each: about 20 a run), as the report times them.
    windows = report.timing["steady_step"]["windows"]
    assert len(scalars["perf/step_time_s"]) == len(scalars["perf/samples_per_s"]) == windows >= 15
    assert all(v > 0 for _, v in scalars["perf/samples_per_s"])
    assert "perf/tokens_per_s" not in scalars  # the MLP has no sequence length
    assert {"setup/compile_s", "setup/startup_s", "setup/first_step_s", "run/steady_step_s"} <= set(scalars)
    assert "| model | mlp |" in texts["settings"] and "| batch_size | 16 |" in texts["settings"]
    assert texts["status"].startswith("**ok** after 60 step(s)")
    saved = json.loads((out / "report.json").read_text())
    assert saved["tensorboard"] == str(out / "tensorboard")


def test_no_tensorboard_writes_no_folder_and_overwrite_drops_the_old_one(tmp_path):
    out = tmp_path / "run"
    run(model="mlp", steps=2, out=str(out))
    assert os.listdir(out / "tensorboard")
    report = run(model="mlp", steps=2, out=str(out), overwrite=True, tensorboard=False)
    assert not (out / "tensorboard").exists() and report.tensorboard is None
    assert json.loads((out / "report.json").read_text())["tensorboard"] is None


def test_an_eval_run_logs_eval_loss_perplexity_and_tokens_per_second(tmp_path):
    train, held = tmp_path / "train.bin", tmp_path / "eval.bin"
    (np.arange(12000) * 5 % 64).astype(np.uint16).tofile(train)
    (np.arange(2000) * 5 % 64).astype(np.uint16).tofile(held)
    out = tmp_path / "run"
    report = run(
        model="gpt",
        dataset="tokens",
        data_path=str(train),
        eval_data_path=str(held),
        eval_every=5,
        eval_batches=1,
        steps=10,
        batch_size=16,
        out=str(out),
        **GPT,
    )
    scalars, _ = read_events(out / "tensorboard")
    assert [(p.step) for p in report.evals] == [5, 10]
    assert [s for s, _ in scalars["eval/loss"]] == [5, 10]
    assert all(close_to(v, p.loss) for (_, v), p in zip(scalars["eval/loss"], report.evals))
    assert all(close_to(v, p.perplexity) for (_, v), p in zip(scalars["eval/perplexity"], report.evals))
    # Tokens a second: samples a second times the model's seq_len.
    for (_, samples), (_, tokens) in zip(scalars["perf/samples_per_s"], scalars["perf/tokens_per_s"]):
        assert tokens == pytest.approx(samples * GPT["seq_len"], rel=1e-5)
    # TFLOP/s on MaxText's count (the GPT's causal attention at half) and on the full count, each window.
    assert len(scalars["perf/tflops_per_device"]) == len(scalars["perf/tflops_per_device_full"]) > 0
    assert all(
        0 < mfu_count < full for (_, mfu_count), (_, full) in zip(scalars["perf/tflops_per_device"], scalars["perf/tflops_per_device_full"])
    )


def test_a_diverged_run_keeps_its_curve_to_the_non_finite_loss(tmp_path):
    from alpa_job.errors import Diverged
    from alpa_job.launch.runner import run_job
    from alpa_job.models import resolve
    from alpa_job.settings.config import JobConfig

    out = tmp_path / "run"
    config = JobConfig(
        model="helpers_diverging:build",
        num_samples=1024,
        batch_size=16,
        steps=40,
        learning_rate=1.0,
        address="none",
        out=str(out),
        compile_cache="none",
    ).validated()
    with pytest.raises(Diverged) as caught:
        run_job(resolve(config))
    scalars, texts = read_events(out / "tensorboard")
    steps = [s for s, _ in scalars["train/loss"]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= caught.value.step
    assert not math.isfinite(dict(scalars["train/loss"])[caught.value.step])
    assert texts["status"].startswith("**diverged**")


def test_learning_rate_at_is_the_optimizers_schedule():
    from alpa_job.engines.optimizer import learning_rate_at, learning_rate_schedule

    for total in (None, 3, 10, 37, 5000):
        schedule = learning_rate_schedule(1e-3, total)
        for count in list(range(0, 60)) + [999, 1000, 1001, 2500, 4999, 5000, 5100]:
            # optax computes in float32: the first warmup rates carry its rounding (~1e-10 absolute here)
            assert abs(float(schedule(count)) - learning_rate_at(1e-3, total, count)) <= 1e-9, (total, count)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_track_without_its_package_is_one_line_before_ray(tmp_path):
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=REPO)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "alpa_job", "train", "--address", "local", "--track", "wandb", "--out", str(tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --track wandb: the wandb package is not installed here; pip install wandb (or drop --track)"
    ]
    assert not (tmp_path / "run").exists()  # refused before the run directory, before Ray


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None, reason="mlflow is not installed (it is optional)")
def test_track_mlflow_logs_the_same_losses_and_settings_offline(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the kit sets for its own store, undone after
    out = tmp_path / "run"
    report = run(model="mlp", steps=12, out=str(out), track="mlflow")
    client = MlflowClient(tracking_uri="file:" + str(out / "mlruns"))
    (found,) = client.search_runs([client.get_experiment_by_name("alpa_job").experiment_id])
    assert found.info.run_name == "run" and found.info.status == "FINISHED"
    assert found.data.params["model"] == "mlp" and found.data.params["steps"] == "12"
    history = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, "train/loss"))
    assert [s for s, _ in history] == list(range(1, 13))
    assert all(close_to(v, r) for (_, v), r in zip(history, report.losses))
    assert {"train/learning_rate", "perf/step_time_s", "perf/samples_per_s"} <= set(found.data.metrics)


def test_without_tensorboardx_the_run_says_so_and_trains(tmp_path):
    """The Alpa image may lack the writer: one line, the run goes on, the report names no folder."""
    out = tmp_path / "run"
    script = (
        "import sys, runpy; sys.modules['tensorboardX'] = None; "  # None in sys.modules: the import fails
        "sys.argv = ['alpa_job'] + sys.argv[1:]; runpy.run_module('alpa_job', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, "train", "--address", "none", "--steps", "2", "--hidden-dim", "32", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if "TensorBoard" in x]
    assert lines == [
        "[alpa_job] no TensorBoard event files: tensorboardX does not import (import of tensorboardX "
        "halted; None in sys.modules); pip install tensorboardX, or pass --no-tensorboard to silence "
        "this"
    ], proc.stderr
    assert not (out / "tensorboard").exists()
    assert json.loads((out / "report.json").read_text())["tensorboard"] is None
