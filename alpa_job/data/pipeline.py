"""The input pipeline: a row source -> this process's share of fixed-shape global batches, prefetched.

Global step s is epoch s // steps_per_epoch, batch s % steps_per_epoch; its rows are positions
[b * B, (b + 1) * B) of the epoch's order (`batching.epoch_order`, fixed by seed and epoch alone).
Process p of P reads only positions [b * B + p * B/P, b * B + (p + 1) * B/P): the global sample order
never depends on the process count, so a run resumed on fewer hosts sees the same batches.

Underneath is Grain: a `MapDataset` over global steps whose element is this process's batch, turned
into an iterator with background read threads and a prefetch buffer (so the step rarely waits),
whose state (`get_state` / `set_state`) is the position in that stream and is saved with every
checkpoint. Where Grain is not installed (the Alpa image's Python 3.9) the same batches come from a
plain iterator in the training thread (`pipeline` says which).
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import threading
import time
from typing import Any, Dict, Iterator, Optional, Tuple

import numpy as np

from alpa_job.data.batching import EpochPlan, epoch_order, fixed_shape
from alpa_job.data.sources import RowSource
from alpa_job.errors import KitError

# A folder: every process appends the source rows it reads for each step to a JSON-lines file there,
# to check on a real cluster which rows each host read (debugging; off by default).
TRACE_ENV = "ALPA_JOB_INPUT_TRACE"


@dataclasses.dataclass(frozen=True)
class Shard:
    """Which slice of every global batch this process reads."""

    index: int = 0
    count: int = 1


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """Everything that fixes the stream's content: the checkpoint keeps it to refuse a resume over other data."""

    rows: int
    batch_size: int
    steps_per_epoch: int
    seed: int
    shuffle: bool

    def fingerprint(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


class InputStream:
    """This process's batches for global steps [0, total_steps): iterate with `batches(start_step)`."""

    def __init__(
        self,
        source: RowSource,
        epoch: EpochPlan,
        batch_size: int,
        seed: int,
        total_steps: int,
        shard: Shard = Shard(),
        shuffle: bool = True,
        threads: int = 2,
        prefetch: int = 4,
    ):
        if batch_size % shard.count:
            raise KitError(f"--batch-size {batch_size} does not split over {shard.count} processes; use a multiple of {shard.count}")
        self.source, self.epoch, self.shard = source, epoch, shard
        self.spec = StreamSpec(len(source), batch_size, epoch.steps, seed, shuffle)
        self.total_steps = total_steps
        self.local_rows = batch_size // shard.count
        self.threads, self.prefetch = threads, prefetch
        self._orders: Dict[int, np.ndarray] = {}
        self._orders_lock = threading.Lock()
        self._row_shapes: Optional[Dict[str, tuple]] = None  # an all-padding slice's field shapes, read once
        self.pipeline = "grain" if _grain() is not None else "in-memory"
        self.wait_s = 0.0

    # ----- what one step reads ------------------------------------------------------------------
    def real_rows(self, step: int) -> int:
        """Real (unpadded) rows of global step `step`'s whole batch."""
        b = step % self.spec.steps_per_epoch
        return min(self.spec.batch_size, self.spec.rows - b * self.spec.batch_size)

    def local_batch(self, step: int) -> Dict[str, np.ndarray]:
        """This process's rows of global step `step`, padded and masked to the fixed local shape."""
        epoch, b = divmod(step, self.spec.steps_per_epoch)
        first = b * self.spec.batch_size + self.shard.index * self.local_rows
        last = min(first + self.local_rows, self.spec.rows)
        positions = np.arange(first, max(first, last))
        indices = self._order(epoch)[positions] if self.spec.shuffle else positions
        self._trace(step, indices)
        if len(indices):
            rows = self.source.read(indices)
        else:  # this process's slice of a padded last batch is all padding
            rows = {k: np.zeros((0,) + shape, dtype) for k, (shape, dtype) in self._row_spec().items()}
        return fixed_shape(rows, self.local_rows, len(indices))

    def _trace(self, step: int, indices: np.ndarray) -> None:
        folder = os.environ.get(TRACE_ENV)
        if not folder or not self.spec.shuffle:  # the eval split is not traced
            return
        line = json.dumps(
            {
                "step": step,
                "process": self.shard.index,
                "count": self.shard.count,
                "host": socket.gethostname(),
                "rows": [int(i) for i in indices],
            }
        )
        path = os.path.join(folder, f"input-{socket.gethostname()}-{os.getpid()}.jsonl")
        with self._orders_lock, open(path, "a") as handle:
            handle.write(line + "\n")

    def _order(self, epoch: int) -> np.ndarray:
        with self._orders_lock:  # read threads may be a step into the next epoch
            if epoch not in self._orders:
                if len(self._orders) >= 2:
                    self._orders.pop(min(self._orders))
                self._orders[epoch] = epoch_order(self.spec.rows, self.spec.seed, epoch)
            return self._orders[epoch]

    def _row_spec(self) -> Dict[str, tuple]:
        if self._row_shapes is None:
            self._row_shapes = self.source.row_spec()
        return self._row_shapes

    # ----- the stream ---------------------------------------------------------------------------
    def batches(self, start_step: int = 0) -> Iterator[Tuple[Dict[str, np.ndarray], int]]:
        """(local batch, real rows of the global batch) for steps start_step.. total_steps; the time
        the caller waits for each next batch accumulates in `wait_s`."""
        grain = _grain()
        if grain is None:
            source = (self.local_batch(s) for s in range(start_step, self.total_steps))
        else:
            dataset = grain.MapDataset.range(self.total_steps).map(self.local_batch)
            options = grain.ReadOptions(num_threads=self.threads, prefetch_buffer_size=self.prefetch)
            source = iter(dataset.to_iter_dataset(options))
            source.set_state({"next_index": start_step})
        step = start_step
        while step < self.total_steps:
            waited = time.perf_counter()
            batch = next(source)
            self.wait_s += time.perf_counter() - waited
            yield batch, self.real_rows(step)
            step += 1

    def state(self, next_step: int) -> Dict[str, Any]:
        """The stream's checkpointable state at global step `next_step` (the same on every process): Grain's
        iterator position over global steps is the step itself, so it is written from the step, not read
        from an iterator that may have handed out a prefetched batch more than the loop has stepped."""
        return {"grain": {"next_index": next_step}, "stream": self.spec.fingerprint()}

    def check_state(self, saved: Optional[Dict[str, Any]], step: int) -> None:
        """Refuse to resume a stream over other data than the checkpoint's: the batches would differ."""
        if not saved:
            return
        before = saved.get("stream", {})
        now = self.spec.fingerprint()
        changed = [f"{k} {before[k]} -> {now[k]}" for k in now if k in before and before[k] != now[k]]
        if changed:
            raise KitError(
                f"--resume: the checkpoint's data stream differs ({', '.join(changed)}); "
                "resume with the same data, --batch-size and --seed, or start a new --out"
            )
        saved_next = saved.get("grain", {}).get("next_index")
        if saved_next is not None and saved_next != step:
            raise KitError(
                f"--resume: the checkpoint's data position ({saved_next}) is not its step ({step}); "
                "the checkpoint is damaged: resume from an earlier one or start a new --out"
            )


def _grain():
    try:
        import grain

        return grain
    except ImportError:
        return None
