"""Run a job end to end: resolve the engine, the cluster spec and the address once, place the
training, write the report.

Every engine trains through the one loop, `train.train_process`; what differs is where it runs:
  alpa          on the driver, inside an Alpa session (alpa.parallelize drives every GPU node)
  jax, no Ray   in this process (benchmarks, tests, machines without Ray)
  jax, Ray      one JAX process per node, each a Ray actor (cluster/processes.py)
"""
from __future__ import annotations

import sys
from typing import Any, List, Tuple

from alpa_job.cluster.connect import NO_RAY, connect, resolve_address
from alpa_job.cluster.spec import load_spec
from alpa_job.config import check_engine_strategy
from alpa_job.engines import resolve_engine
from alpa_job.errors import KitError
from alpa_job.inspect.record import ProcessResult
from alpa_job.report import build_report, write_report


def run_in_process(config, return_state: bool = False) -> ProcessResult:
    """Train with the JAX engine in this process without Ray (benchmarks, tests, machines without Ray)."""
    from alpa_job.train import ensure_cpu_devices, train_process

    if "jax" not in sys.modules:
        ensure_cpu_devices(config.devices)
    return train_process(config, return_state=return_state)


def run_job(config) -> Tuple[Any, dict]:
    """Train as `config` says; returns (the run record, the written report's paths)."""
    engine = resolve_engine(config.engine)
    check_engine_strategy(engine, config.strategy)
    spec = load_spec(config.cluster_spec)  # resolved once; everything below gets it passed down
    address = resolve_address(config.address)
    results = _train(engine, config, address, spec)
    report = build_report(config, results, address=address)
    return report, write_report(report, config.out)


def _train(engine: str, config, address: str, spec) -> List[ProcessResult]:
    if engine == "alpa":
        if address == NO_RAY:
            raise KitError("--engine alpa needs Ray (Alpa places its meshes with Ray); drop --address none")
        from alpa_job.engines.alpa_engine import AlpaEngine, alpa_session
        from alpa_job.train import train_process

        with alpa_session(config, address, spec) as cluster:
            return [train_process(config, build_engine=AlpaEngine.factory(cluster))]
    if address == NO_RAY:
        return [run_in_process(config)]
    where = connect(address, engine, spec=spec)
    print(f"[alpa_job] joined {where}", file=sys.stderr, flush=True)
    from alpa_job.cluster.processes import run_on_nodes

    return run_on_nodes(config, spec)
