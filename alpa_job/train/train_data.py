"""The training input as the loop sees it: the row source, its fixed-shape epochs, the eval split,
and what the input did during the loop (the report's input numbers)."""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import numpy as np

from alpa_job.data import EpochPlan, plan_epoch
from alpa_job.data.pipeline import InputStream, Shard
from alpa_job.data.sources import RowSource
from alpa_job.record.run_record import InputRecord


@dataclasses.dataclass
class TrainData:
    """The input: the row source, how its epochs split into fixed-shape batches, the eval split."""

    source: RowSource
    epoch: EpochPlan
    batch_size: int
    remainder: str
    seed: int
    example: Dict[str, np.ndarray]  # the first global batch: the one shape every step is compiled for
    threads: int = 2
    prefetch: int = 4
    eval_source: Optional[RowSource] = None
    tokens: bool = False  # token data: evaluations report perplexity too

    def stream(self, total_steps: int, shard: Shard = Shard()) -> InputStream:
        """This process's batches of the training stream (see alpa_job.data.pipeline)."""
        return InputStream(
            self.source, self.epoch, self.batch_size, self.seed, total_steps, shard, threads=self.threads, prefetch=self.prefetch
        )

    def first(self, n: int) -> List[Dict[str, np.ndarray]]:
        whole = self.stream(n)
        return [whole.local_batch(s) for s in range(n)]

    def eval_stream(self, batches: Optional[int], shard: Shard = Shard()) -> Optional[InputStream]:
        """The eval split's first `batches` batches (all of it when None), in file order, padded and masked."""
        if self.eval_source is None:
            return None
        rows = len(self.eval_source)
        available = -(-rows // self.batch_size)
        steps = min(batches or available, available)
        plan = plan_epoch(rows, self.batch_size, "pad")
        return InputStream(
            self.eval_source, plan, self.batch_size, self.seed, steps, shard, shuffle=False, threads=self.threads, prefetch=self.prefetch
        )


def prepare_data(config, model=None) -> TrainData:
    """The dataset and its fixed-shape batches; `model` (a models.ModelSpec) makes synthetic data, decodes
    records or gives its own dataset."""
    from alpa_job.data.open import EVAL, open_source, open_train

    source, epoch, example = open_train(config, model)
    eval_source = open_source(config, EVAL, model) if getattr(config, "eval_data_path", None) else None
    return TrainData(
        source,
        epoch,
        config.batch_size,
        config.remainder,
        config.seed,
        example,
        threads=config.data_threads,
        prefetch=config.prefetch,
        eval_source=eval_source,
        tokens=config.dataset == "tokens",
    )


def input_record(
    data: TrainData, stream: InputStream, read_before: Tuple[int, int], start_step: int, total_steps: int, loop_seconds: float
) -> InputRecord:
    """What this process's input did during the loop (the rows and bytes it read itself)."""
    rows = data.source.rows_read - read_before[0]
    size = data.source.bytes_read - read_before[1]
    steps = max(total_steps - start_step, 0)
    return InputRecord(
        dataset=data.source.describe(),
        rows=len(data.source),
        steps_per_epoch=data.epoch.steps,
        epochs=round(steps / data.epoch.steps, 4),
        rows_read=rows,
        bytes_read=size,
        bytes_per_s=round(size / loop_seconds, 1) if loop_seconds else None,
        data_wait_s=round(stream.wait_s, 4),
        data_wait_per_step_s=round(stream.wait_s / steps, 6) if steps else None,
        data_wait_fraction=round(stream.wait_s / loop_seconds, 4) if loop_seconds else None,
        pipeline=stream.pipeline,
    )
