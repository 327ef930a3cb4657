"""`python -m alpa_job data tokenize`: text files -> a flat token file, offline, atomically."""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from alpa_job.data import tokenize as tok
from alpa_job.data.tokenizer import load_tokenizer
from alpa_job.errors import KitError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MERGES = [b"th", b"he", b"the", b" t", b" the", b"in", b"ing", b"  ", b"    ", b"\n "]
TEXT = (
    "the thing in the theatre\n"
    "    indented then\n"
    "trailing spaces   \n"
    "ends with a dot.\n"
    "\n"
    "  two spaces\n"
    "héllo wörld 123 — the end\n"
    "x\n/path\n"
)


def write(path, text):
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


@pytest.fixture
def ranks_file(tmp_path):
    """A tiny real BPE: the 256 single bytes, then a few merges."""
    ranks = [bytes([b]) for b in range(256)] + MERGES
    path = tmp_path / "tiny.tiktoken"
    path.write_bytes(b"".join(base64.b64encode(t) + b" %d\n" % i for i, t in enumerate(ranks)))
    return str(path), ranks


def read(out, dtype="<u2"):
    return np.fromfile(out, dtype=dtype)


def test_bytes_round_trip(tmp_path):
    a = write(tmp_path / "a.txt", "hello wörld\nline two\n")
    b = write(tmp_path / "b.txt", "zweite Datei ✓")
    out = str(tmp_path / "out" / "train.bin")
    summary = tok.tokenize_files([a, b], out, tokenizer="bytes", progress=False)
    expected = list("hello wörld\nline two\n".encode()) + [256] + list("zweite Datei ✓".encode()) + [256]
    assert read(out).tolist() == expected
    assert summary["tokens"] == len(expected) and summary["documents"] == 2 and summary["files"] == 2
    assert summary["bytes"] == os.path.getsize(out) == 2 * len(expected)
    assert (summary["vocab_size"], summary["dtype"], summary["max_id"], summary["eot"]) == (257, "uint16", 256, 256)
    side = json.load(open(tok.sidecar_path(out)))
    assert side["tokenizer"] == "bytes" and side["vocab_size"] == 257 and side["tokens"] == len(expected)
    assert sorted(os.listdir(tmp_path / "out")) == ["train.bin", "train.bin.json"]  # no partial left


def test_no_eot_and_uint32(tmp_path):
    a = write(tmp_path / "a.txt", "ab")
    out = str(tmp_path / "t.bin")
    summary = tok.tokenize_files([a, a], out, dtype="uint32", eot=False, progress=False)
    assert read(out, "<u4").tolist() == [97, 98, 97, 98]
    assert summary["eot"] is None and summary["bytes"] == 16


def test_local_tiktoken_ranks_encode_real_bpe_and_decode_back(tmp_path, ranks_file):
    path, ranks = ranks_file
    a = write(tmp_path / "a.txt", TEXT)
    out = str(tmp_path / "t.bin")
    summary = tok.tokenize_files([a], out, tokenizer=path, progress=False)
    ids = read(out).tolist()
    eot = len(ranks)
    assert ids[-1] == eot and eot not in ids[:-1]
    assert b"".join(ranks[i] for i in ids[:-1]) == TEXT.encode()
    assert ranks.index(b" the") in ids and ranks.index(b"the") in ids  # merges happened: this is BPE
    assert len(ids) - 1 < len(TEXT.encode())
    assert summary["vocab_size"] == eot + 1 and summary["max_id"] == eot


def test_chunks_never_change_the_tokens(tmp_path, ranks_file):
    path, _ranks = ranks_file
    text = TEXT * 40
    a = write(tmp_path / "a.txt", text)
    whole = list(load_tokenizer(path).encode(text))
    for chunk in (7, 64, 1000):
        out = str(tmp_path / f"t{chunk}.bin")
        tok.tokenize_files([a], out, tokenizer=path, progress=False, chunk_bytes=chunk)
        assert read(out).tolist()[:-1] == whole, chunk
        out = str(tmp_path / f"b{chunk}.bin")
        tok.tokenize_files([a], out, progress=False, chunk_bytes=chunk)
        assert bytes(read(out)[:-1].astype(np.uint8)) == text.encode()


def test_cut_points_avoid_whitespace_runs():
    assert tok._cut_point(b"abc\ndef\n  g", 0) == 7  # before a newline after a letter
    assert tok._cut_point(b"a.\n  b.\n  c", 0) == 0  # every newline touches whitespace or punctuation...
    assert tok._cut_point(b"a.\nb", 0) == 3  # ...but a newline between punctuation and a letter will do
    assert tok._cut_point(b"\xc3\xa9\nx", 0) == 2  # the letter before is two UTF-8 bytes


def test_dtype_choice():
    assert tok.choose_dtype(257, None) == "uint16"
    assert tok.choose_dtype(65536, None) == "uint16"
    assert tok.choose_dtype(65537, None) == "uint32"
    assert tok.choose_dtype(257, "uint32") == "uint32"
    with pytest.raises(KitError, match="use --token-dtype uint32"):
        tok.choose_dtype(100277, "uint16")


def test_a_failure_midway_leaves_no_output_and_keeps_the_old_one(tmp_path):
    good = write(tmp_path / "a.txt", "fine text\n" * 100)
    bad = tmp_path / "b.txt"
    bad.write_bytes(b"ok so far\n" * 5 + b"caf\xe9\n")
    out = tmp_path / "t.bin"
    with pytest.raises(KitError, match=r"b\.txt is not UTF-8 text: byte 53 is 0xe9"):
        tok.tokenize_files([good, str(bad)], str(out), progress=False, chunk_bytes=16)
    assert sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt"]
    out.write_bytes(b"old")
    with pytest.raises(KitError):
        tok.tokenize_files([good, str(bad)], str(out), progress=False)
    assert out.read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["a.txt", "b.txt", "t.bin"]


def test_inputs_folders_and_globs(tmp_path):
    write(tmp_path / "b.txt", "B")
    write(tmp_path / "a.txt", "A")
    write(tmp_path / "skip.md", "no")
    assert tok.expand_inputs([str(tmp_path)]) == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    assert tok.expand_inputs([str(tmp_path / "*.md")]) == [str(tmp_path / "skip.md")]
    with pytest.raises(KitError, match="no file matches"):
        tok.expand_inputs([str(tmp_path / "*.json")])
    with pytest.raises(KitError, match="does not exist"):
        tok.expand_inputs([str(tmp_path / "missing.txt")])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KitError, match="holds no"):
        tok.expand_inputs([str(empty)])


def test_bad_tokenizers(tmp_path):
    with pytest.raises(KitError, match="unknown tokenizer 'byte'.*did you mean bytes"):
        load_tokenizer("byte")
    with pytest.raises(KitError, match="does not exist"):
        load_tokenizer(str(tmp_path / "none.tiktoken"))
    broken = tmp_path / "broken.tiktoken"
    broken.write_bytes(b"YQ== 0\nnot base64!\n")
    with pytest.raises(KitError, match="line 2 is not 'BASE64TOKEN RANK'"):
        load_tokenizer(str(broken))
    partial = tmp_path / "partial.tiktoken"
    partial.write_bytes(b"YQ== 0\n")
    with pytest.raises(KitError, match="no rank for 255 of the 256 single bytes"):
        load_tokenizer(str(partial))
    with pytest.raises(KitError, match="did you mean gpt2"):
        load_tokenizer("tiktoken:gtp2")


@pytest.mark.timeout(30)
def test_tiktoken_gpt2_without_its_cache_fails_at_once_without_the_network(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "cache"))

    def no_network(*args, **kwargs):
        raise AssertionError("the tokenizer tried the network")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(socket.socket, "connect", no_network)
    start = time.perf_counter()
    with pytest.raises(KitError) as err:
        load_tokenizer("tiktoken:gpt2")
    assert time.perf_counter() - start < 5
    message = str(err.value)
    assert "\n" not in message and "not available offline" in message
    assert "TIKTOKEN_CACHE_DIR" in message and "PATH.tiktoken" in message and str(tmp_path / "cache") in message


def cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "alpa_job", "data", "tokenize", *args], cwd=REPO, capture_output=True, text=True, timeout=60, env=env
    )


def test_cli_end_to_end(tmp_path, ranks_file):
    path, _ranks = ranks_file
    (tmp_path / "docs").mkdir()
    write(tmp_path / "docs" / "a.txt", TEXT)
    out = str(tmp_path / "t.bin")
    done = cli(str(tmp_path / "docs"), "--out", out, "--tokenizer", path)
    assert done.returncode == 0, done.stderr
    assert "tokenized 1 file(s), 1 document(s)" in done.stdout and tok.sidecar_path(out) in done.stdout
    assert json.load(open(tok.sidecar_path(out)))["tokens"] == os.path.getsize(out) // 2


@pytest.mark.timeout(30)
def test_cli_errors_are_one_line_exit_2(tmp_path):
    env = dict(os.environ, TIKTOKEN_CACHE_DIR=str(tmp_path / "empty-cache"))
    write(tmp_path / "a.txt", "text")
    for args in (
        [str(tmp_path / "missing.txt"), "--out", str(tmp_path / "t.bin")],
        [str(tmp_path / "a.txt"), "--out", str(tmp_path / "t.bin"), "--tokenizer", "tiktoken:gpt2"],
    ):
        done = cli(*args, env=env)
        assert done.returncode == 2, done
        assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr
    assert sorted(os.listdir(tmp_path)) == ["a.txt"]
