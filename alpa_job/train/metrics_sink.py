"""The one interface every metrics destination implements (TensorBoard, MLflow, W&B): what the run's
metrics log (metrics_log.py) calls. Python 3.9, standard library only."""

from __future__ import annotations

from typing import Dict

FLUSH_S = 10  # a destination's points reach its store at least this often (and at the end)


class MetricsSink:
    """Where the run's numbers go. `scalars` at a global step, `text` a Markdown page (the settings, the
    status), `close` flushes and ends it with the run's status (ok, failed, diverged, preempted, ...)."""

    name = "metrics"

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        raise NotImplementedError

    def text(self, name: str, body: str) -> None:
        raise NotImplementedError

    def close(self, status: str = "ok") -> None:
        raise NotImplementedError
