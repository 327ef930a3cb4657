"""Hugging Face weights in and out (`--init-from hf:DIR`, `hf export`, `hf logits`), against a checkpoint the
kit did not write: transformers' own Flax Llama and its PyTorch-name converter (tests/helpers_hf.py)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from alpa_job import cli
from alpa_job.hf import layout
from alpa_job.hf.checkpoint import HfCheckpoint
from helpers_cli import REPO, run_cli
import helpers_hf

LLAMA = os.path.join(REPO, "examples", "llama")
MODEL = ("--model", "llama_example.model:build")
TOKENS = np.array(
    [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61], [100, 3, 77, 5, 0, 127, 64, 32, 16, 8, 4, 2, 1, 99, 98, 97]], np.int32
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(folder, tensors, reference logits of TOKENS): the tiny Llama in fp32, sharded over two files."""
    folder = tmp_path_factory.mktemp("hf") / "tiny-llama"
    model = helpers_hf.reference_model()
    tensors = helpers_hf.pytorch_state_dict(model)
    helpers_hf.write_checkpoint(str(folder), tensors, helpers_hf.TINY)
    logits, _ = helpers_hf.reference_logits(model, tensors, TOKENS)
    return str(folder), tensors, logits


@pytest.fixture(autouse=True)
def llama_on_path(monkeypatch):
    monkeypatch.syspath_prepend(LLAMA)


def _kl(p_logits, q_logits) -> float:
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(p_logits.astype(np.float64)), log_softmax(q_logits.astype(np.float64))
    return float((np.exp(lp) * (lp - lq)).sum(-1).max())


def test_slices_read_from_the_file_equal_slices_of_the_whole_tensor(checkpoint):
    """What each device reads (a slice of a transposed, head-split projection) is that slice of the whole."""
    folder, tensors, _ = checkpoint
    ckpt = HfCheckpoint(folder)
    query = next(t for t in _weights().tensors if t.path == ("layer_1", "attention", "query", "kernel"))
    whole = layout.read_slice(ckpt, query, (64, 4, 16))
    np.testing.assert_array_equal(whole, tensors["model.layers.1.self_attn.q_proj.weight"].T.reshape(64, 4, 16))
    for index in [
        (slice(0, 32), slice(None), slice(None)),
        (slice(None), slice(2, 4), slice(None)),
        (slice(16, 48), slice(1, 3), slice(4, 12)),
        (slice(None), slice(None), slice(8, 16)),
    ]:
        np.testing.assert_array_equal(layout.read_slice(ckpt, query, (64, 4, 16), index), whole[index])
    np.testing.assert_array_equal(layout.to_tensor(query, whole), tensors["model.layers.1.self_attn.q_proj.weight"])


def test_a_bfloat16_checkpoint_in_one_file_reads_as_its_values(checkpoint, tmp_path):
    """Published checkpoints are bf16: read as such (the state casts them to its dtype, exactly: bf16 fits f32)."""
    import ml_dtypes

    _, tensors, _ = checkpoint
    helpers_hf.write_checkpoint(str(tmp_path / "bf16"), tensors, helpers_hf.TINY, files=1, dtype=ml_dtypes.bfloat16)
    ckpt = HfCheckpoint(str(tmp_path / "bf16"))
    assert ckpt.info("lm_head.weight") == ((128, 64), "BF16")
    head = next(t for t in _weights().tensors if t.name == "lm_head.weight")
    got = layout.read_slice(ckpt, head, (64, 128), (slice(0, 64), slice(64, 128)))
    np.testing.assert_array_equal(got.astype(np.float32), tensors["lm_head.weight"].astype(ml_dtypes.bfloat16).astype(np.float32).T[:, 64:])


def _weights(**args):
    from llama_example.model import LlamaArgs, build
    import jax.numpy as jnp

    base = dict(num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, mlp_dim=160, vocab_size=128, rms_norm_eps=1e-5)
    return build(LlamaArgs(**{**base, **args}), jnp.float32).hf


def test_logits_of_a_transformers_checkpoint_match_transformers_own_llama(checkpoint, tmp_path, capsys):
    """`hf logits` reads the sharded checkpoint, takes the model's settings from its config.json, and gives
    transformers' Flax Llama's logits (KL <= 1e-3; float32 on both sides gives ~1e-9)."""
    folder, _, reference = checkpoint
    np.save(tmp_path / "tokens.npy", TOKENS)
    code = cli.main(
        [
            "hf",
            "logits",
            folder,
            "--tokens",
            str(tmp_path / "tokens.npy"),
            "--out",
            str(tmp_path / "logits.npy"),
            *MODEL,
            "--model-arg",
            "attention=einsum",
        ]
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "num_layers=2" in out.out and "rms_norm_eps=1e-05" in out.out, out.out
    ours = np.load(tmp_path / "logits.npy")
    assert ours.shape == (2, 16, 128) and ours.dtype == np.float32
    assert _kl(reference, ours) <= 1e-3, _kl(reference, ours)
    np.testing.assert_allclose(ours, reference, atol=1e-4)


# Two CPU devices in the runs (the suite's own processes emulate 8), its fast compile settings kept.
RUN_ENV = {
    "PYTHONPATH": os.pathsep.join([REPO, LLAMA]),
    "XLA_FLAGS": os.environ.get("XLA_FLAGS", "").replace("device_count=8", "device_count=2"),
}


def _train(out, *extra):
    return run_cli(
        "train",
        "--address",
        "none",
        *MODEL,
        *sum((["--model-arg", a] for a in helpers_hf.TINY_ARGS), []),
        "--out",
        str(out),
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--num-samples",
        "8",
        "--quiet",
        *extra,
        env=RUN_ENV,
    )


def _first_loss(out) -> float:
    return json.loads((out / "report.json").read_text())["summary"]["loss_first"]


def test_fine_tune_from_a_checkpoint_sharded_or_pipelined_then_export_round_trips(checkpoint, tmp_path):
    """--init-from reads the checkpoint into fsdp's and the pipeline's shards (2 devices): both start from the same
    loss, not a random start's; `hf export` writes each run's weights back (the pipeline's stacked blocks as
    layers) and reading the export gives the run's parameters exactly."""
    folder, _, _ = checkpoint
    runs = {}
    for name, strategy in (("fsdp", ["--strategy", "fsdp"]), ("pipeline", ["--strategy", "pipeline", "--micro-batches", "2"])):
        p = _train(tmp_path / name, "--init-from", f"hf:{folder}", "--devices", "2", "--checkpoint-every", "2", *strategy)
        assert p.returncode == 0, p.stderr[-3000:]
        runs[name] = tmp_path / name
    random = _train(tmp_path / "random", "--devices", "2", "--strategy", "fsdp")
    assert random.returncode == 0, random.stderr[-3000:]
    first = {name: _first_loss(out) for name, out in runs.items()}
    assert first["fsdp"] == pytest.approx(first["pipeline"], rel=1e-5), first
    assert abs(first["fsdp"] - _first_loss(tmp_path / "random")) > 1e-3, (first, _first_loss(tmp_path / "random"))

    exported = {}
    for name, out in runs.items():
        p = run_cli("hf", "export", str(out), str(tmp_path / f"{name}-hf"), "--dtype", "float32", env=RUN_ENV)
        assert p.returncode == 0, p.stderr[-3000:]
        assert "exported step 2" in p.stdout, p.stdout
        exported[name] = HfCheckpoint(str(tmp_path / f"{name}-hf"))
    config = exported["fsdp"].config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 2
    assert config["rms_norm_eps"] == 1e-5 and config["tie_word_embeddings"] is False
    assert sorted(exported["fsdp"].names()) == sorted(HfCheckpoint(folder).names())
    # The same two steps from the same weights: the pipeline's blocks came back as the same layers.
    for name in exported["fsdp"].names():
        np.testing.assert_allclose(exported["pipeline"].read(name), exported["fsdp"].read(name), rtol=1e-4, atol=1e-6, err_msg=name)

    # Exact: reading the export gives back the run's own saved parameters.
    from alpa_job import hf_commands as commands

    state_dir = str(runs["fsdp"] / "checkpoints" / "2" / "state")
    layer = commands._restore(state_dir, "layer_0")
    for tensor in _weights().tensors:
        if tensor.path[0] == "layer_0":
            saved = commands._leaf(layer, tensor.path[1:])
            np.testing.assert_array_equal(layout.read_slice(exported["fsdp"], tensor, saved.shape), saved)


def _error(capsys, *argv) -> str:
    code = cli.main(list(argv))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.count("\n") == 0 and err.startswith("error: "), err
    return err


def test_bad_checkpoints_are_one_line_before_anything_starts(checkpoint, tmp_path, capsys):
    folder, tensors, _ = checkpoint
    base = [
        "train",
        "--address",
        "none",
        *MODEL,
        *sum((["--model-arg", a] for a in helpers_hf.TINY_ARGS), []),
        "--steps",
        "1",
        "--out",
        str(tmp_path / "never"),
    ]
    assert "hf:DIR" in _error(capsys, *base, "--init-from", folder)
    assert "no such folder" in _error(capsys, *base, "--init-from", f"hf:{tmp_path / 'nowhere'}")
    # Shapes that disagree with the settings: the fix names the --model-arg to set.
    err = _error(capsys, *base[:-4], "--model-arg", "num_layers=3", "--steps", "1", "--init-from", f"hf:{folder}")
    assert "num_hidden_layers 2 (the model: 3)" in err and "--model-arg num_layers=2" in err, err
    # Another architecture.
    other = tmp_path / "mistral"
    helpers_hf.write_checkpoint(str(other), tensors, helpers_hf.TINY)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "architectures": ["MistralForCausalLM"]}))
    assert "MistralForCausalLM" in _error(capsys, *base, "--init-from", f"hf:{other}")
    # A missing shard.
    cut = tmp_path / "cut"
    helpers_hf.write_checkpoint(str(cut), tensors, helpers_hf.TINY)
    os.remove(cut / "model-00002-of-00002.safetensors")
    assert "model-00002-of-00002.safetensors" in _error(capsys, *base, "--init-from", f"hf:{cut}")
    # A dtype the kit does not read.
    wide = tmp_path / "f64"
    helpers_hf.write_checkpoint(str(wide), tensors, helpers_hf.TINY, dtype=np.float64)
    assert "F64" in _error(capsys, *base, "--init-from", f"hf:{wide}")
    # A model without a Hugging Face layout.
    assert "declares no Hugging Face layout" in _error(
        capsys, "train", "--address", "none", "--model", "gpt", "--init-from", f"hf:{folder}", "--out", str(tmp_path / "gpt")
    )
    assert not (tmp_path / "gpt").exists()
    # Export never overwrites.
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("keep")
    err = _error(capsys, "hf", "export", str(tmp_path / "no-run"), str(tmp_path / "full"))
    assert "not a run folder" in err
    assert (tmp_path / "full" / "mine.txt").read_text() == "keep"
