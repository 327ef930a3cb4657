"""--track mlflow|wandb: the run's metrics and settings in an experiment tracker too, from the driver.

Each tracker is a `metrics_sink.MetricsSink` fed by the same events as TensorBoard (so: process 0's
numbers, one writer). Both work without a network by default:
  mlflow  MLFLOW_TRACKING_URI when set (a server, a shared store), else a local store in OUT/mlruns
          (MLflow's file store, which MLflow 3 serves only with MLFLOW_ALLOW_FILE_STORE=true: the kit
          sets it for this process; `mlflow ui --backend-store-uri OUT/mlruns` with the same variable
          shows it). Experiment: MLFLOW_EXPERIMENT_NAME, else "alpa_job"; the run is named after OUT.
  wandb   WANDB_MODE when set; else offline (files in OUT/wandb, `wandb sync` uploads them later)
          unless an API key is configured (WANDB_API_KEY, or a `wandb login` in ~/.netrc). Project:
          WANDB_PROJECT, else "alpa_job".
Neither package is a dependency of the kit: a --track whose package does not import is refused
before Ray starts (`check_installed`), naming the pip command.

Python 3.9; the trackers are imported only here, only when asked for.
"""

from __future__ import annotations

import importlib.util
import os
import time
from typing import Any, Callable, Dict, List, Optional

from alpa_job.errors import KitError
from alpa_job.train.metrics_sink import FLUSH_S, MetricsSink

EXPERIMENT = "alpa_job"  # the MLflow experiment / W&B project when the environment names none
MLFLOW_BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics (and 100 params) a call


def check_installed(track: Optional[str]) -> None:
    """Refuse a --track whose package is not installed (before Ray starts): one line naming the install."""
    if not track or track == "none":
        return
    if importlib.util.find_spec(track) is None:
        raise KitError(f"--track {track}: the {track} package is not installed here; pip install {track} (or drop --track)")


class MlflowSink(MetricsSink):
    """One MLflow run: the settings as params and settings.md, the scalars batched (a call at most every
    FLUSH_S seconds or MLFLOW_BATCH points), the status at the end."""

    name = "MLflow"

    def __init__(self, config, out: str):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses its file store without it
            uri = "file:" + os.path.abspath(os.path.join(out, "mlruns"))
        self.uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(name)
        self.run_id = self.client.create_run(experiment_id, run_name=os.path.basename(os.path.abspath(out))).info.run_id
        self.pending: List[Any] = []
        self.flushed = time.monotonic()
        self._params(config.as_dict())

    def _params(self, settings: Dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, str(v)[:6000]) for k, v in settings.items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending.extend(Metric(k, v, now, step) for k, v in values.items())
        if len(self.pending) >= MLFLOW_BATCH or time.monotonic() - self.flushed >= FLUSH_S:
            self.flush()

    def flush(self) -> None:
        while self.pending:
            batch, self.pending = self.pending[:MLFLOW_BATCH], self.pending[MLFLOW_BATCH:]
            self.client.log_batch(self.run_id, metrics=batch)
        self.flushed = time.monotonic()

    def text(self, name: str, body: str) -> None:
        self.client.log_text(self.run_id, body, f"{name}.md")

    def close(self, status: str = "ok") -> None:
        self.flush()
        state = {"ok": "FINISHED", "interrupted": "KILLED", "preempted": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, state)


class WandbSink(MetricsSink):
    """One W&B run (offline unless a key is configured): the settings as its config, scalars by step."""

    name = "W&B"

    def __init__(self, config, out: str):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if _wandb_key() else "offline")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or EXPERIMENT,
            dir=out,
            mode=mode,
            name=os.path.basename(os.path.abspath(out)),
            config=config.as_dict(),
        )
        self.step = -1  # W&B takes steps in order only: an earlier one (after a restart) is left out

    def scalars(self, step: int, values: Dict[str, float]) -> None:
        if step >= self.step:
            self.run.log(dict(values), step=step)
            self.step = step

    def text(self, name: str, body: str) -> None:
        self.run.summary[name] = body

    def close(self, status: str = "ok") -> None:
        self.run.finish(exit_code=0 if status == "ok" else 1)


def _wandb_key() -> bool:
    """An API key is configured: the environment's, or `wandb login`'s entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


SINKS = {"mlflow": MlflowSink, "wandb": WandbSink}


def open_tracker(track: str, config, say: Callable[[str], None]) -> Optional[MetricsSink]:
    """The --track sink for this run, or None (said in one line) when the tracker cannot start: the
    run trains either way."""
    try:
        return SINKS[track](config, config.out)
    except Exception as err:  # noqa: BLE001 - a tracker that cannot start never stops the training
        text = str(err).strip().splitlines()
        say(f"[alpa_job] --track {track}: could not start ({type(err).__name__}: {text[0] if text else ''}); training goes on without it")
        return None
