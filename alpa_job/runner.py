"""Run a job end to end: pick the engine, place the processes, train, write the report."""
from __future__ import annotations

import sys
from typing import Any, Dict, List, Tuple

from alpa_job.cluster.connect import NO_RAY, connect, resolve_address
from alpa_job.config import check_engine_strategy
from alpa_job.engines import resolve_engine
from alpa_job.errors import KitError
from alpa_job.report import build_report, write_report


def run_in_process(config, return_state: bool = False) -> Dict[str, Any]:
    """Train in this process without Ray (benchmarks, tests, machines without Ray)."""
    from alpa_job.train import ensure_cpu_devices, train_process

    if "jax" not in sys.modules:
        ensure_cpu_devices(config.devices)
    return train_process(config, return_state=return_state)


def run_job(config) -> Tuple[Dict[str, Any], Dict[str, str]]:
    engine = resolve_engine(config.engine)
    check_engine_strategy(engine, config.strategy)
    address = resolve_address(config.address)
    results: List[Dict[str, Any]]
    if engine == "alpa":
        if address == NO_RAY:
            raise KitError("--engine alpa needs Ray (Alpa places its meshes with Ray); drop --address none")
        from alpa_job.engines.alpa_engine import run_alpa

        results = [run_alpa(config, address)]
    elif address == NO_RAY:
        results = [run_in_process(config)]
    else:
        where = connect(address, engine)
        print(f"[alpa_job] joined {where}", file=sys.stderr, flush=True)
        from alpa_job.cluster.processes import run_on_nodes

        results = run_on_nodes(config)
    report = build_report(config, results, address=address)
    return report, write_report(report, config.out)
