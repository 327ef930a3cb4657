"""Flat binary token files (`--dataset tokens`): the nanoGPT / Levanter convention.

A file is a header-less stream of little-endian `uint16` or `uint32` token ids. Row i of a file is
the window tokens[i * seq_len : i * seq_len + seq_len + 1]: consecutive windows share one token, so
every token but the first is a target once. Windows never cross files.

Files are memory-mapped, never read whole. After a window is copied out, its pages are dropped from
this process's mapping (MADV_DONTNEED): the page cache keeps them, but a process that streams a
corpus larger than its memory keeps a flat resident size instead of mapping the whole file in. The
range dropped is widened to the kernel's fault-around block: a read fault maps the cached pages
around the one touched too, and dropping only the window's own pages would leave those mapped.
"""

from __future__ import annotations

import glob
import mmap
import os
from typing import Dict, List, Optional, Tuple

import numpy as np

from alpa_job.data.sources import RowSource
from alpa_job.errors import KitError

TOKEN_DTYPES = ("uint16", "uint32")
_PAGE = mmap.PAGESIZE
# Linux maps up to this many bytes of cached pages around a read fault (fault_around_bytes' default).
_FAULT_AROUND = max(65536, _PAGE)
# The vocabulary check before training reads this many tokens, spread evenly over the corpus:
# enough to catch a tokenizer/--vocab-size mismatch, cheap enough for a start-up check; in a few
# large chunks, since on a cold disk each chunk costs a seek.
VOCAB_SAMPLE_TOKENS = 1 << 20
VOCAB_SAMPLE_CHUNKS = 16


def expand_paths(pattern: str, flag: str) -> List[str]:
    """A path or a glob -> the files, sorted; a folder means every file in it."""
    if os.path.isdir(pattern):
        paths = sorted(
            os.path.join(pattern, n) for n in os.listdir(pattern) if os.path.isfile(os.path.join(pattern, n)) and not n.endswith(".json")
        )
    else:
        paths = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
    if not paths:
        what = "is an empty folder" if os.path.isdir(pattern) else ("matches no file" if glob.has_magic(pattern) else "does not exist")
        raise KitError(f"{flag} {pattern} {what}; point it at your data file(s) (a path or a quoted glob)")
    return paths


class TokenWindows(RowSource):
    """Windows of `window` tokens (seq_len + 1) over one or more token files, as field `field`."""

    def __init__(self, paths: List[str], dtype: str, window: int, field: str = "tokens", vocab_size: Optional[int] = None):
        super().__init__()
        self.paths, self.dtype, self.window, self.field = paths, np.dtype(dtype), window, field
        self.vocab_size = vocab_size
        self._maps: List[Tuple[mmap.mmap, np.ndarray]] = []
        counts = []
        for path in paths:
            tokens = token_count(path, self.dtype)
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if tokens else None
            view = np.frombuffer(mapped, self.dtype) if mapped is not None else np.zeros((0,), self.dtype)
            self._maps.append((mapped, view))
            counts.append(max(tokens - 1, 0) // (window - 1))
        self.windows_per_file = np.asarray(counts, np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self.windows_per_file)])
        self.tokens = sum(len(view) for _, view in self._maps)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def describe(self) -> str:
        return f"tokens: {len(self.paths)} file(s), {self.tokens:,} {self.dtype.name} tokens, {len(self):,} windows of {self.window}"

    def locate(self, index: int) -> Tuple[str, int]:
        """(file, token offset) of window `index`: where a bad id is named."""
        f = int(np.searchsorted(self._starts, index, side="right") - 1)
        return self.paths[f], (index - int(self._starts[f])) * (self.window - 1)

    def _read(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
        out = np.empty((len(indices), self.window), np.int32)
        files = np.searchsorted(self._starts, indices, side="right") - 1
        step = self.window - 1
        for row, (index, f) in enumerate(zip(indices, files)):
            mapped, view = self._maps[f]
            start = (int(index) - int(self._starts[f])) * step
            out[row] = view[start : start + self.window]
            _drop_pages(mapped, start * self.dtype.itemsize, self.window * self.dtype.itemsize)
        if self.vocab_size is not None and len(out):
            self._check_ids(out, indices)
        return {self.field: out}

    def _check_ids(self, rows: np.ndarray, indices: np.ndarray) -> None:
        """An id outside the embedding would be clamped silently by the gather: stop with its place."""
        top = int(rows.max())
        if top >= self.vocab_size:
            row = int(np.argmax(rows.max(axis=1)))
            path, offset = self.locate(int(indices[row]))
            raise KitError(
                f"{path}: token id {top} near token {offset} is >= --vocab-size {self.vocab_size}; "
                "raise --vocab-size to the tokenizer's vocabulary or re-tokenize"
            )

    def sample_max_id(self, budget: int = VOCAB_SAMPLE_TOKENS) -> int:
        """The largest id in `budget` tokens read at evenly spaced places (start-up: no full scan)."""
        top = 0
        chunk = max(budget // VOCAB_SAMPLE_CHUNKS, 4096)
        for mapped, view in self._maps:
            if not len(view):
                continue
            share = max(budget * len(view) // max(self.tokens, 1), chunk)
            places = max(share // chunk, 1)
            for start in np.linspace(0, max(len(view) - chunk, 0), places).astype(np.int64):
                top = max(top, int(view[start : start + chunk].max()))
                _drop_pages(mapped, int(start) * self.dtype.itemsize, chunk * self.dtype.itemsize)
        return top


def token_count(path: str, dtype: np.dtype) -> int:
    """Tokens in a file, refusing a size that is not a whole number of `dtype` ids."""
    size = os.path.getsize(path)
    if size % dtype.itemsize:
        other = "uint16" if dtype.itemsize == 4 else "uint32"
        hint = (
            f"it is not a {dtype.name} token file (its size is not a multiple of {dtype.itemsize}); "
            f"check --token-dtype (try {other}) or re-write the file"
        )
        raise KitError(f"{path}: {size} bytes: {hint}")
    return size // dtype.itemsize


def _drop_pages(mapped: Optional[mmap.mmap], offset: int, length: int) -> None:
    if mapped is None:
        return
    start = offset - offset % _FAULT_AROUND
    end = min(-(-(offset + length) // _FAULT_AROUND) * _FAULT_AROUND, len(mapped))
    try:
        mapped.madvise(mmap.MADV_DONTNEED, start, end - start)
    except (AttributeError, OSError, ValueError):  # no madvise on this platform: the pages stay mapped
        pass
