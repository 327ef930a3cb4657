"""`python -m alpa_job plan calibrate` and `plan --gpu-profile`: the measurement on CPU (2 emulated devices, so
the collectives run too), the profile's schema, the planner's use of it, and bad profiles in one line."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest

from alpa_job import cli
from alpa_job.cpu_devices import with_device_count
from alpa_job.errors import KitError
from alpa_job.planner import estimate, gpu_profile, gpus

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
    """A profile measured for real on this machine's CPU (2 emulated devices), with the command's output."""
    path = tmp_path_factory.mktemp("calibrate") / "cpu.json"
    env = {
        **os.environ,
        "XLA_FLAGS": with_device_count(2),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": REPO,
    }
    proc = subprocess.run(
        [sys.executable, "-m", "alpa_job", "plan", "calibrate", "--out", str(path), "--shape", "64x64x64", "--budget-s", "60"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path, proc


def test_calibrate_on_cpu_writes_a_profile_of_sane_numbers(cpu_profile):
    import jax

    path, proc = cpu_profile
    profile = gpu_profile.load(str(path))  # the schema's checks
    assert profile["schema"] == gpu_profile.SCHEMA and profile["version"] == gpu_profile.VERSION
    assert (profile["platform"], profile["device_kind"], profile["devices"]) == ("cpu", "cpu", 2)
    assert "CPU's numbers" in profile["note"] and profile["memory_bytes"] is None
    assert profile["command"].startswith("python -m alpa_job plan calibrate --out ")
    assert profile["versions"]["jax"] == jax.__version__ and profile["created"].endswith("+00:00")
    assert set(profile["peak_flops"]) == {"bf16", "fp32"}  # a CPU has no TF32 or fp8
    assert [(r["precision"], r["m"], r["n"], r["k"]) for r in profile["matmul"]] == [("bf16", 64, 64, 64), ("fp32", 64, 64, 64)]
    for row in profile["matmul"]:
        assert 1e7 < row["flops_s"] < 1e14 and row["flops_s"] <= profile["peak_flops"][row["precision"]]
        assert row["seconds"] == pytest.approx(2 * 64**3 / row["flops_s"])
    assert 1e7 < profile["hbm"]["bytes_s"] < 1e13
    assert 0 <= profile["launch"]["kernel_seconds"] < 1e-3 and 0 < profile["launch"]["dispatch_seconds"] < 0.1
    assert {r["op"] for r in profile["collectives"]} == {"all-reduce", "all-gather"}
    for op in ("all-reduce", "all-gather"):
        bus = profile["collective_busbw"][op]
        assert bus["devices"] == 2 and bus["bytes"] == 2**20 and 1e6 < bus["busbw_bytes_s"] < 1e13
    assert profile["skipped"] == []
    (loop,) = profile["loop"]  # the kit's own loop over a near-empty model, on the 2 devices measured
    assert loop["devices"] == 2 and loop["steps"] == 60 and 0 < loop["step_seconds"] <= loop["p90_seconds"] < 1.0
    # progress: a line per measurement with its number; the table on stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("[calibrate] ")]
    assert "its numbers are the CPU's" in lines[0] and len(lines) == 1 + 7 and "7/7 matmul fp32 64x64x64" in lines[-1]
    assert any("the training loop's floor on 2 device(s):" in line and " ms a step" in line for line in lines)
    assert "| bf16 | 64 x 64 x 64 |" in proc.stdout and "all-reduce 1 MiB, 2 devices" in proc.stdout
    # the planner refuses a CPU's numbers, in one line that says where to measure
    with pytest.raises(KitError, match="not a GPU: run python -m alpa_job plan calibrate on a machine with the GPU"):
        gpus.resolve(None, profile_path=str(path))


def _gpu_profile(cpu_profile, tmp_path, **changes):
    """The CPU-measured profile, relabelled as an H200's with the given numbers (a GPU's layout, CPU timings)."""
    data = copy.deepcopy(json.loads(cpu_profile[0].read_text()))
    data.update(platform="gpu", device_kind="NVIDIA H200", memory_bytes=141 * 2**30)
    data.pop("note")
    for key, value in changes.items():
        data[key] = value
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_the_planner_takes_the_profiles_flop_rate_and_link_bandwidth(cpu_profile, tmp_path):
    catalogue = gpus.CATALOGUE["h200"]
    half = catalogue.peak_flops / 2
    bus = {"all-reduce": {"bytes": 2**28, "busbw_bytes_s": 225e9, "devices": 2}}
    path = _gpu_profile(cpu_profile, tmp_path, peak_flops={"bf16": half, "tf32": half / 2}, collective_busbw=bus)
    gpu = gpus.resolve(None, profile_path=path)  # --gpu follows the profile's device kind
    assert (gpu.name, gpu.memory_bytes, gpu.peak_flops, gpu.nvlink_bytes_s) == (
        "h200",
        catalogue.memory_bytes,
        half,
        225e9,
    )  # memory from the catalogue's H200
    assert gpu.profile == path and path in gpu.source and "all-reduce bus bandwidth over 2 GPUs" in gpu.source
    assert gpu.hbm_bytes_s > 0 and gpu.launch_s is not None
    data = estimate.load()
    constants = estimate.fit(data)
    entry = next(e for e in data["entries"] if e["strategy"] == "data" and e["gpus_per_node"] == 2)
    row = {**entry["cpu"], "strategy": entry["strategy"]}
    shipped = estimate.predict(row, 2, catalogue, 50e9, constants)
    measured = estimate.predict(row, 2, gpu, 50e9, constants)
    assert measured["compute_s"] == pytest.approx(2 * shipped["compute_s"])  # half the rate: twice the compute
    assert measured["link_s"] == pytest.approx(shipped["link_s"] * catalogue.nvlink_bytes_s / 225e9)
    assert measured["step_s"] > shipped["step_s"]
    # flags still override a profile's numbers; one measured on one GPU keeps the catalogue's NVLink
    one = _gpu_profile(cpu_profile, tmp_path, collective_busbw={})
    assert gpus.resolve(None, tflops=100, profile_path=one).peak_flops == 100e12
    assert gpus.resolve("h200", profile_path=one).nvlink_bytes_s == catalogue.nvlink_bytes_s


def test_plan_with_a_profile_says_which_it_used(cpu_profile, tmp_path):
    path = _gpu_profile(cpu_profile, tmp_path, peak_flops={"bf16": 500e12})
    out = tmp_path / "plan"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "alpa_job",
            "plan",
            "--preset",
            "gpt-small",
            "--num-layers",
            "1",
            "--nodes",
            "1",
            "--gpus-per-node",
            "2",
            "--strategy",
            "data",
            "--cost-model",
            "flops",  # the factors' link basis is the FLOPs model's (the kernel model reads the profile's links)
            "--gpu-profile",
            path,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    assert plan["cluster"]["gpu"]["profile"] == path and plan["cluster"]["gpu"]["peak_flops"] == 500e12
    assert f"GPU profile {path}: NVIDIA H200" in proc.stdout  # the report's assumptions name it
    basis = gpus.CATALOGUE["h200"].nvlink_bytes_s / 1e9  # the calibration runs' GPU, as the catalogue has it
    assert f"the factors were fitted with NVLink at {basis:.0f} GB/s" in proc.stdout  # its measured link differs


@pytest.mark.parametrize(
    "content, words",
    [
        (None, "cannot read the GPU profile"),
        ("{not json", "is not JSON"),
        (
            {"ok": True, "checks": []},
            'is not a GPU profile (no "schema": "alpa_job.gpu_profile"); write one with python -m alpa_job plan calibrate',
        ),
        ("version", "of version 2, this kit reads 1"),
        ("no-bf16", "peak_flops.bf16 is missing or not a positive number"),
        ("kind", "was measured on NVIDIA H200 (h200), not --gpu h100; drop --gpu"),
    ],
)
def test_a_bad_profile_is_one_line_exit_2(cpu_profile, tmp_path, capsys, content, words):
    good = json.loads(cpu_profile[0].read_text())
    good.update(platform="gpu", device_kind="NVIDIA H200")
    path, extra = tmp_path / "profile.json", []
    if content == "version":
        path.write_text(json.dumps({**good, "version": 2}))
    elif content == "no-bf16":
        path.write_text(json.dumps({**good, "peak_flops": {"fp32": 1e12}}))
    elif content == "kind":
        path.write_text(json.dumps(good))
        extra = ["--gpu", "h100"]
    elif content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    args = [
        "plan",
        "--preset",
        "gpt-small",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--gpu-profile",
        str(path),
        "--out",
        str(tmp_path),
    ] + extra
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--shape", "3x4"], "--shape '3x4' is not MxNxK"),
        (["--shape", "0x4x4"], "has a size < 1"),
        (["--budget-s", "0"], "--budget-s must be > 0"),
        (["--bugdet-s", "3"], "did you mean --budget-s?"),
    ],
)
def test_calibrate_bad_flags_are_one_line_exit_2(capsys, argv, words):
    assert cli.main(["plan", "calibrate"] + argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_shipped_profiles_are_valid_gpu_profiles_the_catalogue_uses():
    names = (
        sorted(f[:-5] for f in os.listdir(gpu_profile.SHIPPED_DIR) if f.endswith(".json")) if os.path.isdir(gpu_profile.SHIPPED_DIR) else []
    )
    for name in names:
        profile = gpu_profile.shipped(name)
        assert profile["platform"] == "gpu" and gpus.DEVICE_KINDS[profile["device_kind"]] == name
        assert profile["command"].startswith("python -m alpa_job plan calibrate")
        assert gpus.CATALOGUE[name].peak_flops == profile["peak_flops"]["bf16"]
        assert gpus.CATALOGUE[name].profile and "shipped" in gpus.CATALOGUE[name].source
