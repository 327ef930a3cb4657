"""A user's own model trained across the 3-host test bed, the package shipped by Ray with the job:
`ray job submit --working-dir examples/llama -- python -m alpa_job train --model llama_example.model:build`
(a source folder), and `--runtime-env-json '{"py_modules": [...]}'` (a module folder, e.g. an installed
package). No host can import the package from its own Python path, so a run that trains on all three
proves the job's runtime env reached every node's JAX process (the kit's actors add their own env vars
to it, never replace it)."""

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
import helpers_hf
from alpa_job.cpu_devices import with_device_count
from helpers_cli import run_cli
from helpers_report import assert_valid_report

pytestmark = [pytest.mark.testbed, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
LLAMA_DIR = REPO / "examples" / "llama"
BUILDER = "llama_example.model:build"
TINY_LLAMA = ["num_layers=2", "d_model=32", "num_heads=4", "num_kv_heads=2", "seq_len=16", "vocab_size=64"]
STEPS = 3


# A Hugging Face checkpoint of TINY_LLAMA's shapes, shipped in the working directory beside the package.
HF_TINY = {
    "hidden_size": 32,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 64,
    "rms_norm_eps": 1e-6,
}


def _source_on_the_head_only(ray_cluster) -> Path:
    """A copy of the example's folder that only the head sees (as on a real cluster, where the source is on
    the submitting machine), with a tiny Hugging Face checkpoint in it (hf-tiny/): the bed's hosts share the
    machine's files except their own /tmp/ray, so the copy goes there. Returns its path as the head sees it."""
    bed = ray_cluster.testbed
    private = bed.ray_dir("head") / "akt-user-src" / "llama"
    if not private.exists():
        shutil.copytree(LLAMA_DIR, private, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        helpers_hf.write_tiny(str(private / "hf-tiny"), **HF_TINY)
    inside = Path("/tmp/ray/akt-user-src/llama")
    assert bed.exec("head", "test", "-f", str(inside / "llama_example" / "model.py"), check=False).returncode == 0
    for host in bed.ips:
        if host != "head":
            assert bed.exec(host, "test", "-e", str(inside), check=False).returncode != 0, host
    return inside


def _not_importable_on_any_host(ray_cluster):
    bed = ray_cluster.testbed
    for host in bed.ips:
        p = bed.exec(host, "python", "-c", "import llama_example", check=False)
        assert p.returncode != 0 and "No module named 'llama_example'" in p.stderr, (host, p.stdout, p.stderr)


def _unpacked_on_every_host(ray_cluster, kind: str):
    """Ray unpacked the package into each host's own /tmp/ray (private to the host) for that host's process."""
    bed = ray_cluster.testbed
    for host in bed.ips:
        found = list(bed.ray_dir(host).glob("session_*/runtime_resources/%s/*/llama_example/model.py" % kind))
        assert found, "no %s copy of llama_example under %s" % (kind, bed.ray_dir(host))


def _train_command(ray_cluster, out: Path):
    model_args = [x for arg in TINY_LLAMA for x in ("--model-arg", arg)]
    return [
        "python",
        "-m",
        "alpa_job",
        "train",
        "--model",
        BUILDER,
        *model_args,
        "--steps",
        str(STEPS),
        "--devices",
        "2",
        "--batch-size",
        "12",
        "--num-samples",
        "48",
        "--compile-cache",
        "none",
        "--cluster-spec",
        str(ray_cluster.spec_path),
        "--out",
        str(out),
    ]


def _run_job(ray_cluster, tag: str, ray_args, entrypoint):
    """`ray job submit` from the head; `entrypoint(out)` is the command after `--`. Returns (out, process)."""
    bed = ray_cluster.testbed
    out = Path("/tmp") / ("akt-usermodel-%s-%s" % (tag, uuid.uuid4().hex[:8]))  # /tmp is shared by every host
    p = bed.exec(
        "head",
        "ray",
        "job",
        "submit",
        "--address",
        "http://%s:%d" % (ray_cluster.head_ip, ray_cluster.spec.ports["dashboard"]),
        *ray_args,
        "--",
        *entrypoint(out),
        timeout=500,
        check=False,
    )
    return out, p


def _submit(ray_cluster, tag: str, *ray_args: str):
    """`ray job submit` from the head with `ray_args` shipping the package; returns (report, process)."""
    out, p = _run_job(ray_cluster, tag, ray_args, lambda out: _train_command(ray_cluster, out))
    assert p.returncode == 0, "ray job submit (%s) failed:\n%s\n%s" % (tag, p.stdout[-6000:], p.stderr[-3000:])
    report = json.loads((out / "report.json").read_text())
    assert_valid_report(report)
    return report, p


def _check_trained_on_three_hosts(ray_cluster, report):
    bed = ray_cluster.testbed
    s = report["summary"]
    assert s["processes"] == 3 and s["hosts"] == 3 and s["devices"] == 6
    assert report["compiles"] == 1 and s["one_compile"] is True
    assert report["steps"] == STEPS
    procs = report["processes"]
    assert sorted(p["host"] for p in procs) == sorted(bed.ips)  # three distinct hosts
    for p in procs:
        assert p["ip"] == bed.ips[p["host"]], p  # each process's IP is its own host's
    assert report["config"]["model"] == BUILDER
    assert report["config"]["model_args"]["num_layers"] == 2
    assert report["versions"].get("alpa_job_api")


def test_working_dir_reaches_every_nodes_process_and_a_fine_tune_starts_from_its_checkpoint(ray_cluster, tmp_path):
    """The job also starts from the Hugging Face checkpoint shipped in the working directory (--init-from
    hf:hf-tiny, read by each host's process from its own unpacked copy): its first loss is the one a run on
    this machine alone gets from the same checkpoint."""
    _not_importable_on_any_host(ray_cluster)
    source = _source_on_the_head_only(ray_cluster)
    out, p = _run_job(
        ray_cluster, "workdir", ["--working-dir", str(source)], lambda out: _train_command(ray_cluster, out) + ["--init-from", "hf:hf-tiny"]
    )
    assert p.returncode == 0, "ray job submit failed:\n%s\n%s" % (p.stdout[-6000:], p.stderr[-3000:])
    report = json.loads((out / "report.json").read_text())
    assert_valid_report(report)
    _check_trained_on_three_hosts(ray_cluster, report)
    assert "succeeded" in p.stdout + p.stderr
    _unpacked_on_every_host(ray_cluster, "working_dir_files")

    alone = tmp_path / "alone"
    local = _train_command(ray_cluster, alone)[3:]  # after `python -m alpa_job`
    local = [a for a in local if a != "--cluster-spec" and a != str(ray_cluster.spec_path)]
    q = run_cli(
        *local,
        "--address",
        "none",
        "--init-from",
        "hf:%s" % (ray_cluster.testbed.ray_dir("head") / "akt-user-src" / "llama" / "hf-tiny"),
        env={"PYTHONPATH": "%s:%s" % (REPO, LLAMA_DIR), "XLA_FLAGS": with_device_count(2)},
    )
    assert q.returncode == 0, q.stderr[-3000:]
    first = json.loads((alone / "report.json").read_text())["summary"]["loss_first"]
    assert report["summary"]["loss_first"] == pytest.approx(first, rel=1e-5), (report["summary"], first)


def test_py_modules_runtime_env_reaches_every_nodes_process(ray_cluster):
    _not_importable_on_any_host(ray_cluster)
    source = _source_on_the_head_only(ray_cluster)
    runtime_env = json.dumps({"py_modules": [os.fspath(source / "llama_example")]})
    report, p = _submit(ray_cluster, "pymodules", "--runtime-env-json", runtime_env)
    _check_trained_on_three_hosts(ray_cluster, report)
    assert "succeeded" in p.stdout + p.stderr
    _unpacked_on_every_host(ray_cluster, "py_modules_files")


def test_a_package_only_the_driver_imports_is_named_in_one_line(ray_cluster):
    """The control: the driver imports the builder from its current directory (`cd` into the head-only
    folder; Ray puts that directory on the workers' path too, but it does not exist on the other hosts) and
    nothing ships the package, so the other hosts' JAX processes cannot import it: the job fails with the
    kit's one line naming the fix (--working-dir)."""
    source = _source_on_the_head_only(ray_cluster)

    def entrypoint(out):
        train = " ".join(_train_command(ray_cluster, out))
        return ["bash", "-c", "cd %s && %s" % (source, train)]

    _, p = _run_job(ray_cluster, "driveronly", (), entrypoint)
    text = p.stdout + p.stderr
    assert p.returncode != 0 and "failed with exit code 2" in text, text[-3000:]  # the kit's user-error exit
    errors = [line for line in text.splitlines() if line.startswith("error: --model %s: cannot import" % BUILDER)]
    assert errors and "--working-dir" in errors[0], text[-5000:]
