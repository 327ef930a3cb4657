"""fsdp's weights gathered a layer at a time (`--fsdp-gather layer`, engines/layer_gather.py): the same losses
as XLA's own gathers, each layer gathered again in the backward instead of held, a peak that no longer holds
every layer's gathered weights, nested remat and the LLaMA example, and a note where a model cannot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from alpa_job.data import epoch_batches, synthetic
from alpa_job.planner import gpu_target
from alpa_job.record import hlo
from helpers_train import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(REPO, "examples", "llama") not in sys.path:
    sys.path.insert(0, os.path.join(REPO, "examples", "llama"))

GPT = dict(num_layers=4, batch_size=16, num_samples=64)


def _engine(config, strategy="fsdp", mesh=(8, 1)):
    from alpa_job.engines.jax_engine import JaxEngine
    from alpa_job.models import get_model

    model = get_model(config)
    batches = [b for b, _ in epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0)]
    engine = JaxEngine(config, model, batches[0], strategy, mesh)
    return engine, batches


def _losses(config, steps=8, strategy="fsdp", mesh=(8, 1)):
    engine, batches = _engine(config, strategy, mesh)
    stats = engine.compile()
    state, losses = engine.init_state(0), []
    for step in range(steps):
        state, loss = engine.step(state, engine.put_batch(batches[step % len(batches)]))
        losses.append(float(loss))
    return losses, engine, stats


def test_per_layer_gathers_give_the_losses_of_xlas_gathers():
    """GPT 4L, fp32, fsdp over 8 devices: 8 steps equal to XLA's placement to 1e-5 relative. The reference runs
    the default, auto, which keeps XLA's placement where the step fits; each report says which placement ran."""
    xla, xla_engine, _ = _losses(tiny_config("gpt", compile_cache="none", **GPT))
    layer, engine, _ = _losses(tiny_config("gpt", fsdp_gather="layer", **GPT))
    np.testing.assert_allclose(layer, xla, rtol=1e-5)
    assert engine.extra_report()["weight_gather"] == {"placement": "per layer", "layers": 4}
    fits = {"placement": "xla", "reason": "--fsdp-gather auto: the step fits with XLA's placement"}
    assert xla_engine.extra_report()["weight_gather"] == fits
    assert engine.layer_gather is not None and xla_engine.layer_gather is None


def _gathered_bytes(hlo_text: str) -> int:
    return sum(size for kind, _, size in hlo.collective_instances(hlo_text) if kind == "all-gather")


def test_each_layer_is_gathered_again_in_the_backward():
    """GPT 8L of width 256, bf16, on CPU devices: the compiled step gathers each block's weights in the forward
    and again in the backward, about twice the bytes XLA's placement gathers."""
    sizes = dict(num_layers=8, d_model=256, num_heads=4, seq_len=8, vocab_size=64, batch_size=16, num_samples=32, dtype="bfloat16")
    gathered = {}
    for mode in ("xla", "layer"):
        engine, _ = _engine(tiny_config("gpt", fsdp_gather=mode, **sizes))
        gathered[mode] = _gathered_bytes(engine.compile().hlo_texts[0])
    assert 1.7 * gathered["xla"] < gathered["layer"] < 2.2 * gathered["xla"], gathered


@pytest.mark.skipif(gpu_target.plugin() is None, reason="JAX's CUDA plugin is not installed (.ci/run installs it)")
def test_the_gpu_step_no_longer_holds_every_layers_gathered_weights(tmp_path):
    """The step compiled for 2 x H100 without a GPU (plan --cost-model kernels: XLA:GPU's own schedule and buffer
    assignment), a GPT whose weights dwarf its activations (8 blocks of width 1024, 2 sequences of 64 tokens a
    GPU, bf16). XLA's placement holds every block's gathered bf16 weights from the forward to the backward: its
    peak is more than 6 blocks' gathered weights above the per-layer one's, which stays within the state, its
    gradients' share and 3 blocks' gathered weights (activations are negligible here). On a card too small for
    XLA's placement (1.2 GB), the plan under --fsdp-gather auto compiles what train would run: per layer."""
    rows = {}
    for mode, memory in (("xla", "80"), ("auto", "1.2")):
        out = tmp_path / mode
        argv = [sys.executable, "-m", "alpa_job", "plan", "--model", "gpt", "--num-layers", "8", "--d-model", "1024"]
        argv += ["--num-heads", "8", "--seq-len", "64", "--vocab-size", "256", "--dtype", "bfloat16", "--batch-size", "4"]
        argv += ["--nodes", "1", "--gpus-per-node", "2", "--gpu", "h100", "--cost-model", "kernels", "--strategy", "fsdp"]
        argv += ["--fsdp-gather", mode, "--gpu-memory-gb", memory, "--out", str(out)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (rows[mode],) = json.loads((out / "plan.json").read_text())["candidates"]
    block_bf16 = 12 * 1024 * 1024 * 2  # a block's weights (attention 4 d^2, MLP 8 d^2) whole in bf16
    xla, layer = rows["xla"], rows["auto"]
    state = xla["state_bytes_per_device"]
    assert xla["gpu_peak_bytes"] - layer["gpu_peak_bytes"] > 6 * block_bf16, (xla, layer)
    gradient_share = state / 3  # Adam's state: fp32 parameters and two moments; the gradients one more such share
    assert layer["gpu_peak_bytes"] - state < gradient_share + 3 * block_bf16, (xla, layer)
    assert layer["fits"] and layer["note"].startswith("per layer (--fsdp-gather auto: XLA's placement needs 0.9 GB"), layer


def test_the_llama_example_gathers_per_layer_and_leaves_its_own_remat_to_xla():
    """The LLaMA example (GQA, RoPE, SwiGLU), --fsdp-gather layer: per layer without remat; under `remat=full`
    its block class is flax's nn.remat of it, whose checkpoint already gathers again in the backward, so the kit
    leaves those layers to XLA and the report says so. Same fp32 losses both ways (remat changes no number)."""
    args = dict(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, seq_len=16, vocab_size=64)
    runs = {}
    for remat in ("none", "full"):
        config = tiny_config("llama_example.model:build", model_args={**args, "remat": remat}, fsdp_gather="layer")
        losses, engine, _ = _losses(config, steps=5)
        runs[remat] = (losses, engine.extra_report()["weight_gather"])
    np.testing.assert_allclose(runs["full"][0], runs["none"][0], rtol=1e-5)
    assert runs["none"][1] == {"placement": "per layer", "layers": 2}
    assert runs["full"][1]["placement"] == "xla" and "its own remat" in runs["full"][1]["reason"], runs["full"][1]


def test_a_model_with_batch_statistics_keeps_xlas_gathers_and_says_so():
    engine, _ = _engine(tiny_config("wide_resnet", fsdp_gather="layer"))
    assert engine.layer_gather is None
    assert any("--fsdp-gather layer" in note and "BatchNorm" in note for note in engine.notes()), engine.notes()


def test_auto_gathers_per_layer_once_xlas_placement_does_not_fit(monkeypatch, tmp_path):
    """--fsdp-gather auto (the default) compiles XLA's placement first; where that step does not fit (here: the
    memory check refuses its first step, as it would over a device's budget), it compiles per-layer gathers
    instead, says so, and the report names the placement. The step store keeps that step under its placement,
    so an identical run starts with per-layer gathers and compiles once."""
    from alpa_job.engines import memory_fit
    from alpa_job.errors import KitError

    offered = []

    def refuse_the_first(memory, *args, gather_layers=False, **kwargs):
        offered.append(gather_layers)
        if len(offered) == 1:
            raise KitError("XLA's estimate for the train step needs more than the devices have")

    monkeypatch.setattr(memory_fit, "check_step_fits", refuse_the_first)
    config = tiny_config("gpt", compile_cache=str(tmp_path / "cache"), **GPT)
    losses, engine, _ = _losses(config, steps=3)
    assert offered == [True, False]  # the first refusal could still name --fsdp-gather layer as a way out
    assert engine.extra_report()["weight_gather"] == {"placement": "per layer", "layers": 4}
    assert any(note.startswith("--fsdp-gather auto: the step did not fit") for note in engine.notes())
    engine.finish(str(tmp_path / "run"))  # the store's write, finished

    again, engine, stats = _losses(config, steps=3)
    assert offered == [True, False, False] and engine.layer_gather is not None
    assert stats.step_source == "stored" and engine.layer_gather.gathered_layers == 4  # kept beside it: no trace
    np.testing.assert_allclose(again, losses, rtol=1e-6)


_TWO_PROCESSES = r"""
import json, sys
from alpa_job.cluster.jax_join import init_distributed
init_distributed(sys.argv[1], 2, int(sys.argv[2]), timeout_s=60)
import jax
from alpa_job.data import epoch_batches, synthetic
from alpa_job.engines import memory_fit
from alpa_job.engines.jax_engine import JaxEngine
from alpa_job.errors import KitError
from alpa_job.models import get_model
from alpa_job.train.profile import StepProfile
from helpers_train import tiny_config

if jax.process_index() == 1:  # this process's devices are the smaller ones: XLA's placement does not fit here
    fits, refused = memory_fit.check_step_fits, []

    def refuse_the_first(memory, *args, **kwargs):
        refused.append(1)
        if len(refused) == 1:
            raise KitError("XLA's estimate for the train step needs more than the devices have")
        return fits(memory, *args, **kwargs)

    memory_fit.check_step_fits = refuse_the_first
config = tiny_config("gpt", compile_cache="none", devices=4, num_layers=4, batch_size=16, num_samples=64)
batch, _ = next(epoch_batches(synthetic(config), config.batch_size, "drop", 0, 0))
engine = JaxEngine(config, get_model(config), batch, "fsdp", (4, 1))
engine.compile()
engine.wait_for_every_process()
state, losses = engine.init_state(0), []
profile = StepProfile(2, 1, sys.argv[3])  # both processes' run folder is one, as on shared storage
for step in range(1, 4):
    profile.before_step(step)
    state, loss = engine.step(state, engine.put_batch(batch))
    profile.after_step(step, engine, state)
    losses.append(float(loss))
out = {"per_layer": engine.layer_gather is not None, "losses": losses, "notes": engine.notes(), "profile": profile.summary()}
print(json.dumps(out))
"""


def test_auto_in_a_job_of_several_processes_switches_every_process_where_one_does_not_fit(tmp_path):
    """Every process must run one program: two JAX processes (2 CPU devices each), the step fits on the first and
    not on the second, and both compile per-layer gathers, say so, and train together. Their `--profile` traces,
    in one run folder on one host, stay apart: each process reads its own."""
    import socket

    from alpa_job.cpu_devices import with_device_count

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests")]), XLA_FLAGS=with_device_count(2))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TWO_PROCESSES, f"127.0.0.1:{port}", str(i), str(tmp_path / "run")],
            env=env,
            cwd=str(tmp_path),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [r["per_layer"] for r in results] == [True, True]
    assert all(any("did not fit with XLA's placement of the gathers on some process" in n for n in r["notes"]) for r in results)
    assert results[0]["losses"] == results[1]["losses"] and results[0]["losses"][-1] < results[0]["losses"][0]
    profiles = [r["profile"] for r in results]
    assert [os.path.basename(p["dir"]) for p in profiles] == ["process-0", "process-1"]
    assert all(p["trace"].startswith(p["dir"] + os.sep) and os.path.isfile(p["trace"]) for p in profiles), profiles
    assert all("summary_error" not in p and p["comm_share"] > 0 for p in profiles), profiles


def test_a_step_over_the_budget_names_per_layer_gathers_as_a_way_out(monkeypatch):
    from alpa_job.engines import memory_fit
    from alpa_job.errors import KitError

    monkeypatch.setattr(memory_fit, "budget", lambda devices: (10**9, 1, "a device has 1 GB"))
    with pytest.raises(KitError, match=r"use --fsdp-gather layer \(holds a layer's gathered weights at a time"):
        memory_fit.check_step_fits({"peak_estimate_bytes": 2 * 10**9}, "fsdp", (8, 1), devices=[object()], gather_layers=True)
