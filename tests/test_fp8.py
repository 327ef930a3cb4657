"""`--precision fp8`: the dense products in float8 with per-tensor scales of the step (engines/fp8.py), checked
against the same arithmetic written out in numpy with ml_dtypes' fp8 rounding, then in training (CPU: emulated)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from alpa_job import cli
from alpa_job.engines import fp8
from helpers_cli import REPO, run_cli

LLAMA = os.path.join(REPO, "examples", "llama")


def _rounded(x: np.ndarray, fp8_type) -> np.ndarray:
    """x on the fp8 grid at its own scale (amax -> the format's largest value), in float32."""
    x = np.asarray(x, np.float32)
    largest = float(ml_dtypes.finfo(fp8_type).max)
    scale = np.float32(max(np.abs(x).max(), 1e-12) / largest)
    return (np.clip(x / scale, -largest, largest).astype(fp8_type).astype(np.float32) * scale).astype(np.float32)


def test_the_product_and_its_gradients_are_those_of_the_rounded_operands():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 32)).astype(np.float32), rng.standard_normal((32, 16)).astype(np.float32) * 0.1
    g = rng.standard_normal((8, 16)).astype(np.float32) * 1e-3
    dims = (((1,), (0,)), ((), ()))
    out, pullback = jax.vjp(lambda a, b: fp8.dot_general(a, b, dims), jnp.asarray(x), jnp.asarray(w))
    xq, wq, gq = _rounded(x, ml_dtypes.float8_e4m3fn), _rounded(w, ml_dtypes.float8_e4m3fn), _rounded(g, ml_dtypes.float8_e5m2)
    np.testing.assert_allclose(np.asarray(out), xq @ wq, rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(out), x @ w, rtol=1e-4)  # really rounded
    dx, dw = pullback(jnp.asarray(g))
    np.testing.assert_allclose(np.asarray(dx), gq @ wq.T, rtol=1e-5, atol=1e-9)  # e5m2 gradient x e4m3 weight
    np.testing.assert_allclose(np.asarray(dw), xq.T @ gq, rtol=1e-5, atol=1e-9)
    hlo = jax.jit(jax.grad(lambda a, b: fp8.dot_general(a, b, dims).sum(), argnums=(0, 1))).lower(x, w).as_text()
    assert "f8E4M3FN" in hlo and "f8E5M2" in hlo, hlo[:2000]


def test_a_gpu_without_fp8_tensor_cores_is_named():
    a100 = SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="NVIDIA A100-SXM4-80GB")
    h100 = SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="NVIDIA H100 80GB HBM3")
    assert fp8.unsupported_gpu([h100]) == ""
    assert fp8.unsupported_gpu([h100, a100]) == "NVIDIA A100-SXM4-80GB (compute capability 8.0)"
    assert fp8.unsupported_gpu(jax.devices("cpu")) == ""


TINY = ["num_layers=2", "d_model=64", "num_heads=4", "vocab_size=128", "seq_len=32"]
ENV = {
    "PYTHONPATH": os.pathsep.join([REPO, LLAMA]),
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", "").replace("device_count=8", "device_count=2"),
}


def _train(out, *extra):
    p = run_cli(
        "train",
        "--address",
        "none",
        "--model",
        "llama_example.model:build",
        *sum((["--model-arg", a] for a in TINY), []),
        "--dtype",
        "bfloat16",
        "--steps",
        "20",
        "--batch-size",
        "8",
        "--devices",
        "2",
        "--out",
        str(out),
        "--quiet",
        *extra,
        env=ENV,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((out / "report.json").read_text())


def test_fp8_trains_like_bf16_under_data_and_the_pipeline(tmp_path):
    """The same 20 steps in bf16 and in fp8 (data, and a 2-stage pipeline whose stages scale their own
    operands): fp8's losses stay within 1 % of bf16's and are not bf16's; the report names fp8 and its peak."""
    bf16 = _train(tmp_path / "bf16")
    runs = {
        "data": _train(tmp_path / "fp8", "--precision", "fp8"),
        "pipeline": _train(tmp_path / "fp8-pipe", "--precision", "fp8", "--strategy", "pipeline", "--micro-batches", "2"),
    }
    base = np.array(bf16["losses"])
    for name, report in runs.items():
        losses = np.array(report["losses"])
        assert report["config"]["precision"] == "fp8"
        np.testing.assert_allclose(losses, base, rtol=0.01, err_msg=name)
        assert np.abs(losses - base).max() > 0, name  # the products really ran in fp8
        assert report["timing"]["peak"]["precision"] == "fp8", report["timing"]["peak"]
        assert any("emulated" in n for n in report["notes"]), report["notes"]
    assert base[-1] < base[0] - 0.1  # and it learns


def _error(capsys, *argv) -> str:
    code = cli.main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    return err


def test_fp8_without_bf16_or_without_a_dense_product_is_one_line(tmp_path, capsys):
    assert "add --dtype bfloat16" in _error(capsys, "train", "--address", "none", "--precision", "fp8", "--out", str(tmp_path / "a"))
    err = _error(
        capsys,
        "train",
        "--address",
        "none",
        "--model",
        "wide_resnet",
        "--precision",
        "fp8",
        "--dtype",
        "bfloat16",
        "--steps",
        "1",
        "--out",
        str(tmp_path / "b"),
    )
    assert "--model wide_resnet has no dense layer" in err and "dot_general=alpa_job.api.dot_general" in err, err
    assert not (tmp_path / "b").exists()


def test_a_user_model_without_a_dense_product_for_fp8_is_refused_when_its_step_is_traced(tmp_path, capsys, monkeypatch):
    """The ResNet example's layers are convolutions: nothing would run in fp8, and the run says so (exit 2)."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "examples", "resnet"))
    code = cli.main(
        [
            "train",
            "--address",
            "none",
            "--model",
            "resnet_example.model:build",
            "--precision",
            "fp8",
            "--dtype",
            "bfloat16",
            "--steps",
            "1",
            "--batch-size",
            "8",
            "--out",
            str(tmp_path / "c"),
        ]
    )
    said = capsys.readouterr()
    report = json.loads((tmp_path / "c" / "report.json").read_text())
    assert code == 2, said
    assert "has no dense layer whose product the kit can run in fp8" in report["error"], report["error"]
