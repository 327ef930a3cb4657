"""The `--tokenizer` value -> an encoder, offline only (clusters often have no route out).

- `bytes`: UTF-8 bytes (ids 0..255) and an end-of-text id 256; no dependency.
- `tiktoken:NAME` (`tiktoken:gpt2`): tiktoken's named encoding, from tiktoken's cache only. tiktoken
  would download a missing file (and wait on the network as long as the network lets it); here a
  missing file is one line saying how to fill the cache instead.
- `PATH.tiktoken`: a local BPE ranks file (one `BASE64TOKEN RANK` per line), with GPT-2's split
  pattern and `<|endoftext|>` after the last rank: real BPE with nothing to fetch.

tiktoken is imported only when one of its tokenizers is asked for.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import functools
import hashlib
import os
import tempfile
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from alpa_job.choices import did_you_mean
from alpa_job.errors import KitError

ENDOFTEXT = "<|endoftext|>"
# GPT-2's split pattern as tiktoken writes it (tiktoken_ext/openai_public.py, r50k_pat_str).
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
CHOICES = "bytes, tiktoken:NAME (tiktoken:gpt2) or PATH.tiktoken (a local BPE ranks file)"


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    name: str  # the --tokenizer value, kept in the output's sidecar
    vocab_size: int  # every id is below it
    eot: Optional[int]  # the end-of-text id written after each document; None: the tokenizer has none
    # texts -> their ids, special-token text encoded as plain text (the converter alone marks document ends)
    encode_batch: Callable[[List[str]], List[Sequence[int]]]

    def encode(self, text: str) -> Sequence[int]:
        return self.encode_batch([text])[0]


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer `spec` names, or a one-line KitError naming the fix."""
    if spec == "bytes":
        return Tokenizer("bytes", 257, 256, _utf8_bytes)
    if spec.startswith("tiktoken:"):
        return _tiktoken_named(spec, spec[len("tiktoken:") :])
    if spec.endswith(".tiktoken"):
        return _tiktoken_file(spec)
    raise KitError(f"unknown tokenizer {spec!r}{did_you_mean(spec, ['bytes', 'tiktoken:gpt2'])}; use {CHOICES}")


def _utf8_bytes(texts: List[str]) -> List[np.ndarray]:
    return [np.frombuffer(text.encode("utf-8"), np.uint8) for text in texts]


# ============================================================================ tiktoken
def _tiktoken_module(spec: str):
    try:
        import tiktoken
    except ImportError:
        raise KitError(f"--tokenizer {spec} needs tiktoken; pip install tiktoken (or use --tokenizer bytes)") from None
    return tiktoken


def _from_encoding(spec: str, encoding) -> Tokenizer:
    eot = encoding.encode_single_token(ENDOFTEXT) if ENDOFTEXT in encoding.special_tokens_set else None
    # encode_ordinary: an "<|endoftext|>" inside a document is text, not a document end. The batch
    # form encodes its texts on several threads (tiktoken's core releases the GIL).
    threads = max(1, min(16, os.cpu_count() or 1))
    return Tokenizer(spec, encoding.n_vocab, eot, functools.partial(encoding.encode_ordinary_batch, num_threads=threads))


def _tiktoken_named(spec: str, name: str) -> Tokenizer:
    tiktoken = _tiktoken_module(spec)
    names = tiktoken.list_encoding_names()
    if name not in names:
        raise KitError(f"tiktoken has no encoding {name!r}{did_you_mean(name, names)}; use one of: {', '.join(names)}")
    try:
        with _cache_only():
            encoding = tiktoken.get_encoding(name)
    except _NotCached as missing:
        raise KitError(_not_cached_message(name, missing.url)) from None
    return _from_encoding(spec, encoding)


class _NotCached(Exception):
    def __init__(self, url: str):
        super().__init__(url)
        self.url = url


@contextmanager
def _cache_only() -> Iterator[None]:
    """tiktoken reads its cache, else downloads through `tiktoken.load.read_file`: while this runs
    that function refuses URLs, so a missing file fails at once instead of waiting on a network that
    may never answer. Local paths still read as before."""
    import tiktoken.load as load

    real = load.read_file

    def local_only(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise _NotCached(blobpath)
        return real(blobpath)

    load.read_file = local_only
    try:
        yield
    finally:
        load.read_file = real


def _tiktoken_cache_dir() -> str:
    """Where tiktoken looks (its own rule, tiktoken/load.py read_file_cached); '' = caching off."""
    for variable in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if variable in os.environ:
            return os.environ[variable]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def _not_cached_message(name: str, url: str) -> str:
    folder = _tiktoken_cache_dir()
    where = (
        f"tiktoken's cache {folder} has no {hashlib.sha1(url.encode()).hexdigest()} (the file of {url})"
        if folder
        else "tiktoken's cache is off (TIKTOKEN_CACHE_DIR is empty)"
    )
    return (
        f"tokenizer tiktoken:{name} is not available offline: {where}; on a machine with internet run "
        f"TIKTOKEN_CACHE_DIR=DIR python -c \"import tiktoken; tiktoken.get_encoding('{name}')\", "
        f"copy DIR here and set TIKTOKEN_CACHE_DIR=DIR, or pass --tokenizer PATH.tiktoken (a local ranks file)"
    )


def _tiktoken_file(path: str) -> Tokenizer:
    tiktoken = _tiktoken_module(path)
    ranks = read_ranks(path)
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        # tiktoken's BPE starts from single bytes: text with a byte it has no rank for cannot be encoded.
        raise KitError(
            f"{path} has no rank for {len(missing)} of the 256 single bytes (first: {missing[0]}); "
            "a BPE ranks file starts with every single byte"
        )
    if len(set(ranks.values())) != len(ranks):
        raise KitError(f"{path} gives two tokens the same rank; a BPE ranks file numbers each token once")
    encoding = tiktoken.Encoding(
        os.path.basename(path)[: -len(".tiktoken")],
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: max(ranks.values()) + 1},
    )
    return _from_encoding(path, encoding)


def read_ranks(path: str) -> Dict[bytes, int]:
    """A tiktoken ranks file: `BASE64TOKEN RANK` per line. Read here rather than by
    tiktoken.load.load_tiktoken_bpe, which keeps a copy of a local file in its cache under a key made
    of the path alone and returns that copy from then on: an edited file would load stale."""
    if not os.path.isfile(path):
        raise KitError(f"tokenizer file {path} does not exist; pass a tiktoken ranks file (BASE64TOKEN RANK per line) or --tokenizer bytes")
    ranks: Dict[bytes, int] = {}
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except (ValueError, binascii.Error):
                raise KitError(
                    f"{path} line {number} is not 'BASE64TOKEN RANK' (a tiktoken ranks file); fix or regenerate the file"
                ) from None
    if not ranks:
        raise KitError(f"{path} holds no ranks; pass a tiktoken ranks file (BASE64TOKEN RANK per line)")
    return ranks
