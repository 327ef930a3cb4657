"""The input pipeline (alpa_job.data) on real files: token windows, ArrayRecord, .npz and a model's own
Grain dataset; per-process shards of one global order; exact resume; the eval split; and every bad
input as one line before any training."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from alpa_job.data.batching import plan_epoch
from alpa_job.data.pipeline import InputStream, Shard
from alpa_job.data.sources import ArraysSource
from alpa_job.data.tokens import TokenWindows
from alpa_job.errors import KitError
from alpa_job.launch.runner import run_in_process
from alpa_job.settings.config import JobConfig
from helpers_train import tiny_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = dict(num_layers=1, d_model=32, num_heads=4, seq_len=16, vocab_size=64)


def _token_file(path, tokens: int = 20000, vocab: int = 64, dtype=np.uint16) -> str:
    """A learnable stream: an arithmetic progression modulo the vocabulary."""
    (np.arange(tokens) * 5 % vocab).astype(dtype).tofile(path)
    return str(path)


def _all_batches(stream, start=0):
    return [batch for batch, _ in stream.batches(start)]


# ----------------------------------------------------------------------------- the stream
@pytest.mark.parametrize("policy", ["drop", "pad"])
def test_process_shards_add_up_to_the_global_batch_for_any_process_count(tmp_path, policy):
    """Each process reads only its rows; stacked, 1, 2 or 3 processes' rows are the same global batches
    (a restart on fewer hosts continues the same sample order)."""
    path = _token_file(tmp_path / "t.bin")
    source = TokenWindows([path], "uint16", 17)
    epoch = plan_epoch(len(source), 48, policy)
    steps = 2 * epoch.steps + 1  # into the third epoch: a fresh shuffle per epoch
    whole = _all_batches(InputStream(source, epoch, 48, 7, steps))
    for count in (2, 3):
        shards = [InputStream(TokenWindows([path], "uint16", 17), epoch, 48, 7, steps, Shard(i, count)) for i in range(count)]
        parts = [_all_batches(s) for s in shards]
        for step in range(steps):
            for field in ("tokens", "mask"):
                joined = np.concatenate([parts[i][step][field] for i in range(count)])
                np.testing.assert_array_equal(joined, whole[step][field])
        read = [s.source.rows_read for s in shards]
        assert sum(read) <= steps * 48 and max(read) <= steps * 48 // count  # only their own share
    assert not np.array_equal(whole[0]["tokens"], whole[epoch.steps]["tokens"])  # epochs reshuffle


def test_a_stream_started_mid_way_is_bit_identical_to_one_run_straight(tmp_path):
    source = TokenWindows([_token_file(tmp_path / "t.bin")], "uint16", 17)
    epoch = plan_epoch(len(source), 32, "drop")
    straight = _all_batches(InputStream(source, epoch, 32, 3, 40))
    resumed = _all_batches(InputStream(source, epoch, 32, 3, 40), start=23)
    for a, b in zip(straight[23:], resumed):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
    assert len(resumed) == 17


def test_the_stream_state_refuses_other_data_and_a_position_that_is_not_the_step():
    source = ArraysSource(_arrays(100), "x")
    stream = InputStream(source, plan_epoch(100, 10, "drop"), 10, 0, 20)
    saved = stream.state(7)
    assert saved["grain"]["next_index"] == 7 and saved["stream"]["rows"] == 100
    stream.check_state(saved, 7)  # the same stream: fine
    other = InputStream(source, plan_epoch(100, 20, "drop"), 20, 0, 20)
    with pytest.raises(KitError, match=r"data stream differs \(batch_size 10 -> 20"):
        other.check_state(saved, 7)
    with pytest.raises(KitError, match="data position"):
        stream.check_state(saved, 8)


def test_token_windows_overlap_by_one_and_never_cross_files(tmp_path):
    a = _token_file(tmp_path / "a.bin", tokens=50)
    b = _token_file(tmp_path / "b.bin", tokens=35)
    source = TokenWindows([a, b], "uint16", 11)
    assert len(source) == 4 + 3  # (50 - 1) // 10 and (35 - 1) // 10
    rows = source.read([3, 4])["tokens"]
    stream_a = np.fromfile(a, np.uint16)
    np.testing.assert_array_equal(rows[0], stream_a[30:41])
    np.testing.assert_array_equal(rows[1], np.fromfile(b, np.uint16)[:11])
    assert source.bytes_read == 2 * 11 * 4  # int32 rows handed out


def test_an_out_of_vocabulary_id_met_while_training_names_file_and_place(tmp_path):
    path = tmp_path / "t.bin"
    tokens = np.zeros(2000, np.uint16)
    tokens[1500] = 900
    tokens.tofile(path)
    source = TokenWindows([str(path)], "uint16", 17, vocab_size=64)
    with pytest.raises(KitError, match=r"t\.bin: token id 900 near token 14\d\d is >= --vocab-size 64"):
        source.read(np.arange(len(source)))


# ----------------------------------------------------------------------------- training on files
def test_gpt_trains_on_a_token_file_with_eval_and_perplexity(tmp_path):
    train = _token_file(tmp_path / "train.bin", tokens=30000)
    held = _token_file(tmp_path / "eval.bin", tokens=3000)
    config = tiny_config(
        "gpt",
        dataset="tokens",
        data_path=train,
        eval_data_path=held,
        eval_every=10,
        eval_batches=2,
        steps=30,
        batch_size=16,
        out=str(tmp_path / "run"),
        **GPT,
    )
    result = run_in_process(config)
    assert [p.step for p in result.evals] == [10, 20, 30]
    assert all(p.batches == 2 for p in result.evals)
    assert result.evals[-1].loss < result.evals[0].loss  # the model learns the progression
    assert result.evals[-1].perplexity == pytest.approx(np.exp(result.evals[-1].loss), rel=1e-3)
    assert result.eval_loss == result.evals[-1].loss
    assert result.input.pipeline == "grain" and result.input.rows == (30000 - 1) // 16
    assert result.input.rows_read == 30 * 16 and result.input.bytes_read == 30 * 16 * 17 * 4
    assert result.input.data_wait_s >= 0 and result.input.data_wait_fraction is not None
    assert result.process.bytes_read == result.input.bytes_read


def test_resume_sees_the_batches_an_uninterrupted_run_sees(tmp_path):
    """Bit-identical: the resumed run's losses (a function of the batches and the state) equal the
    uninterrupted run's at the same steps; its checkpoints carry the stream's position."""
    train = _token_file(tmp_path / "train.bin", tokens=12000)
    common = dict(dataset="tokens", data_path=train, batch_size=16, epochs=5, **GPT)
    straight = run_in_process(tiny_config("gpt", steps=24, out=str(tmp_path / "a"), **common))
    run_in_process(tiny_config("gpt", steps=14, checkpoint_every=7, out=str(tmp_path / "b"), **common))
    saved = json.load(open(tmp_path / "b" / "checkpoints" / "14" / "data" / "metadata"))
    assert saved["grain"]["next_index"] == 14 and saved["stream"]["batch_size"] == 16
    resumed = run_in_process(tiny_config("gpt", steps=24, checkpoint_every=7, resume=True, out=str(tmp_path / "b"), **common))
    assert resumed.resumed_from_step == 14 and resumed.steps == 10
    assert resumed.losses == straight.losses[14:]
    with pytest.raises(KitError, match="data stream differs"):
        run_in_process(
            tiny_config("gpt", steps=30, checkpoint_every=7, resume=True, out=str(tmp_path / "b"), **{**common, "batch_size": 8})
        )


def _arrays(n):
    """The tiny MLP's own synthetic rows, as a user would have them in files."""
    from alpa_job.data import synthetic

    return synthetic(tiny_config("mlp", num_samples=n))


def test_mlp_trains_on_an_npz_file_and_on_array_record_files(tmp_path):
    from alpa_job.data.records import write_records

    data = _arrays(96).arrays
    np.savez(tmp_path / "d.npz", **data)
    write_records(str(tmp_path / "a-0.arrayrecord"), ({k: v[i] for k, v in data.items()} for i in range(50)))
    write_records(str(tmp_path / "a-1.arrayrecord"), ({k: v[i] for k, v in data.items()} for i in range(50, 96)))
    npz = run_in_process(tiny_config("mlp", dataset="npz", data_path=str(tmp_path / "d.npz"), steps=12, epochs=5, out=str(tmp_path / "r1")))
    records = run_in_process(
        tiny_config(
            "mlp", dataset="array_record", data_path=str(tmp_path / "a-*.arrayrecord"), steps=12, epochs=5, out=str(tmp_path / "r2")
        )
    )
    assert npz.input.rows == records.input.rows == 96
    assert records.input.dataset.startswith("array_record: 2 file(s)")
    assert npz.losses == records.losses  # the same rows in the same order: the same training


# ----------------------------------------------------------------------------- bad input, before training
def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "alpa_job", "train", "--address", "none", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd or REPO,
    )


def _bad_cases(tmp_path):
    good = _token_file(tmp_path / "good.bin", tokens=20000, vocab=64)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    big_ids = _token_file(tmp_path / "big.bin", tokens=20000, vocab=5000)
    short = _token_file(tmp_path / "short.bin", tokens=100)
    rec = tmp_path / "bad.arrayrecord"
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(rec), "group_size:1")
    for _ in range(40):
        writer.write(b"not msgpack \xff")
    writer.close()
    gpt = [
        "--model",
        "gpt",
        "--num-layers",
        "1",
        "--d-model",
        "32",
        "--num-heads",
        "4",
        "--seq-len",
        "16",
        "--vocab-size",
        "64",
        "--batch-size",
        "16",
    ]
    return [
        (gpt + ["--dataset", "tokens", "--data-path", str(tmp_path / "nope.bin")], r"--data-path .*nope\.bin does not exist"),
        (gpt + ["--dataset", "tokens", "--data-path", str(tmp_path / "*.tok")], r"matches no file"),
        (gpt + ["--dataset", "tokens", "--data-path", str(odd)], r"not a uint16 token file .*--token-dtype"),
        (gpt + ["--dataset", "tokens", "--data-path", big_ids], r"token id 4\d\d\d .*>= --vocab-size 64; use --vocab-size"),
        (gpt + ["--dataset", "tokens", "--data-path", short], r"fewer than one global batch \(16\)"),
        (gpt + ["--dataset", "tokens", "--data-path", good, "--eval-every", "5"], r"--eval-every needs eval data"),
        (
            gpt + ["--dataset", "tokens", "--data-path", good, "--eval-data-path", str(tmp_path / "no-eval.bin")],
            r"--eval-data-path .*no-eval\.bin does not exist",
        ),
        (["--model", "mlp", "--dataset", "tokens", "--data-path", good], r"--model mlp reads 'x'"),
        (
            ["--model", "mlp", "--dataset", "array_record", "--data-path", str(rec), "--batch-size", "8"],
            r"bad\.arrayrecord record 0 does not decode",
        ),
        (gpt + ["--dataset", "tokens"], r"add --data-path PATH"),
        (gpt + ["--data-path", good], r"--data-path does nothing here"),
    ]


def test_every_bad_input_is_one_line_and_exit_2_before_training(tmp_path):
    for args, expected in _bad_cases(tmp_path):
        done = _cli(*args, "--out", str(tmp_path / "never"))
        lines = [l for l in done.stderr.strip().splitlines() if l.strip()]
        assert done.returncode == 2, (args, done.stderr[-2000:])
        assert len(lines) == 1, (args, done.stderr[-2000:])
        import re

        assert re.search(expected, lines[0]), (args, lines[0])
        assert not os.path.exists(tmp_path / "never" / "report.json")


# ----------------------------------------------------------------------------- a model package's own input
OWN_INPUT = """
import json

import flax.linen as nn
import grain
import numpy as np

from alpa_job import api


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


def decode(record: bytes):
    row = json.loads(record)
    return {"features": np.asarray(row["f"], np.float32), "y": np.asarray(row["t"], np.float32)}


def dataset(args, path, split):
    rows = np.load(path)
    return grain.MapDataset.source(range(len(rows["a"]))).map(
        lambda i: {"features": rows["a"][i], "y": rows["b"][i]})


def build(*, dtype, scale: float = 1.0):
    return api.Model(Net(), input_field="features", loss=api.mse, decode=decode, dataset=dataset)
"""


def test_a_model_package_decodes_its_records_and_gives_its_own_grain_dataset(tmp_path, monkeypatch):
    from array_record.python.array_record_module import ArrayRecordWriter

    from alpa_job.models import resolve

    (tmp_path / "own_input.py").write_text(OWN_INPUT)
    monkeypatch.syspath_prepend(str(tmp_path))
    rng = np.random.default_rng(0)
    a = rng.normal(size=(64, 4)).astype(np.float32)
    b = (0.5 * a).astype(np.float32)
    np.savez(tmp_path / "rows.npz", a=a, b=b)
    writer = ArrayRecordWriter(str(tmp_path / "rows.arrayrecord"), "group_size:1")
    for i in range(64):
        writer.write(json.dumps({"f": a[i].tolist(), "t": b[i].tolist()}).encode())
    writer.close()

    def own(**fields):
        return resolve(
            JobConfig(model="own_input:build", batch_size=16, steps=8, epochs=4, address="none", devices=8, **fields).validated()
        )

    by_records = run_in_process(own(dataset="array_record", data_path=str(tmp_path / "rows.arrayrecord"), out=str(tmp_path / "r1")))
    by_dataset = run_in_process(own(dataset="model", data_path=str(tmp_path / "rows.npz"), out=str(tmp_path / "r2")))
    assert by_records.input.rows == by_dataset.input.rows == 64
    assert by_records.losses == pytest.approx(by_dataset.losses, rel=1e-6)  # the same rows, the same order
    assert by_dataset.input.dataset.startswith("own_input:build dataset")


def test_without_grain_the_same_batches_come_from_the_plain_iterator(tmp_path, monkeypatch):
    """The Alpa image's Python 3.9 has no Grain: the stream falls back to a plain iterator with the same
    batches, the same resume position and `pipeline: in-memory`."""
    from alpa_job.data import pipeline

    source = TokenWindows([_token_file(tmp_path / "t.bin")], "uint16", 17)
    epoch = plan_epoch(len(source), 16, "pad")
    with_grain = InputStream(source, epoch, 16, 5, 30)
    assert with_grain.pipeline == "grain"
    expected = _all_batches(with_grain, start=4)
    monkeypatch.setattr(pipeline, "_grain", lambda: None)
    plain = InputStream(source, epoch, 16, 5, 30)
    assert plain.pipeline == "in-memory"
    got = _all_batches(plain, start=4)
    assert len(got) == len(expected) == 26
    for a, b in zip(expected, got):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
        np.testing.assert_array_equal(a["mask"], b["mask"])
    assert plain.state(9)["grain"] == {"next_index": 9}
