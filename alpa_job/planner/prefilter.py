"""The plan as `--strategy auto`'s first pass: drop the candidates that cannot fit a GPU or are predicted
more than SLOWER_THAN_BEST x the best, before anything compiles on the GPUs.

`drop_candidates` compiles the candidates on emulated CPU devices in a worker process (nothing touches
the GPUs of the calling process) and estimates each one for the cluster it names.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple, Union

from alpa_job.planner import estimate, gpus
from alpa_job.planner.calibrate import plan_values
from alpa_job.planner.plan import DEFAULT_NETWORK_GBPS, model_values
from alpa_job.planner.run_worker import compile_in_worker

SLOWER_THAN_BEST = 1.5

Candidate = Tuple[str, Tuple[int, int]]


def drop_candidates(
    config,
    model,
    example_batch: Dict[str, Any],
    candidates: Sequence[Candidate],
    budget_bytes: int,
    nodes: int,
    gpus_per_node: int,
    gpu: Union[str, gpus.Gpu] = "h100",
    network_gbps: float = DEFAULT_NETWORK_GBPS,
    timeout_s: float = 1800.0,
) -> Tuple[List[Candidate], List[Dict[str, Any]]]:
    """(candidates worth compiling on the GPUs, one row {strategy, mesh_shape, note} per dropped one).
    `model` is the caller's (the worker builds the same one from `config`); `example_batch` gives the batch."""
    predictions = predict_candidates(config, model, example_batch, candidates, nodes, gpus_per_node, gpu, network_gbps, timeout_s)
    return sort_out(predictions, budget_bytes, nodes * gpus_per_node)


def predict_candidates(
    config,
    model,
    example_batch: Dict[str, Any],
    candidates: Sequence[Candidate],
    nodes: int,
    gpus_per_node: int,
    gpu: Union[str, gpus.Gpu] = "h100",
    network_gbps: float = DEFAULT_NETWORK_GBPS,
    timeout_s: float = 1800.0,
) -> List[Tuple[Candidate, Dict[str, Any]]]:
    """Each candidate with its prediction for the cluster (estimate.predict's dict), or {"error": why} where it
    does not compile: the compiling half of drop_candidates."""
    del model  # rebuilt in the worker from config: a model object does not cross a process boundary
    device = gpus.resolve(gpu) if isinstance(gpu, str) else gpu
    batch = int(len(example_batch["mask"]))
    request = {
        "preset": None,
        "config": None,
        "devices": nodes * gpus_per_node,
        "gpus_per_node": gpus_per_node,
        "candidates": [[s, list(m)] for s, m in candidates],
        "cli_values": {**model_values(config.as_dict()), **plan_values(batch)},
    }
    rows = compile_in_worker(request, timeout_s)["candidates"]
    constants = estimate.fit(estimate.load())

    def predicted(row: Dict[str, Any]) -> Dict[str, Any]:
        return row if "error" in row else estimate.predict(row, nodes * gpus_per_node, device, network_gbps * 1e9 / 8, constants)

    return [((strategy, tuple(mesh)), predicted(row)) for (strategy, mesh), row in zip(candidates, rows)]


def sort_out(
    predictions: Sequence[Tuple[Candidate, Dict[str, Any]]], budget_bytes: int, devices: int
) -> Tuple[List[Candidate], List[Dict[str, Any]]]:
    """The deciding half of drop_candidates: drop what does not compile, needs more than `budget_bytes` a
    GPU, or is predicted over SLOWER_THAN_BEST x the best."""
    predicted = {}
    dropped: List[Dict[str, Any]] = []
    for (strategy, mesh), p in predictions:
        if "error" in p:
            dropped.append(_row(strategy, mesh, f"does not compile for {devices} devices: {p['error']}"))
            continue
        if p["gpu_peak_bytes"] is not None and p["gpu_peak_bytes"] > budget_bytes:
            dropped.append(
                _row(strategy, mesh, f"planner: needs ~{p['gpu_peak_bytes'] / 1e9:.1f} GB per GPU, budget {budget_bytes / 1e9:.1f} GB")
            )
            continue
        predicted[(strategy, tuple(mesh))] = p["step_s"]
    if predicted:
        best = min(predicted.values())
        for key, step in list(predicted.items()):
            if step > SLOWER_THAN_BEST * best:
                dropped.append(
                    _row(
                        key[0], key[1], f"planner: predicted {step * 1e3:.1f} ms, over {SLOWER_THAN_BEST} x the best's {best * 1e3:.1f} ms"
                    )
                )
                del predicted[key]
    kept = [(s, tuple(m)) for (s, m), _ in predictions if (s, tuple(m)) in predicted]
    return kept, dropped


def _row(strategy: str, mesh, note: str) -> Dict[str, Any]:
    return {"strategy": strategy, "mesh_shape": list(mesh), "note": note}


def for_auto(config, model, example_batch: Dict[str, Any]):
    """`--strategy auto`'s prefilter (engines/auto_search.Prefilter) on this process's devices and cluster."""

    def drop(candidates: Sequence[Candidate], budget: int) -> List[Dict[str, Any]]:
        import jax

        from alpa_job.progress.events import phase

        gpu = gpus.DEVICE_KINDS.get(jax.devices()[0].device_kind)
        if gpu is None:
            phase(f"[auto] planner skipped: it has no figures for {jax.devices()[0].device_kind}")
            return []
        _, dropped = drop_candidates(config, model, example_batch, candidates, budget, jax.process_count(), jax.local_device_count(), gpu)
        return dropped

    return drop
