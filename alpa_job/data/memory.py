"""Datasets held whole in memory: synthetic (from the model), CIFAR-10's python batches, .npz files."""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Dict, List

import numpy as np

from alpa_job.errors import KitError

CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))


@dataclasses.dataclass(frozen=True)
class Dataset:
    arrays: Dict[str, np.ndarray]  # every array has num_samples rows

    @property
    def num_samples(self) -> int:
        return len(next(iter(self.arrays.values())))


def synthetic(config, model=None) -> Dataset:
    """Deterministic from `seed`, and learnable, so a falling loss means the step works; each model
    says what its data looks like (its api.Model's `synthetic`)."""
    from alpa_job.models import check_synthetic, get_model

    if model is None:
        model = get_model(config)
    check_synthetic(config, model)
    arrays = model.synthetic(np.random.default_rng(config.seed), config.num_samples)
    return Dataset({k: np.asarray(v) for k, v in arrays.items()})


def cifar10_batch_files(data_dir: str) -> List[str]:
    """The CIFAR-10 training batch files present in `data_dir` (names), or a one-line error saying what to fix.
    The driver's pre-Ray check (validate.py) and the loader share it."""
    if not data_dir or not os.path.isdir(data_dir):
        raise KitError(f"--data-dir {data_dir!r} is not a folder; point it at the extracted cifar-10-batches-py folder (data_batch_1..5)")
    present = [f for f in CIFAR10_TRAIN_FILES if os.path.isfile(os.path.join(data_dir, f))]
    if not present:
        raise KitError(
            f"--data-dir {data_dir} holds no CIFAR-10 batches (expected {', '.join(CIFAR10_TRAIN_FILES)}); "
            "extract cifar-10-python.tar.gz there"
        )
    return present


def load_cifar10(data_dir: str) -> Dataset:
    """CIFAR-10 in the standard python pickle batches, from a local folder (never downloaded)."""
    present = cifar10_batch_files(data_dir)
    images, labels = [], []
    for name in present:
        path = os.path.join(data_dir, name)
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f, encoding="bytes")
            data = np.asarray(entry[b"data"], np.uint8).reshape(-1, 3, 32, 32)
            labels.append(np.asarray(entry[b"labels"], np.int32))
        except (KeyError, ValueError, pickle.UnpicklingError, EOFError) as err:
            raise KitError(f"{path} is not a CIFAR-10 python batch ({type(err).__name__}); re-extract cifar-10-python.tar.gz") from None
        images.append(data.transpose(0, 2, 3, 1))
    x = np.concatenate(images).astype(np.float32) / 255.0
    x = (x - x.mean(axis=(0, 1, 2))) / x.std(axis=(0, 1, 2))
    return Dataset({"image": x.astype(np.float32), "label": np.concatenate(labels)})


def load_npz(path: str) -> Dataset:
    """Arrays by field name from one .npz file (small supervised sets); every array needs the same rows."""
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: np.asarray(archive[name]) for name in archive.files}
    except (OSError, ValueError) as err:
        raise KitError(f"{path} is not a readable .npz file ({err}); write it with numpy.savez") from None
    if not arrays:
        raise KitError(f"{path} holds no arrays; write your fields with numpy.savez(path, x=..., y=...)")
    rows = {name: len(a) if a.ndim else 0 for name, a in arrays.items()}
    if len(set(rows.values())) != 1:
        raise KitError(f"{path}: its arrays have different row counts ({rows}); every field needs one row per example")
    return Dataset(arrays)
