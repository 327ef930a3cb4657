"""The eval split's loss during training: every --eval-every steps and at the end."""

from __future__ import annotations

import math
from typing import Any, List, Optional

from alpa_job.data.pipeline import Shard
from alpa_job.engines.base import Engine
from alpa_job.record.run_record import EvalPoint
from alpa_job.train.train_data import TrainData


class Evaluator:
    """The eval split's loss every `--eval-every` steps and at the end (exact: sums over real rows)."""

    def __init__(self, engine: Engine, data: TrainData, config, shard: Shard):
        self.engine, self.data, self.shard = engine, data, shard
        self.every = config.eval_every
        self.batches = config.eval_batches
        self.points: List[EvalPoint] = []

    @property
    def active(self) -> bool:
        return self.data.eval_source is not None

    def due(self, step: int, last: bool) -> bool:
        return self.active and (last or (self.every and step % self.every == 0))

    def __call__(self, step: int, state: Any) -> Optional[EvalPoint]:
        stream = self.data.eval_stream(self.batches, self.shard)
        sums: List[Any] = []
        batches = 0
        for batch, _ in stream.batches(0):
            out = self.engine.eval_sums(state, self.engine.put_batch(batch))
            if out is None:  # this engine does not evaluate
                return None
            sums.extend(out)
            batches += 1
        values = self.engine.to_floats(sums)  # one host sync for every eval batch
        loss = sum(values[0::2]) / max(sum(values[1::2]), 1.0)
        perplexity = math.exp(min(loss, 700.0)) if self.data.tokens else None
        point = EvalPoint(step, round(loss, 6), round(perplexity, 4) if perplexity is not None else None, batches)
        self.points.append(point)
        return point
