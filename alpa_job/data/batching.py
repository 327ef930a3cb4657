"""Fixed-shape batches: how an epoch splits, and the in-memory batcher.

Every batch the step sees has exactly `batch_size` rows and a `mask` field (1 = real sample,
0 = padding), so the compiled step never meets a new shape: a ragged last batch is either
dropped (`drop`, the default) or padded and masked out of the loss (`pad`). This is the fix for
Alpa's "automatically slicing layers with existing physical meshes is not supported" crash
(https://github.com/alpa-projects/alpa/issues/776): a new shape means a new compile, and with
Alpa's auto search a second search.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, Tuple

import numpy as np

from alpa_job.data.memory import Dataset
from alpa_job.errors import KitError


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
        raise KitError(
            f"--batch-size {batch_size} is larger than the dataset ({num_samples} samples) and "
            f"--drop-remainder drops it all; use a batch size <= {num_samples} or --pad-remainder"
        )
    return plan


def epoch_order(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """Epoch `epoch`'s row order: a permutation fixed by (seed, epoch) alone, so the global sample order
    is the same for every engine and any number of processes (4 bytes a row where that fits)."""
    order = np.random.default_rng([seed, epoch]).permutation(num_rows)
    return order.astype(np.uint32) if num_rows < 2**32 else order


def fixed_shape(rows: Dict[str, np.ndarray], size: int, real: int) -> Dict[str, np.ndarray]:
    """`real` rows padded with zeros to `size`, plus the `mask` field (1 = real row, 0 = padding)."""
    if real < size:
        pad = size - real
        rows = {k: np.concatenate([v, np.zeros((pad,) + v.shape[1:], v.dtype)]) for k, v in rows.items()}
    mask = np.zeros((size,), np.float32)
    mask[:real] = 1.0
    return {**rows, "mask": mask}


def epoch_batches(dataset: Dataset, batch_size: int, policy: str, seed: int, epoch: int) -> Iterator[Tuple[Dict[str, np.ndarray], int]]:
    """Yield (batch, real_rows) for one epoch of an in-memory dataset, in `epoch_order`."""
    plan = plan_epoch(dataset.num_samples, batch_size, policy)
    order = epoch_order(dataset.num_samples, seed, epoch)
    for step in range(plan.steps):
        idx = order[step * batch_size : (step + 1) * batch_size]
        yield fixed_shape({k: v[idx] for k, v in dataset.arrays.items()}, batch_size, len(idx)), len(idx)
