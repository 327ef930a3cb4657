"""Run a job end to end: check everything the config allows (before Ray), resolve the engine, the
cluster spec and the address once, place the training, write the report -- also when training fails.

Every engine trains through the one loop, `train.train_process`; what differs is where it runs:
  alpa          on the driver, inside an Alpa session (alpa.parallelize drives every GPU node)
  jax, no Ray   in this process (benchmarks, tests, machines without Ray)
  jax, Ray      one JAX process per node, each a Ray actor of the worker group, driven by the job
                controller (launch/controller.py); process 0's progress reaches the driver's display
                through ProgressChannel (progress/channel.py)
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Iterable, List, Optional, Tuple

from alpa_job.progress.display import VERBOSE
from alpa_job.progress.events import display
from alpa_job.progress.ray_logs import NativeStderr, quiet_ray_loggers, ray_noise_env
from alpa_job.settings import validate
from alpa_job.train import metrics_log, rundir, trackers
from alpa_job.launch import preemption
from alpa_job.launch.connect import NO_RAY, connect, resolve_address
from alpa_job.cluster.spec import load_spec
from alpa_job.data.checks import check_data
from alpa_job.settings.config import check_engine_strategy
from alpa_job.engines import resolve_engine
from alpa_job.errors import Diverged, KitError, LostProcessError
from alpa_job.record.run_record import ProcessResult

JOIN_TIMEOUT_S = 15.0  # a wrong --address fails within this plus the TCP check's share (under 20 s in all)


def run_in_process(config, return_state: bool = False, stop=None) -> ProcessResult:
    """Train with the JAX engine in this process without Ray (benchmarks, tests, machines without Ray);
    `stop` (a train.stop.StopPoint) ends it early at a step with a checkpoint (preemption)."""
    from alpa_job.cpu_devices import ensure_cpu_devices

    ensure_cpu_devices(config.devices)  # before the loop's import: it imports jax
    from alpa_job.train.loop import train_process

    return train_process(config, return_state=return_state, stop=stop)


def run_job(config, explicit: Iterable[str] = (), capture_native: bool = False) -> Tuple[Any, dict]:
    """Train as `config` says; returns (the run record, the written report's paths).

    `explicit`: the settings the user named (flags, config file), for the inert-flag check.
    `capture_native`: send native stderr (Ray's C++ logs, raylet) to RUN_DIR/ray.log unless -v (the CLI)."""
    engine = resolve_engine(config.engine)
    check_engine_strategy(engine, config.strategy)
    spec = load_spec(config.cluster_spec)  # resolved once; everything below gets it passed down
    address = resolve_address(config.address)
    config = _resolve_model(config, engine, address)
    validate.preflight(config, engine, address, explicit)
    check_data(config, engine)
    _check_fp8_ready(config)
    trackers.check_installed(config.track)
    auto = config.resume == "auto"
    config = rundir.prepare(config, explicit_out=bool(config.out))
    shown = display()
    shown.open_log(os.path.join(config.out, "train.log"))
    shown.line(f"[alpa_job] run directory {config.out}")
    if auto:
        shown.line(
            "[alpa_job] --resume auto: "
            + (
                "resuming from the latest complete checkpoint"
                if config.resume
                else f"no complete checkpoint in {rundir.checkpoint_dir(config.out)}, starting fresh"
            )
        )
    if capture_native and shown.verbosity < VERBOSE:
        NativeStderr(os.path.join(config.out, "ray.log")).start()  # for the rest of this process
    metrics = _open_metrics(config, shown)
    try:
        with preemption.watch(can_stop=engine != "alpa"):  # the Alpa engine cannot checkpoint: SIGTERM stops at once
            results = _train(engine, config, address, spec, shown)
    except BaseException as err:
        _write_failed(config, engine, address, err, shown, metrics)
        rundir.release(config.out)
        raise
    # The report's writers are imported when a run ends, not before its first step (the HTML renderer is slow
    # to import and a run only needs it once).
    from alpa_job.inspect.write import write_report
    from alpa_job.record.report_file import build_report

    report = None
    try:
        report = build_report(config, results, address=address)
        if report.stopped_at_step is not None:
            report.status = "preempted"
            report.error = preemption.stopped_message(report.stopped_at_step, rundir.checkpoint_dir(config.out))
        report.tensorboard = metrics.tensorboard_dir if metrics is not None else None
        paths = write_report(report, config.out)
    finally:
        _finish_metrics(metrics, report, shown)
    shown.close_log()
    rundir.release(config.out)
    return report, paths


def _open_metrics(config, shown) -> Optional[metrics_log.RunMetrics]:
    """The run's metrics log (TensorBoard, --track), fed by the display's metrics events; None when off."""
    metrics = metrics_log.open_for_run(config, shown.line)
    shown.metrics = metrics
    return metrics


def _finish_metrics(metrics: Optional[metrics_log.RunMetrics], record, shown) -> None:
    """The report's numbers into the metrics log, then it is flushed and closed (`record` None: just closed)."""
    shown.metrics = None
    if metrics is None:
        return
    if record is None:
        metrics.close("failed")
        return
    from alpa_job.inspect.render import measured_network_text, stragglers_text

    # What the run measured of its network and its processes, as inspect words it (NCCL's transports too).
    if record.network_measured:
        metrics.text("network", measured_network_text(record))
    if record.stragglers:
        metrics.text("stragglers", stragglers_text(record.stragglers))
    metrics.finish(record)


def _resolve_model(config, engine: str, address: str):
    """The model's settings typed and checked here, before Ray; a model the user brings is imported and built
    too, so a wrong one is a one-line error. Its module may import jax: a run in this process gets its CPU
    devices set first (they can be set only before jax starts)."""
    from alpa_job.models import is_built_in, resolve

    brought = not is_built_in(config.model)
    if brought and address == NO_RAY and engine == "jax":
        from alpa_job.cpu_devices import ensure_cpu_devices

        ensure_cpu_devices(config.devices)
    config = resolve(config)
    _check_init_from(config)
    if brought and address != NO_RAY and engine == "jax":
        _check_model_on_abstract_shapes(config)
    return config


def _check_fp8_ready(config) -> None:
    """A built-in model without dense layers for --precision fp8, before Ray (a model you bring is checked when
    its step is traced: the engine counts the products it ran in fp8)."""
    from alpa_job.models import FP8_READY, is_built_in

    if getattr(config, "precision", "dtype") == "fp8" and is_built_in(config.model) and config.model not in FP8_READY:
        raise KitError(
            f"--precision fp8: --model {config.model} has no dense layer the kit runs in fp8 (those of "
            f"{', '.join(FP8_READY)} and of models whose layers take dot_general=alpa_job.api.dot_general "
            "do); drop --precision fp8"
        )


def _check_init_from(config) -> None:
    if getattr(config, "init_from", None):
        from alpa_job.hf.layout import check_init_from

        check_init_from(config)


def _check_model_on_abstract_shapes(config) -> None:
    """A user's model bound for Ray: the checks the engine makes when it builds (the batch field it reads,
    its loss's shape, logical axes under fsdp/tensor) run here first, so a mistake is one line before Ray
    starts rather than a failed job. Abstract shapes only, on this process's CPU: the driver of a JAX run
    on Ray never trains, so it must never take a GPU's memory."""
    import warnings

    import jax

    # With jax loaded, every fork warns; Ray then starts its daemons by fork + exec (subprocess), where
    # the child runs no JAX code before it execs, so the warning would only be noise on every local run.
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning)
    try:
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:  # a backend is up already (an in-process caller): it is used as it is
        pass
    from alpa_job.engines.model_checks import check_model
    from alpa_job.models import get_model
    from alpa_job.train.loop import prepare_data

    model = get_model(config)
    strategy = config.strategy if config.strategy != "auto" else "data"
    check_model(model, prepare_data(config, model).example, strategy)


def _write_failed(config, engine: str, address: str, err: BaseException, shown, metrics=None) -> None:
    """The report of a run that stopped part-way: status, the error, the steps done (never masks `err`);
    the metrics log gets the same and is closed."""
    status = "interrupted" if isinstance(err, KeyboardInterrupt) else "diverged" if isinstance(err, Diverged) else "failed"
    message = str(err) if isinstance(err, KitError) else (traceback.format_exception_only(type(err), err)[-1].strip() or type(err).__name__)
    record = None
    try:
        from alpa_job.inspect.write import write_report
        from alpa_job.record.report_file import failed_report, report_json

        record = failed_report(
            config,
            engine,
            status,
            message,
            shown.last_step,
            address=address,
            losses=getattr(err, "losses", None),
            restarts=getattr(err, "restarts", None),
        )
        record.tensorboard = metrics.tensorboard_dir if metrics is not None else None
        kept = _kept_report(config, shown.last_step)
        if kept:  # a resume that trained nothing: the earlier run's report still says what that run did
            with open(kept, "w") as f:
                f.write(report_json(record))
            shown.line(
                f"[alpa_job] {status} after {shown.last_step} step(s); report: {kept} (the earlier run's report.json is kept)",
                important=True,
            )
        else:
            paths = write_report(record, config.out)
            shown.line(f"[alpa_job] {status} after {shown.last_step} step(s); report: {paths['html']}", important=True)
        if address != NO_RAY and status == "failed" and not isinstance(err, LostProcessError):
            _collect_logs(config.out, shown)  # a lost process's message already names its log
    except Exception as report_err:  # noqa: BLE001 - the training error is the one to show
        shown.line(f"[alpa_job] could not write the failed run's report ({report_err})", important=True)
    finally:
        _finish_metrics(metrics, record, shown)
        shown.close()


def _kept_report(config, last_step: int) -> Optional[str]:
    """Where a failed --resume writes its report when it trained no step past its checkpoint and an earlier
    run's report.json is there: beside it (rundir.FAILED_REPORT), never over it. None: report.json as
    usual."""
    start = rundir.resume_start(config.out) if config.resume else None
    if start is None or last_step > start or not os.path.isfile(os.path.join(config.out, "report.json")):
        return None
    return os.path.join(config.out, rundir.FAILED_REPORT)


def _collect_logs(out_dir: str, shown) -> None:
    """A failed cluster run keeps every node's Ray logs beside its report, while Ray still serves them."""
    from alpa_job.cluster.control.logs import collect_job_logs  # never raises; bounded by its own deadline

    where = collect_job_logs(out_dir, deadline_s=30.0)
    if where:
        shown.line(f"[alpa_job] logs of every node collected in {where}", important=True)
    else:
        shown.line(
            "[alpa_job] Ray's log API gave no logs; collect them with "
            "`python -m alpa_job cluster logs --out DIR` (over SSH when Ray is down)",
            important=True,
        )


def _train(engine: str, config, address: str, spec, shown) -> List[ProcessResult]:
    if engine == "alpa":
        from alpa_job.engines.alpa_engine import AlpaEngine, alpa_session
        from alpa_job.train.loop import train_process

        try:
            with alpa_session(config, address, spec) as cluster:
                return [train_process(config, build_engine=AlpaEngine.factory(cluster))]
        except Exception as err:
            import ray

            if not isinstance(err, ray.exceptions.RayActorError):
                raise
            from alpa_job.launch.failures import actor_error_message  # name the lost node, not just "actor died"

            raise LostProcessError(
                actor_error_message(err) + "; the Alpa engine does not restart or checkpoint: rerun the "
                "job once the node is back (or without it)"
            ) from None
    if address == NO_RAY:
        return [run_in_process(config, stop=preemption.current().stop)]
    os.environ.update(ray_noise_env(shown.verbosity, shown.tty))
    quiet_ray_loggers(shown.verbosity)
    where = connect(address, engine, spec=spec, timeout_s=JOIN_TIMEOUT_S, log_to_driver=shown.verbosity >= VERBOSE)
    preemption.take_back_sigterm()
    shown.line(f"[alpa_job] joined {where}")
    from alpa_job.cluster import ray_api
    from alpa_job.launch.controller import run_on_nodes

    validate.check_cluster_size(config, ray_api.alive_nodes())  # the one check that needs the cluster
    return run_on_nodes(config, spec)
