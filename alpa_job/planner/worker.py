"""The plan's compiling process: `python -m alpa_job.planner.worker REQUEST.json RESULT.json`.

Started by the plan command with XLA_FLAGS naming N x G CPU devices and JAX_PLATFORMS=cpu (a device count
can only be set before jax is imported, and the command's own process may already hold jax). Each
candidate is compiled in turn with a progress line; a candidate that does not compile is a row with the
error's first line, not the end of the plan.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any, Dict

from alpa_job.progress.events import phase
from alpa_job.errors import KitError


def build(request: Dict[str, Any]):
    """(config, model, example batch) from the request's settings: the same layers `train` reads."""
    from alpa_job.models import get_model
    from alpa_job.planner.plan import job_config, load_layers
    from alpa_job.data.open import open_train

    config = job_config(load_layers(request.get("preset"), request.get("config")), request["cli_values"])
    model = get_model(config)
    return config, model, open_train(config, model)[2]


def run(request: Dict[str, Any]) -> Dict[str, Any]:
    target = request.get("target_gpu")  # compile for that GPU (gpu_target.py), else for the CPU devices
    if target:
        from alpa_job.planner import gpu_target

        gpu_target.prepare()
    import jax

    from alpa_job.planner.compile_plan import PlanEngine, compile_candidate

    if target:
        gpu_target.present_as_gpu()
        PlanEngine.target_devices = gpu_target.devices(target, request["devices"])

    config, model, example = build(request)
    found = len(jax.devices())
    if found != request["devices"]:
        raise KitError(
            f"the plan's worker sees {found} devices, not {request['devices']}; unset XLA_FLAGS and "
            "JAX_PLATFORMS in the environment and run the plan again"
        )
    candidates = request["candidates"]
    # Its share of the plan's candidates (run_worker deals them to several workers): their numbers in the plan.
    numbers, total = request.get("numbers") or list(range(1, len(candidates) + 1)), request.get("of") or len(candidates)
    out = []
    for number, (strategy, mesh_shape) in zip(numbers, candidates):
        phase(
            f"[plan] candidate {number}/{total}: {strategy} on mesh {tuple(mesh_shape)}: "
            + (f"compiling for {request['devices']} x {target} ..." if target else f"compiling for {found} emulated devices ...")
        )
        try:
            row = compile_candidate(config, model, example, strategy, tuple(mesh_shape), request["gpus_per_node"], bool(target))
            row = _as_train_would(row, config, model, example, strategy, mesh_shape, request, bool(target))
            phase(f"[plan] {number}/{total} candidate={strategy}{tuple(mesh_shape)} compile_s={row['compile_s']}")
        except Exception as err:  # noqa: BLE001 - one candidate XLA cannot compile is a row, not the plan's end
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            row = {"strategy": strategy, "mesh_shape": list(mesh_shape), "error": f"{type(err).__name__}: {first}"}
            phase(f"[plan] {number}/{total} candidate={strategy}{tuple(mesh_shape)} result=does not compile")
        out.append(row)
    return {"candidates": out, "jax": jax.__version__, "target_gpu": target}


def _as_train_would(row, config, model, example, strategy, mesh_shape, request, for_gpu: bool):
    """Under --fsdp-gather auto, a step compiled for the GPU that does not fit with XLA's placement of fsdp's
    gathers is what train would not run: it would gather per layer, so the plan compiles that instead."""
    from alpa_job import strategies
    from alpa_job.engines import layer_gather
    from alpa_job.planner.compile_plan import compile_candidate

    usable, peak = request.get("usable_bytes"), (row.get("memory") or {}).get("peak_estimate_bytes")
    if not (for_gpu and usable and peak and peak > usable and config.fsdp_gather == "auto"):
        return row
    if layer_gather.unsupported(strategies.get(strategy), model):  # as the engine decides it
        return row
    per_layer = compile_candidate(
        config.replace(fsdp_gather="layer"), model, example, strategy, tuple(mesh_shape), request["gpus_per_node"], for_gpu
    )
    per_layer["weight_gather"] = f"per layer (--fsdp-gather auto: XLA's placement needs {peak / 1e9:.1f} GB a GPU)"
    per_layer["compile_s"] = round(per_layer["compile_s"] + row["compile_s"], 2)
    return per_layer


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        request = json.load(f)
    try:
        result = run(request)
    except KitError as err:
        result = {"error": str(err)}
    except Exception as err:  # noqa: BLE001 - handed to the command, which prints one line and the log's path
        result = {"error": f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}", "traceback": traceback.format_exc()}
    with open(argv[1], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
