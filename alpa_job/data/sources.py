"""Row sources: random access to a dataset's rows, whatever holds them.

A source is what Grain calls a random-access data source (`len` and `[i]`), plus `read(indices)`:
many rows at once as one array per field, so a batch is one vectorised gather, not a stack of
per-row dicts. Every source counts the rows and bytes it served (the report's input numbers).
"""

from __future__ import annotations

import threading
from typing import Dict, Sequence

import numpy as np

from alpa_job.data.memory import Dataset


class RowSource:
    """Base: subclasses implement `__len__`, `_read` and `describe`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rows_read = 0
        self.bytes_read = 0

    def __len__(self) -> int:
        raise NotImplementedError

    def _read(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError

    def read(self, indices: Sequence[int]) -> Dict[str, np.ndarray]:
        """Rows `indices` (in that order): {field: array with len(indices) rows}."""
        rows = self._read(np.asarray(indices, np.int64))
        size = sum(v.nbytes for v in rows.values())
        with self._lock:  # prefetch threads read concurrently
            self.rows_read += len(indices)
            self.bytes_read += size
        return rows

    def __getitem__(self, index: int) -> Dict[str, np.ndarray]:
        return {k: v[0] for k, v in self.read([index]).items()}

    def row_spec(self) -> Dict[str, tuple]:
        """{field: (shape of one row, dtype)}, read from row 0 (not counted as read)."""
        rows = self._read(np.zeros((1,), np.int64))
        return {k: (v.shape[1:], v.dtype) for k, v in rows.items()}


class ArraysSource(RowSource):
    """A dataset held whole in memory (synthetic, CIFAR-10, an .npz file)."""

    def __init__(self, dataset: Dataset, name: str):
        super().__init__()
        self.arrays = dataset.arrays
        self.name = name
        self._len = dataset.num_samples

    def __len__(self) -> int:
        return self._len

    def _read(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
        return {k: v[indices] for k, v in self.arrays.items()}

    def describe(self) -> str:
        return f"{self.name}: {self._len} rows in memory"


class MapDatasetSource(RowSource):
    """A Grain MapDataset a model package builds itself (its `dataset(args, path, split)`)."""

    def __init__(self, dataset, name: str):
        super().__init__()
        self.dataset = dataset
        self.name = name

    def __len__(self) -> int:
        return len(self.dataset)

    def _read(self, indices: np.ndarray) -> Dict[str, np.ndarray]:
        rows = [self.dataset[int(i)] for i in indices]
        return {k: np.stack([np.asarray(r[k]) for r in rows]) for k in rows[0]}

    def describe(self) -> str:
        return f"{self.name}: the model's Grain dataset, {len(self)} rows"
