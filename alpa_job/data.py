"""Datasets and fixed-shape batching.

Every batch the step sees has exactly `batch_size` rows and a `mask` field (1 = real sample,
0 = padding), so the compiled step never meets a new shape: a ragged last batch is either
dropped (`drop`, the default) or padded and masked out of the loss (`pad`). This is the fix for
Alpa's "automatically slicing layers with existing physical meshes is not supported" crash
(https://github.com/alpa-projects/alpa/issues/776): a new shape means a new compile, and with
Alpa's auto search a second search.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Dict, Iterator, List, Tuple

import numpy as np

from alpa_job.errors import KitError

CIFAR10_TRAIN_FILES = tuple(f"data_batch_{i}" for i in range(1, 6))


@dataclasses.dataclass(frozen=True)
class Dataset:
    arrays: Dict[str, np.ndarray]  # every array has num_samples rows

    @property
    def num_samples(self) -> int:
        return len(next(iter(self.arrays.values())))


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    """How one epoch splits into fixed-shape batches."""

    full_batches: int
    remainder: int  # samples left after the full batches
    policy: str  # "drop" or "pad"

    @property
    def steps(self) -> int:
        return self.full_batches + (1 if self.policy == "pad" and self.remainder else 0)

    @property
    def samples_dropped(self) -> int:
        return self.remainder if self.policy == "drop" else 0


def plan_epoch(num_samples: int, batch_size: int, policy: str) -> EpochPlan:
    full, rest = divmod(num_samples, batch_size)
    plan = EpochPlan(full, rest, policy)
    if plan.steps == 0:
        raise KitError(f"--batch-size {batch_size} is larger than the dataset ({num_samples} samples) and "
                       f"--drop-remainder drops it all; use a batch size <= {num_samples} or --pad-remainder")
    return plan


def epoch_batches(dataset: Dataset, batch_size: int, policy: str, seed: int, epoch: int
                  ) -> Iterator[Tuple[Dict[str, np.ndarray], int]]:
    """Yield (batch, real_rows) for one epoch, shuffled deterministically by (seed, epoch)."""
    plan = plan_epoch(dataset.num_samples, batch_size, policy)
    order = np.random.default_rng([seed, epoch]).permutation(dataset.num_samples)
    for step in range(plan.steps):
        idx = order[step * batch_size:(step + 1) * batch_size]
        real = len(idx)
        batch = {k: v[idx] for k, v in dataset.arrays.items()}
        mask = np.ones((batch_size,), np.float32)
        if real < batch_size:
            pad = batch_size - real
            batch = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in batch.items()}
            mask[real:] = 0.0
        batch["mask"] = mask
        yield batch, real


def load_dataset(config, model=None) -> Dataset:
    """The job's dataset; `model` (a models.ModelSpec, built when not given) makes the synthetic one."""
    if config.dataset == "cifar10":
        return load_cifar10(config.data_dir)
    return synthetic(config, model)


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
        raise KitError(f"--data-dir {data_dir!r} is not a folder; point it at the extracted "
                       "cifar-10-batches-py folder (data_batch_1..5)")
    present = [f for f in CIFAR10_TRAIN_FILES if os.path.isfile(os.path.join(data_dir, f))]
    if not present:
        raise KitError(f"--data-dir {data_dir} holds no CIFAR-10 batches (expected {', '.join(CIFAR10_TRAIN_FILES)}); "
                       "extract cifar-10-python.tar.gz there")
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
            raise KitError(f"{path} is not a CIFAR-10 python batch ({type(err).__name__}); "
                           "re-extract cifar-10-python.tar.gz") from None
        images.append(data.transpose(0, 2, 3, 1))
    x = np.concatenate(images).astype(np.float32) / 255.0
    x = (x - x.mean(axis=(0, 1, 2))) / x.std(axis=(0, 1, 2))
    return Dataset({"image": x.astype(np.float32), "label": np.concatenate(labels)})
