"""The command line as a user runs it: bad input, the embedded default end to end, inspect."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers_cli import REPO, run_cli
from helpers_report import assert_valid_report
from helpers_train import signal_at_step


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "resnet"], r"--model 'resnet' is not known; use one of: mlp, wide_resnet, gpt"),
        (
            ["--batch-size", "60", "--devices", "8", "--address", "none"],
            r"batch size 60 is not divisible by the data-parallel size 8; use a multiple of 8",
        ),
        (["--dataset", "cifar10", "--model", "wide_resnet"], r"--dataset cifar10 needs --data-dir"),
        (["--dataset", "cifar10", "--model", "wide_resnet", "--data-dir", "/nonexistent"], r"is not a folder"),
        (["--steps", "0"], r"--steps must be a positive integer"),
        (["--depth", "12"], r"not a WideResNet depth; use 6n\+4"),
        (["--resume"], r"--resume needs --checkpoint-every"),
        (["--config", "/nonexistent.yaml"], r"no such file"),
        (["--address", "127.0.0.1:1"], r"cannot reach Ray GCS at 127.0.0.1:1"),
        (["--address", "http://127.0.0.1:8265"], r"is the dashboard/jobs URL"),
        (["--engine", "alpa"], r"alpa package is not installed"),
        (["--address", "none", "--strategy", "tensor", "--model-parallel", "3"], r"--model-parallel 3 does not divide"),
    ],
)
def test_bad_input_gives_one_line_error_and_nonzero_exit(args, message):
    proc = run_cli(*args, "--out", "/tmp/alpa-job-bad", timeout=120)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    assert re.search(message, lines[0]), lines[0]
    assert "Traceback" not in proc.stderr


def test_config_file_is_read_and_flags_override_it(tmp_path):
    cfg = tmp_path / "job.yaml"
    cfg.write_text("model: mlp\nhidden-dim: 16\nbatch_size: 8\nnum_samples: 40\nsteps: 2\n")
    proc = run_cli("--config", str(cfg), "--steps", "3", "--address", "none", "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["config"]["model_args"]["hidden_dim"] == 16 and report["config"]["batch_size"] == 8
    assert report["steps"] == 3  # the flag beat the file
    bad = tmp_path / "bad.yaml"
    bad.write_text("modle: mlp\n")
    proc = run_cli("--config", str(bad))
    assert proc.returncode == 2 and "unknown setting 'modle'" in proc.stderr


def _write_cifar_batches(folder, n_per_file=20):
    """The real CIFAR-10 python format (pickled dicts of uint8 rows + labels), small."""
    rng = np.random.default_rng(0)
    folder.mkdir()
    for i in range(1, 3):
        entry = {
            b"data": rng.integers(0, 256, size=(n_per_file, 3072), dtype=np.uint8),
            b"labels": list(rng.integers(0, 10, size=n_per_file)),
            b"batch_label": b"training batch",
        }
        with open(folder / f"data_batch_{i}", "wb") as f:
            pickle.dump(entry, f)


def test_cifar10_from_local_batches(tmp_path):
    _write_cifar_batches(tmp_path / "cifar")
    proc = run_cli(
        "--model",
        "wide_resnet",
        "--width",
        "1",
        "--dataset",
        "cifar10",
        "--data-dir",
        str(tmp_path / "cifar"),
        "--batch-size",
        "16",
        "--steps",
        "2",
        "--address",
        "none",
        "--out",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["steps"] == 2 and report["samples_seen"] == 32
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "data_batch_1").write_bytes(b"not a pickle")
    proc = run_cli("--model", "wide_resnet", "--dataset", "cifar10", "--data-dir", str(tmp_path / "junk"), "--address", "none")
    assert proc.returncode == 2 and "is not a CIFAR-10 python batch" in proc.stderr


REQUIRED_KEYS = {
    "config",
    "engine",
    "strategy",
    "mesh",
    "compiles",
    "steps",
    "samples_seen",
    "samples_dropped",
    "step_time_s",
    "throughput",
    "params",
    "summary",
    "collectives",
    "versions",
}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`python -m alpa_job` with no job arguments: local Ray, emulated CPU devices, the MLP."""
    out = tmp_path_factory.mktemp("default-run")
    proc = run_cli("--out", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_no_arguments_trains_the_mlp_on_local_ray(default_run):
    out, proc = default_run
    assert "joined local Ray" in proc.stderr
    # Process 0 trains in a Ray actor; its progress reaches the driver through the channel actor.
    assert re.search(r"^\[train\] step 21/21  loss [\d.]+  [\d,]+ samples/s  ETA 0 s$", proc.stderr, re.M), proc.stderr
    # Ray's own noise stays off by default: no token notice, no colour codes, no dedup lines, no actor prefixes.
    for noise in ("Token authentication", "\x1b[", "repeated", "(JaxProcess pid="):
        assert noise not in proc.stderr, noise
    report = json.loads((out / "report.json").read_text())
    assert_valid_report(report)  # the Ray path (run_on_nodes) writes the schema's report too
    assert REQUIRED_KEYS <= set(report)
    assert report["engine"] == "jax" and report["config"]["model"] == "mlp"
    assert report["compiles"] == 1 and report["backend_compiles_during_loop"] == 0
    # 2000 samples / 256 = 7 full batches + 208 dropped, 3 epochs.
    assert report["steps"] == 21 and report["samples_seen"] == 21 * 256 and report["samples_dropped"] == 3 * 208
    assert report["summary"]["loss_last"] < report["summary"]["loss_first"]
    assert report["devices"]["count"] == 8 and report["summary"]["processes"] == 1
    assert report["collectives"]["all-reduce"]["count"] >= 1  # data parallel: gradients are all-reduced
    assert report["memory"]["argument_size_in_bytes"] > 0
    for row in report["params"]:
        assert {"path", "shape", "dtype", "bytes", "bytes_per_device", "spec", "mesh_ids", "strategy"} <= set(row)
    assert (out / "report.md").exists() and (out / "plot_bytes_by_strategy.png").exists()


def test_default_run_writes_tensorboard_events_on_the_driver(default_run):
    """Through local Ray process 0 trains in an actor; its losses reach the driver, the one writer."""
    from helpers_report import close_to, read_events

    out, _ = default_run
    report = json.loads((out / "report.json").read_text())
    assert report["tensorboard"] == str(out / "tensorboard")
    scalars, texts = read_events(out / "tensorboard")
    assert [s for s, _ in scalars["train/loss"]] == list(range(1, 22))
    assert all(close_to(v, r) for (_, v), r in zip(scalars["train/loss"], report["losses"]))
    assert {"train/learning_rate", "perf/step_time_s", "perf/samples_per_s", "setup/compile_s"} <= set(scalars)
    assert "| address | None |" in texts["settings"] and texts["status"].startswith("**ok**")


def test_inspect_formats(default_run):
    out, _ = default_run
    as_json = run_cli("inspect", str(out), "--format", "json")
    assert as_json.returncode == 0
    assert json.loads(as_json.stdout) == json.loads((out / "report.json").read_text())
    table = run_cli("inspect", str(out))
    assert table.returncode == 0 and "params/Dense_0/kernel" in table.stdout and "DP" in table.stdout
    md = run_cli("inspect", str(out), "--format", "md")
    assert md.returncode == 0 and "| params/Dense_0/kernel |" in md.stdout
    html_out = out / "again.html"
    html = run_cli("inspect", str(out), "--format", "html", "--output", str(html_out))
    assert html.returncode == 0 and "<table" in html_out.read_text()
    missing = run_cli("inspect", str(out / "nope"))
    assert missing.returncode == 2 and "no report.json" in missing.stderr


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium package (apt-get install chromium)")
def test_html_report_renders_in_headless_chromium(default_run, tmp_path):
    out, _ = default_run
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",
        "--dump-dom",
        f"file://{out / 'report.html'}",
    ]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    assert '<table class="params">' in dom and "params/Dense_0/kernel" in dom
    widths = [int(w) for w in re.findall(r'data-rendered="(\d+)"', dom)]
    assert widths and all(w > 100 for w in widths), "the plots must decode and lay out as images"


# ----------------------------------------------------------------------------- issue 13: help, progress, runs, compare
def test_help_teaches_groups_defaults_examples_and_exit_codes():
    proc = run_cli("train", "--help")
    assert proc.returncode == 0
    text = proc.stdout
    for group in ("model and data:", "parallelism:", "cluster:", "output:"):
        assert group in text
    assert "(default: 256)" in text and "exit codes:" in text
    flat = " ".join(text.split())
    assert "mlp, wide_resnet, gpt, an installed model, or your own builder as PACKAGE.MODULE:FUNCTION" in flat
    assert "--model-arg KEY=VALUE" in flat
    assert text.count("python -m alpa_job train") >= 4  # the epilog's example commands
    from alpa_job.cli import build_parser

    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    for name in ("train", "inspect", "doctor"):
        silent = [a.option_strings for a in commands[name]._actions if a.option_strings and not a.help]
        assert silent == [], f"every {name} flag has a description"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two small in-process runs (data and tensor) into runs/ under a fresh folder, as a user makes them."""
    home = tmp_path_factory.mktemp("user")
    procs = []
    for strategy in (["--strategy", "data"], ["--strategy", "tensor", "--model-parallel", "2"]):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "alpa_job",
                "--address",
                "none",
                "--model",
                "gpt",
                "--num-layers",
                "1",
                "--d-model",
                "32",
                "--seq-len",
                "16",
                "--vocab-size",
                "64",
                "--batch-size",
                "16",
                "--num-samples",
                "96",
                "--epochs",
                "2",
                *strategy,
                "--progress-every",
                "2",
            ],
            cwd=home,
            capture_output=True,
            text=True,
            timeout=600,
            env=dict(os.environ, PYTHONPATH=REPO, RAY_USAGE_STATS_ENABLED="0"),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        procs.append(proc)
    runs = sorted(p for p in (home / "runs").iterdir() if not p.is_symlink())
    return home, runs, procs


def test_runs_are_kept_and_latest_points_at_the_newest(two_runs):
    home, runs, _ = two_runs
    assert len(runs) == 2 and all(re.match(r"\d{8}-\d{6}-gpt-(data|tensor)", r.name) for r in runs)
    latest = home / "runs" / "latest"
    assert latest.is_symlink() and latest.resolve() == runs[-1].resolve()
    for run in runs:
        assert (run / "report.json").exists() and (run / "run.json").exists()
        assert json.loads((run / "report.json").read_text())["status"] == "ok"


def test_progress_lines_without_a_tty(two_runs):
    _, runs, procs = two_runs
    lines = [l for l in procs[0].stderr.splitlines() if l.startswith("[train] step")]
    # 12 steps, a line every 2: loss, rate and ETA on each (the first has no loss read back yet)
    assert len(lines) == 6, procs[0].stderr
    assert re.match(r"\[train\] step 12/12  loss \d.*  [\d,]+ samples/s  [\d,]+ tokens/s a device  ETA 0 s", lines[-1]), lines[-1]
    assert "compiling train step (gpt, data" in procs[0].stderr
    assert "\x1b[" not in procs[0].stderr  # no colour codes in a log
    log = (runs[0] / "train.log").read_text()
    assert "[train] step 12/12" in log and "compiling train step" in log


def _chromium_run(args, tmp_path, timeout=120):
    cmd = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=5000",
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _screenshot(page, png, tmp_path):
    _chromium_run([f"--screenshot={png}", "--window-size=1400,1800", f"file://{page}"], tmp_path)
    import matplotlib.image

    pixels = matplotlib.image.imread(str(png))
    assert pixels.shape[0] >= 1000 and pixels.std() > 0.05, "the screenshot shows a rendered page, not a blank one"
    return pixels


@pytest.mark.skipif(_chromium() is None, reason="needs Debian's chromium package (apt-get install chromium)")
def test_report_mesh_picture_and_compare_page_in_headless_chromium(two_runs, tmp_path):
    home, runs, _ = two_runs
    tensor = next(r for r in runs if r.name.endswith("tensor"))
    dom = _chromium_run(["--dump-dom", f"file://{tensor / 'report.html'}"], tmp_path).stdout
    assert "<h1>gpt: tensor (4×2)</h1>" in dom
    assert dom.count('<g class="device">') == 8  # the 4x2 device grid
    # The default parameter is split over the model axis: devices of one row hold different slices.
    slices = re.findall(r'<text class="slice" data-device="(\d)"[^>]*>([^<]*)</text>', dom)
    assert len(slices) == 8 and slices[0][1] != slices[1][1] and slices[0][1] == slices[2][1]
    assert "<h2>Memory per device</h2>" in dom and "peak estimate" in dom
    assert "<h2>Config</h2>" in dom and "<h2>Versions</h2>" in dom and re.search(r"\d\.\d (KiB|MiB)", dom)
    assert re.search(r"<details data-group=\"g\d+\"[^>]*><summary>2 arrays", dom)  # Adam mu, nu folded under it
    _screenshot(tensor / "report.html", tmp_path / "report.png", tmp_path)

    page = tmp_path / "compare.html"
    proc = run_cli("inspect", "--compare", *map(str, runs), "--format", "html", "--output", str(page))
    assert proc.returncode == 0, proc.stderr
    assert "runs compared" in proc.stdout and runs[0].name in proc.stdout
    dom = _chromium_run(["--dump-dom", f"file://{page}"], tmp_path).stdout
    table = re.search(r'<table class="compare">.*?</table>', dom, re.S).group(0)
    assert table.count("<tr>") == 3 and "data (8×1)" in table and "tensor (4×2)" in table
    assert "step ms" in table and "collectives" in table and "compile s" in table and "labels (params)" in table
    assert re.search(r"<td>DP \d+, MP \d+</td>", table)  # tensor: some parameters split over the model axis
    widths = [int(w) for w in re.findall(r'data-rendered="(\d+)"', dom)]
    assert widths and widths[0] > 500, "the comparison plot decodes and lays out"
    _screenshot(page, tmp_path / "compare.png", tmp_path)


def test_compare_needs_two_runs_and_prints_markdown(two_runs):
    _, runs, _ = two_runs
    one = run_cli("inspect", "--compare", str(runs[0]))
    assert one.returncode == 2 and "needs at least two run directories" in one.stderr
    md = run_cli("inspect", "--compare", *map(str, runs), "--format", "md")
    assert md.returncode == 0 and "Fastest step" in md.stdout
    assert len(re.findall(r"^\| \d{8}-\d{6}-gpt-(data|tensor) \|", md.stdout, re.M)) == 2, md.stdout


def test_alpa_report_draws_stage_mesh_devices(tmp_path):
    """An Alpa pipeshard dump (real PlacementSpecs, tests/alpa_fixtures): the mesh picture is stage -> mesh
    -> devices, one box per pipeline stage, each holding its mesh's devices."""
    from alpa_job.inspect import render
    from alpa_job.inspect.load import load_any

    record = load_any(os.path.join(REPO, "tests", "alpa_fixtures", "pipeshard_zero"))
    page = render.to_html(record, rendered_plots=[])
    stages = re.findall(r'<g class="stage">.*?</g>\s*(?=<g class="stage">|</svg>)', page, re.S)
    assert len(stages) == len(record.stages) >= 2
    for st, box in zip(record.stages, stages):
        assert f"stage {st.stage} → mesh {st.mesh}" in box
        assert box.count("<rect") == 1 + int(np.prod(st.submesh_shape))  # the stage box + one per device
    assert "gpu 0" in stages[0] and f"gpu {sum(int(np.prod(s.submesh_shape)) for s in record.stages) - 1}" in stages[-1]


def test_interrupted_run_still_writes_its_report(tmp_path):
    """Ctrl-C part-way: exit 130, one line, no traceback, and the run directory's report says
    `interrupted` with the steps done (issue 13: nothing lost)."""
    import signal

    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "alpa_job",
            "--address",
            "none",
            "--hidden-dim",
            "16",
            "--batch-size",
            "16",
            "--num-samples",
            "64",
            "--epochs",
            "100000",
            "--progress-every",
            "1",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=REPO, RAY_USAGE_STATS_ENABLED="0"),
        # A suite started with `&` from a script runs with SIGINT ignored, which a child
        # inherits (and then rightly keeps): give the child Ctrl-C as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    stderr = signal_at_step(proc, 5, signal.SIGINT)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert [l for l in stderr.splitlines() if l.startswith("error:")] == [
        "error: interrupted (the run directory keeps a report of the steps done)"
    ]
    report = json.loads((out / "report.json").read_text())
    assert_valid_report(report)
    assert report["status"] == "interrupted" and report["steps"] >= 5 and report["error"]
    assert "interrupted after" in stderr and (out / "report.html").exists() and (out / "train.log").exists()


def test_cluster_size_is_checked_from_the_alive_nodes_before_any_actor():
    """After a join the run's device count comes from Ray's node rows (2.1.0's ray.nodes() shape here):
    GPUs per node, else --devices; a batch the data axis does not divide is the same one-line error."""
    from alpa_job.cluster.ray_api import parse_nodes
    from alpa_job.errors import KitError
    from alpa_job.settings.validate import check_cluster_size
    from helpers_train import tiny_config

    rows = [{"Alive": True, "NodeManagerAddress": f"10.0.0.{i}", "NodeID": str(i), "Resources": {"CPU": 8.0, "GPU": 4.0}} for i in (1, 2)]
    rows.append({"Alive": False, "NodeManagerAddress": "10.0.0.3", "NodeID": "3", "Resources": {"CPU": 8.0}})
    nodes = [n for n in parse_nodes(rows) if n.alive]
    check_cluster_size(tiny_config(batch_size=16), nodes)  # 2 x 4 GPUs: 16 splits over 8
    with pytest.raises(
        KitError,
        match=r"batch size 12 is not divisible by the data-parallel size 8; .*"
        r"the cluster gives 2 node\(s\) x 4 devices",
    ):
        check_cluster_size(tiny_config(batch_size=12, address="10.0.0.1:6379"), nodes)
    with pytest.raises(KitError, match=r"--processes 3 but only 2 alive Ray nodes"):
        check_cluster_size(tiny_config(processes=3, address="10.0.0.1:6379"), nodes)


def test_quiet_prints_only_the_result(tmp_path):
    proc = run_cli(
        "-q",
        "--address",
        "none",
        "--hidden-dim",
        "16",
        "--batch-size",
        "16",
        "--num-samples",
        "32",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "" and proc.stdout.startswith("trained mlp with jax/data")
    assert "[train] step 2/2" in (tmp_path / "run" / "train.log").read_text()  # the log still has it all


def test_plan_title_and_units():
    from alpa_job.record.run_record import MeshShape, RunRecord
    from alpa_job.inspect.units import human_bytes, plan_title

    auto = RunRecord(engine="jax", strategy="tensor", requested_strategy="auto", mesh=MeshShape(shape=[2, 4], axes=["data", "model"]))
    assert plan_title(auto) == "auto → tensor (2×4)"
    assert plan_title(RunRecord(engine="jax", strategy="fsdp", requested_strategy="fsdp", mesh=MeshShape(shape=[8, 1]))) == "fsdp (8×1)"
    assert [human_bytes(n) for n in (512, 1536, 3 * 2**20, 80 * 2**30)] == ["512 B", "1.5 KiB", "3.0 MiB", "80.0 GiB"]


def test_overwrite_replaces_an_earlier_runs_checkpoints(tmp_path):
    prev = tmp_path / "prev"
    (prev / "checkpoints" / "5").mkdir(parents=True)
    (prev / "checkpoints" / "5" / "state").write_text("orbax data")
    (prev / "report.json").write_text("{}")
    args = ("--address", "none", "--hidden-dim", "16", "--batch-size", "16", "--num-samples", "32", "--steps", "1", "--out", str(prev))
    refused = run_cli(*args)
    assert refused.returncode == 2 and "holds another run's checkpoints" in refused.stderr
    assert (prev / "checkpoints" / "5" / "state").exists()
    proc = run_cli(*args, "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert not (prev / "checkpoints").exists()
    report = json.loads((prev / "report.json").read_text())
    assert report["status"] == "ok" and report["steps"] == 1 and report["config"]["overwrite"] is True


def test_an_old_real_runs_latest_folder_is_kept_aside(tmp_path):
    """Older kits wrote runs/latest as a folder; the first new run keeps it (renamed by its time) and
    makes runs/latest a symlink."""
    from alpa_job.train.rundir import point_latest

    old = tmp_path / "latest"
    old.mkdir()
    (old / "report.json").write_text("{}")
    new = tmp_path / "20261123-120000-mlp-data"
    new.mkdir()
    link = point_latest(str(tmp_path), str(new))
    assert os.path.islink(link) and os.readlink(link) == new.name
    kept = [p for p in tmp_path.iterdir() if p.name.endswith("-previous-latest")]
    assert len(kept) == 1 and (kept[0] / "report.json").read_text() == "{}"
    point_latest(str(tmp_path), str(new))  # again: replaced atomically, nothing else moves
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([new.name, kept[0].name, "latest"])
