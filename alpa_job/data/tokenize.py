"""Text files -> one flat binary token file (`--dataset tokens`), streamed and written atomically.

The format (nanoGPT's and Levanter's): little-endian uint16 or uint32 token ids, no header; the file
is one stream of documents, each input file one document followed by the tokenizer's end-of-text id.
Beside it, OUT.json says what made it (tokenizer, vocab_size, dtype, counts).

Memory stays bounded by the chunk size, whatever the corpus: a file is read and encoded in chunks cut
only where no token of the tokenizer's split pattern can straddle the cut (see `_cut_point`), so the
ids are the same as encoding the whole file at once.
"""

from __future__ import annotations

import glob
import os
import time
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

from alpa_job.progress.events import Progress
from alpa_job.data.tokenizer import Tokenizer, load_tokenizer
from alpa_job.errors import KitError
from alpa_job import strict_json

DTYPES = ("uint16", "uint32")
FORMAT = "flat little-endian token ids, no header; each document followed by eot (null: none)"
CHUNK_BYTES = 1 << 20  # text encoded per call; tiktoken encodes a batch of them on several threads
BATCH_CHUNKS = 32
PROGRESS_EVERY_S = 2.0
_BOM = "\ufeff"


def sidecar_path(out: str) -> str:
    return out + ".json"


def expand_inputs(inputs: List[str]) -> List[str]:
    """Files to read, in order: a glob's matches sorted, a folder's *.txt sorted, a file as given."""
    files: List[str] = []
    for item in inputs:
        if glob.has_magic(item):
            matches = sorted(m for m in glob.glob(item, recursive=True) if os.path.isfile(m))
            if not matches:
                raise KitError(f"no file matches {item!r}; check the pattern (quote it so the shell leaves it to us)")
            files += matches
        elif os.path.isdir(item):
            texts = sorted(os.path.join(item, n) for n in os.listdir(item) if n.endswith(".txt") and os.path.isfile(os.path.join(item, n)))
            if not texts:
                raise KitError(f"folder {item} holds no *.txt file; pass the files (or a glob) to tokenize")
            files += texts
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise KitError(f"input {item} does not exist; pass text files, folders of *.txt or a quoted glob")
    if not files:
        raise KitError("no input given; pass text files, folders of *.txt or a quoted glob")
    return files


def choose_dtype(vocab_size: int, dtype: Optional[str]) -> str:
    """uint16 when every id fits it, else uint32; an explicit uint16 too small for the vocabulary is an error."""
    if dtype is None:
        return "uint16" if vocab_size <= 1 << 16 else "uint32"
    if dtype not in DTYPES:
        raise KitError(f"--token-dtype {dtype!r} is not known; use uint16 or uint32")
    if dtype == "uint16" and vocab_size > 1 << 16:
        raise KitError(
            f"--token-dtype uint16 holds ids below 65536, but the vocabulary has {vocab_size:,}; use --token-dtype uint32 (or leave it out)"
        )
    return dtype


def tokenize_files(
    inputs: List[str],
    out: str,
    tokenizer: str = "bytes",
    dtype: Optional[str] = None,
    eot: bool = True,
    progress: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
) -> Dict:
    """Encode `inputs` (files, folders, globs) into `out` and its sidecar; returns the sidecar's numbers.
    Nothing appears under `out` unless every file was encoded."""
    files = expand_inputs(inputs)
    coder = load_tokenizer(tokenizer)
    dtype = choose_dtype(coder.vocab_size, dtype)
    partial = f"{out}.{os.getpid()}.partial"  # beside `out`: the rename that publishes it stays on one filesystem
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        sink = open(partial, "xb")
    except OSError as err:
        raise KitError(f"cannot write {out} ({err.strerror}); pass --out in a writable folder") from None
    try:
        with sink:
            counts = _encode_all(files, coder, np.dtype(dtype).newbyteorder("<"), eot, sink, progress, chunk_bytes)
        if counts["tokens"] == 0:
            raise KitError(f"the inputs hold no text ({len(files)} empty file(s)); pass files with text")
        summary = dict(
            format=FORMAT,
            tokenizer=coder.name,
            vocab_size=coder.vocab_size,
            dtype=dtype,
            eot=coder.eot if eot else None,
            files=len(files),
            documents=counts["documents"],
            tokens=counts["tokens"],
            bytes=counts["tokens"] * np.dtype(dtype).itemsize,
            text_bytes=counts["text_bytes"],
            max_id=counts["max_id"],
        )
        _publish(partial, out, summary)
    except BaseException:
        _remove(partial)
        raise
    return summary


def _encode_all(files: List[str], coder: Tokenizer, dtype: np.dtype, eot: bool, sink, progress: bool, chunk_bytes: int) -> Dict:
    counts = dict(documents=0, tokens=0, text_bytes=0, max_id=-1)
    shown = _Shown(len(files)) if progress else None
    end = np.asarray([coder.eot], dtype) if eot and coder.eot is not None else None
    for number, path in enumerate(files, 1):
        before = counts["tokens"]
        for texts, size in _batches(path, chunk_bytes):
            for ids in coder.encode_batch(texts):
                _write(np.asarray(ids), dtype, sink, counts)
            counts["text_bytes"] += size
            if shown is not None:
                shown.maybe(number - 1, counts)
        if counts["tokens"] > before:
            counts["documents"] += 1
            if end is not None:
                _write(end, dtype, sink, counts)
    if shown is not None:
        shown.maybe(len(files), counts, last=True)
    counts["max_id"] = counts["max_id"] if counts["max_id"] >= 0 else None
    return counts


def _write(ids: np.ndarray, dtype: np.dtype, sink, counts: Dict) -> None:
    if ids.size == 0:
        return
    counts["max_id"] = max(counts["max_id"], int(ids.max()))
    sink.write(ids.astype(dtype, copy=False).tobytes())
    counts["tokens"] += int(ids.size)


def _publish(partial: str, out: str, summary: Dict) -> None:
    """The finished file under its name, then its sidecar. The old sidecar goes first: a run killed
    in between leaves a file without a sidecar, never one beside another file's numbers."""
    side = sidecar_path(out)
    side_partial = side + ".partial"
    with open(side_partial, "w") as handle:
        strict_json.dump(summary, handle, indent=1)
        handle.write("\n")
    try:
        _remove(side)
        os.replace(partial, out)
        os.replace(side_partial, side)
    except BaseException:
        _remove(side_partial)
        raise


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# ============================================================================ reading text in chunks
def _batches(path: str, chunk_bytes: int) -> Iterator[Tuple[List[str], int]]:
    """(texts, their UTF-8 size): up to BATCH_CHUNKS chunks of `path` at a time."""
    texts: List[str] = []
    size = 0
    for text, raw in _chunks(path, chunk_bytes):
        texts.append(text)
        size += raw
        if len(texts) == BATCH_CHUNKS:
            yield texts, size
            texts, size = [], 0
    if texts:
        yield texts, size


def _chunks(path: str, chunk_bytes: int) -> Iterator[Tuple[str, int]]:
    """(text, its size in bytes) of about `chunk_bytes` each, cut by `_cut_point`; a stretch with no
    such point is read on until one comes (the end of the file always is one)."""
    offset = 0  # of `pending`'s first byte in the file, for error messages
    pending = b""
    scanned = 0  # `pending` before this has no cut point
    try:
        with open(path, "rb") as handle:
            while True:
                block = handle.read(chunk_bytes)
                pending += block
                cut = len(pending) if not block else _cut_point(pending, scanned)
                if cut:
                    text = _decode(pending[:cut], path, offset)
                    if offset == 0 and text.startswith(_BOM):
                        text = text[1:]  # it marks the encoding; it is not text
                    yield text, cut
                    offset += cut
                    pending = pending[cut:]
                scanned = max(0, len(pending) - 1)
                if not block:
                    return
    except OSError as err:
        raise KitError(f"cannot read {path} ({err.strerror}); check the file") from None


def _decode(raw: bytes, path: str, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise KitError(
            f"{path} is not UTF-8 text: byte {offset + err.start} is 0x{raw[err.start]:02x}; convert it (iconv -t UTF-8) or leave it out"
        ) from None


def _cut_point(data: bytes, start: int) -> int:
    """The last place in data[start:] where text can be cut without changing a token, else 0.

    BPE tokenizers first split text with a pattern (GPT-2's, tiktoken's cl100k and o200k) whose
    pieces are a run of letters or digits (perhaps after one other character), a run of punctuation
    (perhaps with newlines after it), or a run of whitespace. No piece holds a letter or digit and the
    newline right after it, nor a newline and the letter or digit right after it when no whitespace
    comes before the newline: cut there. Cutting at any newline instead would split runs like
    "\\n    " (indented text) or " \\n" into other tokens than the whole file gives.
    """
    at = len(data)
    while True:
        at = data.rfind(b"\n", start, at)
        if at <= 0:
            return 0
        before = _char_before(data, at)
        if before.isalnum():
            return at
        if not before.isspace() and _char_at(data, at + 1).isalnum():
            return at + 1


def _char_before(data: bytes, end: int) -> str:
    start = end - 1
    while start > 0 and end - start < 4 and data[start] & 0xC0 == 0x80:  # UTF-8 continuation bytes
        start -= 1
    return data[start:end].decode("utf-8", errors="replace")[-1:]


def _char_at(data: bytes, start: int) -> str:
    return data[start : start + 4].decode("utf-8", errors="replace")[:1]


# ============================================================================ progress
class _Shown:
    """A progress line at most every PROGRESS_EVERY_S: small inputs finish before the first."""

    def __init__(self, total: int):
        self.total = total
        self.bar: Optional[Progress] = None
        self.files_done = 0
        self.last = time.perf_counter()

    def maybe(self, files_done: int, counts: Dict, last: bool = False) -> None:
        now = time.perf_counter()
        if now - self.last < PROGRESS_EVERY_S and not (last and self.bar is not None):
            return
        if self.bar is None:
            self.bar = Progress("tokenize", self.total, unit="file")
        self.bar.update(files_done - self.files_done, tokens=f"{counts['tokens']:,}", text=f"{counts['text_bytes'] / 1e6:,.1f}MB")
        self.files_done = files_done
        self.last = now
