"""Numbers that mean something: non-finite settings refused, a diverged run stopped and reported as such,
report.json strict JSON, memory checked before work, --devices within what the host can emulate (and
batch advice that never fails), a warning when no checkpoint will be written, a current progress loss."""

from __future__ import annotations

import json
import math
import os
import re
import resource
import sys
import time

import jax
import pytest

from alpa_job import models, strict_json
from alpa_job.progress.events import set_sink
from alpa_job.engines import memory_fit
from alpa_job.errors import Diverged, KitError
from alpa_job.launch.runner import run_in_process
from alpa_job.settings import validate
from alpa_job.settings.config import JobConfig
from helpers_report import assert_valid_report
from helpers_train import tiny_config
from helpers_cli import REPO, run_cli


def strict_load(text: str):
    """json.loads that refuses NaN / Infinity, as every non-Python JSON reader does."""

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def error_lines(stderr: str):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


# ---------------------------------------------------------------------------- settings
@pytest.mark.parametrize(
    "args, yaml_text, flag",
    [
        (["--learning-rate", "nan"], None, "--learning-rate"),
        (["--learning-rate", "inf"], None, "--learning-rate"),
        (["--restart-wait=-inf"], None, "--restart-wait"),
        ([], "learning_rate: .inf\n", "--learning-rate"),
        ([], "memory_limit_gb: .nan\nstrategy: auto\n", "--memory-limit-gb"),
    ],
)
def test_non_finite_settings_are_refused(tmp_path, args, yaml_text, flag):
    if yaml_text is not None:
        (tmp_path / "c.yaml").write_text(yaml_text)
        args = args + ["--config", str(tmp_path / "c.yaml")]
    started = time.monotonic()
    proc = run_cli("train", "--address", "none", "--out", str(tmp_path / "out"), *args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc.stderr) == [proc.stderr.strip()], proc.stderr  # one line, nothing else
    assert f"{flag} must be a finite number" in proc.stderr
    assert time.monotonic() - started < 30 and not (tmp_path / "out").exists()


def test_finite_check_covers_a_models_own_float_setting():
    import dataclasses

    from alpa_job.setting import Setting

    rate = Setting("dropout", float, 0.1, "a model's own float")
    assert rate.problem(float("nan")) == "--dropout must be a finite number, got nan"
    assert rate.problem(0.5) is None and dataclasses.replace(rate, check="above zero").problem(float("inf"))


# ---------------------------------------------------------------------------- diverged
# tests/helpers_diverging.py: Adam moves a scalar by ~lr a step and the loss is NaN once it passes 3.0; at
# lr 1 with this warmup that is step 16 (the tests read the step from the error, not from here).
DIVERGING = [
    "--model",
    "helpers_diverging:build",
    "--num-samples",
    "1024",
    "--batch-size",
    "16",
    "--steps",
    "40",
    "--learning-rate",
    "1",
    "--compile-cache",
    "none",
]
TESTS_ON_PATH = {"PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}


def _diverged_step(error: str) -> int:
    found = re.search(r"the loss became (nan|inf|-inf) at step (\d+)", error)
    assert found, error
    return int(found.group(2))


def test_a_diverged_run_stops_reports_diverged_and_names_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = run_cli("train", "--address", "none", "--out", str(out), "--checkpoint-every", "2", *DIVERGING, timeout=300, env=TESTS_ON_PATH)
    assert proc.returncode == 1, proc.stderr
    (error,) = error_lines(proc.stderr)
    step = _diverged_step(error)
    assert step > 2, error  # some checkpoints come first
    # The report is strict JSON (the non-finite loss is null), valid against the schema, and says why.
    report = strict_load((out / "report.json").read_text())
    assert_valid_report(report)
    assert report["status"] == "diverged" and report["error"] == error[len("error: ") :]
    losses = report["losses"]
    assert losses[step - 1] is None and all(isinstance(x, float) and math.isfinite(x) for x in losses[: step - 1])
    window = max(1, min(10, 40 // 20))  # timing.window_size: losses are read back once a window
    assert len(losses) <= step + window and report["steps"] < step + window  # stopped within one window
    # No checkpoint holds a state past the non-finite loss; the newest one before it is the one named.
    saved = sorted(int(n) for n in os.listdir(out / "checkpoints") if n.isdigit())
    assert saved and max(saved) < step
    assert f"last good checkpoint: step {max(saved)} in {out / 'checkpoints'}" in error
    assert "diverged" in (out / "report.md").read_text() and "status-diverged" in (out / "report.html").read_text()


def test_a_diverged_run_without_checkpoints_says_so(tmp_path):
    from alpa_job.models import resolve

    sys.path.insert(0, os.path.join(REPO, "tests"))
    config = JobConfig(
        model="helpers_diverging:build",
        num_samples=1024,
        batch_size=16,
        steps=40,
        learning_rate=1.0,
        address="none",
        out=str(tmp_path / "run"),
        compile_cache="none",
    ).validated()
    with pytest.raises(Diverged) as caught:
        run_in_process(resolve(config))
    err = caught.value
    assert err.exit_code == 1 and err.checkpoint_step is None and "no checkpoint was saved before it" in str(err)
    assert len(err.losses) >= err.step and not math.isfinite(err.losses[err.step - 1])
    assert all(math.isfinite(x) for x in err.losses[: err.step - 1])


@pytest.mark.slow
def test_a_diverged_run_on_ray_reaches_the_driver_as_diverged(tmp_path):
    """The worker's Diverged crosses Ray (pickled) and the driver's report says diverged, exit 1."""
    out = tmp_path / "run"
    proc = run_cli("train", "--address", "local", "--out", str(out), *DIVERGING, timeout=600, env=TESTS_ON_PATH)
    assert proc.returncode == 1, proc.stderr
    (error,) = error_lines(proc.stderr)
    step = _diverged_step(error)
    report = strict_load((out / "report.json").read_text())
    assert report["status"] == "diverged" and f"at step {step}" in report["error"]
    assert report["losses"][step - 1] is None


def test_report_json_is_strict_and_compare_json_too(tmp_path):
    from alpa_job.inspect import compare
    from alpa_job.record.report_file import report_json
    from helpers_report import record_with_input

    record = record_with_input(processes=1)
    record.losses[3] = float("nan")
    record.losses[4] = float("inf")
    text = report_json(record)
    data = strict_load(text)
    assert data["losses"][3] is None and data["losses"][4] is None and data["losses"][2] == record.losses[2]
    assert_valid_report(data)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(text)
    rows = strict_load(compare.to_json(compare.rows([str(tmp_path / "a"), str(tmp_path / "b")])))
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert strict_json.dumps({"x": (float("-inf"), 1.5)}) == '{"x": [null, 1.5]}'


# ---------------------------------------------------------------------------- memory before work
def test_a_state_too_big_for_host_ram_fails_before_any_allocation(tmp_path):
    """A GPT of d_model 16384 needs ~300 GB of state per device: refused from the abstract state, in
    seconds, while the process stays small (nothing was allocated, nothing compiled)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.monotonic()
    proc = run_cli(
        "train",
        "--address",
        "none",
        "--out",
        str(tmp_path / "run"),
        "--model",
        "gpt",
        "--d-model",
        "16384",
        "--num-heads",
        "16",
        "--num-layers",
        "8",
        "--steps",
        "1",
        timeout=120,
    )
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    (error,) = error_lines(proc.stderr)
    assert re.search(r"the train state \(parameters \+ optimizer state\) needs [\d.]+ GB per device", error), error
    assert "RAM available" in error and "--strategy fsdp" in error and "--strategy tensor" in error, error
    assert took < 60, took
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert peak_kb == before or peak_kb < 2 * 2**20, peak_kb  # under 2 GB (the state alone is 300 GB)


class _Gpu:
    """A GPU as the check sees one (this machine has none): its kind and allocator limit."""

    platform = "gpu"
    device_kind = "NVIDIA H100 80GB HBM3"

    def __init__(self, bytes_limit: int):
        self.bytes_limit = bytes_limit

    def memory_stats(self):
        return {"bytes_limit": self.bytes_limit}


def test_memory_budget_on_a_gpu_keeps_the_presets_that_fit_an_h100():
    h100 = [_Gpu(int(0.75 * 79.1 * 2**30))]  # JAX's default share of an H100's memory
    # GPT 24L, one H100: XLA's estimate = the measured peak, 35.18 GB (bench/RESULTS.md): it trains.
    memory_fit.check_step_fits({"peak_estimate_bytes": int(35.18e9)}, "data", (1, 1), devices=h100)
    with pytest.raises(
        KitError,
        match=r"needs 70.00 GB per device .* JAX may take 63.70 GB of one NVIDIA H100 "
        r"80GB HBM3, of which 90% \(57.33 GB\) counts as usable; .*"
        r"XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 .* a smaller --batch-size",
    ):
        memory_fit.check_step_fits({"peak_estimate_bytes": int(70e9)}, "data", (1, 1), devices=h100)
    # gpt-4b on two H100s, fsdp with --remat mlp-weights: XLA's estimate was 58.72 GB; a policy that keeps less
    # is the first way out (--remat weights measured 56.39 GB there).
    stronger = models.stronger_remat(tiny_config("gpt", remat="mlp-weights"))
    assert stronger == ("weights", "dots", "full")
    with pytest.raises(
        KitError,
        match=r"needs 58.72 GB per device .*; use --remat weights / dots / full \(keeps "
        r"fewer activations\), --strategy tensor",
    ):
        memory_fit.check_step_fits({"peak_estimate_bytes": int(58.72e9)}, "fsdp", (2, 1), devices=h100, stronger_remat=stronger)
    assert models.stronger_remat(tiny_config("gpt", remat="full")) == () == models.stronger_remat(tiny_config("mlp"))


def test_memory_check_passes_tiny_models_and_counts_every_cpu_device():
    devices = jax.local_devices()
    assert len(devices) == 8
    config = tiny_config("mlp", steps=1)
    run_in_process(config)  # the suite's tiny models never trip it
    available, sharing, words = memory_fit.budget(devices)
    assert sharing == 8 and "RAM available" in words
    per_device = int(available / 8 * 0.95)  # fits one device, not eight sharing the host's RAM
    with pytest.raises(KitError, match=r"for 8 devices"):
        memory_fit.check_step_fits({"peak_estimate_bytes": per_device}, "fsdp", (8, 1), devices=devices)


# ---------------------------------------------------------------------------- --devices and batch advice
def test_devices_beyond_what_the_host_can_emulate_are_refused_before_ray(tmp_path):
    started = time.monotonic()
    proc = run_cli("train", "--devices", "10000", "--out", str(tmp_path / "run"), timeout=60)
    assert proc.returncode == 2, proc.stderr
    (error,) = error_lines(proc.stderr)
    cap = max(64, 16 * validate.host_cores())
    assert "--devices 10000 is more CPU devices than this host can emulate" in error
    assert f"use --devices {cap} or fewer" in error and time.monotonic() - started < 30


@pytest.mark.parametrize(
    "settings",
    [
        dict(devices=64, batch_size=250),  # 192 or 256
        dict(devices=64, batch_size=40, num_samples=50),  # no multiple of 64 fits 50 samples: fewer devices
        dict(devices=48, batch_size=40, num_samples=100, strategy="tensor", model_parallel=2),
        dict(devices=24, batch_size=100, num_samples=110),  # 96 fits, 120 would not
    ],
)
def test_batch_advice_never_suggests_a_setting_that_then_fails(settings):
    config = JobConfig(address="none", **settings).validated()
    with pytest.raises(KitError) as caught:
        validate.preflight(config, "jax", "none")
    text = str(caught.value)
    suggested = re.search(r"--(batch-size|devices) (\d+)", text.split("; use ", 1)[1])
    assert suggested, text
    name, value = suggested.group(1).replace("-", "_"), int(suggested.group(2))
    validate.preflight(config.replace(**{name: value}), "jax", "none")  # the advice, taken, passes


# ---------------------------------------------------------------------------- checkpoints that never come
def test_a_checkpoint_interval_beyond_the_run_warns_and_the_report_keeps_it(tmp_path):
    out = tmp_path / "run"
    proc = run_cli(
        "train",
        "--address",
        "none",
        "--out",
        str(out),
        "--checkpoint-every",
        "100",
        "--steps",
        "3",
        "--hidden-dim",
        "32",
        "--compile-cache",
        "none",
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    warning = (
        "warning: --checkpoint-every 100 never saves: this run ends at step 3; pass --checkpoint-every 3 "
        "or less (or more --steps) to keep a checkpoint"
    )
    assert warning in proc.stderr
    report = strict_load((out / "report.json").read_text())
    assert report["notes"] == [warning] and not os.listdir(out / "checkpoints")
    assert warning in (out / "report.md").read_text()


def test_a_reachable_checkpoint_interval_does_not_warn(tmp_path):
    result = run_in_process(tiny_config("mlp", steps=4, checkpoint_every=2, out=str(tmp_path / "run")))
    assert result.notes == []


# ---------------------------------------------------------------------------- the progress line's loss
def test_the_progress_loss_follows_the_run_on_a_short_fast_run():
    """A run far shorter than the display's 1 s loss interval: each step's line shows the loss the loop
    read back (the previous step's), never the first step's all the way to the end."""
    events = []
    set_sink(events.append)
    try:
        result = run_in_process(tiny_config("mlp", steps=12, epochs=100))
    finally:
        set_sink(None)
    shown = [e["loss"] for e in events if e["kind"] == "step"]
    losses = result.losses
    assert len(shown) == 12 and shown[0] == pytest.approx(losses[0], abs=1e-5)
    for step in range(2, 12):  # step k shows step k-1's loss: read back at k without stalling the device
        assert shown[step - 1] == pytest.approx(losses[step - 2], abs=1e-5), (step, shown, losses)
    assert shown[-1] == pytest.approx(losses[-1], abs=1e-5)
    assert len(set(round(x, 5) for x in shown)) > 6
