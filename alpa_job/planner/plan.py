"""A plan, end to end: settings -> candidates -> compiled on emulated devices -> estimated -> ranked record."""

from __future__ import annotations

import datetime
import os
from typing import Any, Dict, List, Optional, Tuple

from alpa_job import strategies as strategy_records
from alpa_job.errors import KitError
from alpa_job.planner import candidates as candidates_lib, estimate, gpu_target, gpus, kernel_estimate, placement
from alpa_job.planner.calibrate import plan_values
from alpa_job.planner.run_worker import compile_in_worker
from alpa_job.planner.settings_read import COST_MODELS, MODEL_SETTINGS
from alpa_job.record.plan_record import PlanCandidate, PlanCluster, PlanCollective, PlanGpu, PlanRecord
from alpa_job.record.run_record import Leaf

# JAX's GPU client takes this share of a card by default (XLA_PYTHON_CLIENT_MEM_FRACTION); the kit's
# memory checks then keep memory_fit.FRACTION of what JAX took.
JAX_GPU_MEM_FRACTION = 0.75
DEFAULT_NETWORK_GBPS = 400.0  # one 400 Gb/s NIC per GPU (InfiniBand NDR, as in DGX H100 nodes)


def usable_bytes(gpu: gpus.Gpu) -> int:
    from alpa_job.engines.memory_fit import FRACTION

    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_GPU_MEM_FRACTION))
    return int(FRACTION * fraction * gpu.memory_bytes)


def settings(preset: Optional[str], config_path: Optional[str], cli_values: Dict[str, Any], devices: int):
    """(validated JobConfig, the values the worker rebuilds it from, how the batch was chosen)."""
    from alpa_job.models import resolve

    layers = load_layers(preset, config_path)
    given = {k: v for k, v in cli_values.items() if v is not None}
    base = job_config(layers, given)
    if "batch_size" in given:
        batch, how = base.batch_size, f"--batch-size {base.batch_size} (global)"
    else:
        batch = base.batch_size * devices
        how = f"{base.batch_size} per GPU (the settings' batch) x {devices} GPUs; --batch-size sets the global batch"
    values = {**given, **plan_values(batch)}
    # A model the user brings: its builder imported and its settings typed by its own declaration, as a
    # training run does before Ray (a wrong one is a one-line error here, and the plan records typed values).
    config = resolve(job_config(layers, values))
    values["model_args"] = dict(config.model_args)
    return config, values, how


def make_plan(
    preset: Optional[str],
    config_path: Optional[str],
    cli_values: Dict[str, Any],
    nodes: int,
    gpus_per_node: int,
    gpu: gpus.Gpu,
    network_gbps: float = DEFAULT_NETWORK_GBPS,
    strategies: Optional[Tuple[str, ...]] = None,
    model_parallel: int = 0,
    timeout_s: float = 1800.0,
    calibration: Optional[Dict[str, Any]] = None,
    network_source: Optional[str] = None,
    cost_model: str = "auto",
) -> PlanRecord:
    if nodes < 1 or gpus_per_node < 1:
        raise KitError(f"--nodes and --gpus-per-node must be >= 1, got {nodes} and {gpus_per_node}")
    if network_gbps <= 0:
        raise KitError(f"--network-gbps must be > 0, got {network_gbps}")
    devices = nodes * gpus_per_node
    config, values, batch_how = settings(preset, config_path, cli_values, devices)
    calibration = calibration or estimate.load()
    constants = estimate.fit(calibration)
    link_gpus = {e["gpu"] for e in calibration["entries"] if e["nodes"] * e["gpus_per_node"] > 1}
    kept, skipped = candidates_lib.plan_candidates(nodes, gpus_per_node, config.batch_size, strategies, config.micro_batches)
    if model_parallel:
        if devices % model_parallel:
            raise KitError(
                f"--model-parallel {model_parallel} does not divide the {nodes} x {gpus_per_node} = "
                f"{devices} devices; use a divisor of {devices}"
            )
        kept = [(s, m) for s, m in kept if not strategy_records.get(s).model_axis or m[1] == model_parallel]
    pipelined_across = nodes > 1 and any(strategy_records.get(s).pipelined for s, _ in kept)
    kernels = _kernel_model(cost_model, gpu, calibration, pipelined_across)
    usable = usable_bytes(gpu)
    request = {
        "preset": preset,
        "config": config_path,
        "devices": devices,
        "gpus_per_node": gpus_per_node,
        "candidates": [[s, list(m)] for s, m in kept],
        "cli_values": values,
        "target_gpu": gpu.name if kernels else None,
        "usable_bytes": usable,  # what fits: train's --fsdp-gather auto decides by it
    }
    result = compile_in_worker(request, timeout_s)
    network_bytes_s = network_gbps * 1e9 / 8
    rows = [_candidate(r, devices, gpus_per_node, gpu, network_bytes_s, usable, constants, kernels) for r in result["candidates"]]
    if config.fsdp_gather == "auto" and not kernels:  # compiled for CPU devices: said, not compiled again
        for row in rows:
            if row.fits is False and strategy_records.get(row.strategy).gathers_layers:
                row.note += "; train's --fsdp-gather auto gathers per layer then (plan it: --fsdp-gather layer)"
    rows += [PlanCandidate(strategy=s["strategy"], mesh_shape=s["mesh_shape"], note=s["note"]) for s in skipped]
    compiled = [r for r in rows if r.step_s is not None]
    if not compiled:
        notes = "; ".join(f"{r.strategy} {tuple(r.mesh_shape)}: {r.note}" for r in rows[:3])
        raise KitError(
            f"no candidate compiles for {devices} devices ({notes}); plan fewer devices or change the "
            "model's sizes so its dimensions divide the mesh"
        )
    best = _rank(rows)
    if best is not None:
        rows[best].params = _leaves(result["candidates"], rows[best])
    assumptions = (
        _kernel_assumptions(kernels, gpu, batch_how, config.batch_size, network_source, usable)
        if kernels
        else _flops_assumptions(gpu, constants, rows, link_gpus, batch_how, config.batch_size, network_source, usable, gpus_per_node)
    )
    if cost_model == "auto" and pipelined_across:
        why = "auto: a candidate pipelines across nodes, and such a step does not compile for the GPU in minutes"
        assumptions.insert(0, f"cost model: FLOPs ({why})")
    record_constants = {**constants.to_dict(), "cost_model": "kernels" if kernels else "flops"}
    if kernels:
        record_constants["kernel"] = kernels[1].to_dict()
    return PlanRecord(
        model=config.model,
        preset=preset,
        settings=_model_settings(config),
        cluster=PlanCluster(
            nodes,
            gpus_per_node,
            devices,
            PlanGpu(gpu.name, gpu.memory_bytes, gpu.peak_flops, gpu.nvlink_bytes_s, gpu.source, gpu.profile),
            network_bytes_s,
            usable,
        ),
        constants=record_constants,
        assumptions=assumptions,
        candidates=rows,
        best=best,
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        versions={"jax (compiling)": result.get("jax")},
    )


def _kernel_model(cost_model: str, gpu: gpus.Gpu, calibration: Dict[str, Any], pipelined_across: bool = False):
    """(rates, constants) of the kernel cost model where it is chosen or (auto) can run, else None. Auto
    leaves it out where a candidate pipelines across nodes: such a step does not compile for the GPU in
    minutes (the FLOPs model, compiled for CPU devices, ranks it with the others)."""
    if cost_model not in COST_MODELS:
        raise KitError(f"--cost-model {cost_model!r} is not one of {', '.join(COST_MODELS)}")
    if cost_model == "flops" or (cost_model == "auto" and pipelined_across):
        return None
    missing = None
    if gpu.measured is None:
        missing = f"no GPU profile for {gpu.name} (pass --gpu-profile FILE from python -m alpa_job plan calibrate)"
    elif not gpu_target.supported(gpu.name):
        missing = f"XLA cannot be told how to compile for {gpu.name} (the kit knows {', '.join(gpu_target.TARGETS)})"
    elif gpu_target.plugin() is None:
        missing = "JAX's CUDA plugin is not installed for the plan: " + gpu_target.install_hint()
    if missing:
        if cost_model == "kernels":
            raise KitError(f"--cost-model kernels cannot run: {missing}")
        return None
    rates = kernel_estimate.rates_from_profile(gpu.measured, hbm_bytes_s=gpu.hbm_bytes_s, where=gpu.profile or "")
    calibration_rates = kernel_estimate.rates_from_profile(gpus.CATALOGUE["h200"].measured) if gpus.CATALOGUE["h200"].measured else rates
    return rates, kernel_estimate.fit(calibration["entries"], calibration_rates)


def _kernel_assumptions(kernels, gpu, batch_how: str, batch: int, network_source: Optional[str], usable: int) -> List[str]:
    rates, constants = kernels
    bf16, start = rates.product("bf16")
    links = ", ".join(f"{op} {bw / 1e9:.0f} GB/s + {s * 1e6:.0f} us" for op, (bw, s) in sorted(rates.links.items()))
    return [
        f"global batch {batch}: {batch_how}",
        f"each candidate compiled for {gpu.name} GPUs (XLA's deviceless compile: the GPU's fusions, cuBLAS and cuDNN "
        "calls, collectives and buffer assignment; autotuning left at XLA's defaults); every kernel costed in the "
        "order it runs: max(FLOPs / matmul rate + start, bytes / HBM + launch), other kernels launch + bytes / HBM; "
        "an async collective hidden by the kernels between its start and its done",
        f"rates from {gpu.profile}: bf16 matmul {bf16 / 1e12:.0f} TFLOP/s + {start * 1e6:.1f} us a product (fitted to "
        f"its matmul grid) x {constants.matmul_factor:.3f}, fused attention at {constants.attention_share:.3f} of "
        f"that, HBM {rates.hbm_bytes_s / 1e9:.0f} GB/s x {constants.hbm_factor:.3f}, {rates.launch_s * 1e6:.2f} us a "
        f"kernel; collectives on NVLink: {links or 'none measured: the catalogue NVLink and 20 us each'} (the "
        f"factors fitted to the profiled kernel times of {', '.join(constants.fitted_from) or 'no run'})",
        "devices are placed node-major; each collective's nodes come from its replica groups (ring / hierarchical "
        "traffic per device); the network's time is its bytes / the network bandwidth, hidden only by kernels "
        "beside it",
        f"GPU peak memory = XLA's estimate for the program compiled for the GPU; fits = at most {usable / 1e9:.1f} GB "
        "(JAX's default share of the card x the kit's usable fraction)",
        f"GPU: {gpu.describe()}; {gpu.source}",
        network_source
        or "not verified on a multi-node GPU cluster: the network term is the model above, with the "
        "bandwidth given (--network-gbps), not measured (--network-from a doctor --network result)",
        _kernel_expected_error(kernels),
    ]


def _kernel_expected_error(kernels) -> str:
    checked = kernel_estimate.validation(*kernels, estimate.load(estimate.VALIDATION_PATH)["entries"])
    if checked["median"] is None:
        return "expected error: unknown (no validation runs with kernels)"
    return (
        f"expected error of a step time: {checked['median']:.0%} median, {checked['worst']:.0%} worst, over "
        f"{len(checked['runs'])} measured runs it was not fitted on ({', '.join(checked['models'])}; "
        "validation.json beside calibration.json)"
    )


def _flops_assumptions(
    gpu, constants, rows, link_gpus, batch_how: str, batch: int, network_source, usable: int, gpus_per_node: int
) -> List[str]:
    return [
        f"global batch {batch}: {batch_how}",
        "step = compute + NVLink time + network time: compute = "
        f"FLOPs per GPU / ({gpu.peak_flops / 1e12:.0f} TFLOP/s x efficiency {constants.efficiency:.3f}); "
        "NVLink time = factor[strategy] x NVLink bytes / NVLink bandwidth, and at least the part compute cannot "
        "hide; network time = network bytes / network bandwidth, none of it assumed hidden; bytes as the "
        "collectives run on GPUs (bf16 where XLA:CPU widened them to f32, reduce-scatters where it kept "
        "an all-reduce and a slice)",
        "factors fitted to measured multi-GPU runs: "
        + ", ".join(f"{s} {f:.3f}" for s, f in sorted(constants.comm_factor.items()))
        + f" (fitted on one-node runs; a factor < 1: they hid part of NVLink's time behind compute); "
        f"{_unfitted(rows, constants)}efficiency from the one-GPU runs",
        f"devices are placed node-major: device i on node i // {gpus_per_node}; each collective's nodes come from "
        "its replica groups in the compiled HLO (ring / hierarchical traffic per device)",
        f"GPU peak memory = state part of XLA's CPU estimate + its scratch x {constants.temp_ratio:.3f} (the GPU/CPU "
        f"scratch ratio measured on the calibration runs); fits = at most {usable / 1e9:.1f} GB "
        "(JAX's default share of the card x the kit's usable fraction)",
        f"GPU: {gpu.describe()}; {gpu.source}" + _link_basis(gpu, link_gpus),
        network_source
        or "not verified on a multi-node GPU cluster: the network term is the model above, with the "
        "bandwidth given (--network-gbps), not measured (--network-from a doctor --network result)",
        _expected_error(constants),
    ]


def _expected_error(constants: estimate.Constants) -> str:
    """How far the step times may be off: the planner's error on measured runs it was not fitted on."""
    checked = estimate.validation(constants)
    if checked["median"] is None:
        return "expected error: unknown (no validation runs)"
    hosts = sorted({run["layout"] for run in checked["runs"]})
    return (
        f"expected error of a step time: {checked['median']:.0%} median, {checked['worst']:.0%} worst, over "
        f"{len(checked['runs'])} measured GPT 24L runs across hosts ({', '.join(hosts)} GPUs, NCCL over sockets) "
        "it was not fitted on (validation.json beside calibration.json); a model or cluster unlike them may be off by more"
    )


def _link_basis(gpu: gpus.Gpu, link_gpus) -> str:
    """Where a profile's measured NVLink bandwidth differs from the figure the factors were fitted with (the
    catalogue's, of the GPUs of the multi-GPU calibration runs)."""
    basis = {gpus.CATALOGUE[g].nvlink_bytes_s for g in link_gpus if g in gpus.CATALOGUE}
    if gpu.profile is None or gpu.nvlink_bytes_s in basis or not basis:
        return ""
    return (
        f" (the factors were fitted with NVLink at {', '.join(f'{b / 1e9:.0f}' for b in sorted(basis))} GB/s, "
        f"the catalogue's: a measured {gpu.nvlink_bytes_s / 1e9:.0f} GB/s scales the link time by "
        f"{max(basis) / gpu.nvlink_bytes_s:.2f})"
    )


def _unfitted(rows: List[PlanCandidate], constants: estimate.Constants) -> str:
    """The strategies no measured run fitted a factor for: they take the median of the fitted ones."""
    names = sorted({r.strategy for r in rows} - set(constants.comm_factor))
    return f"{', '.join(names)}: no measured run yet, the median factor {constants.default_comm_factor:.3f}; " if names else ""


def _candidate(
    row: Dict[str, Any],
    devices: int,
    gpus_per_node: int,
    gpu: gpus.Gpu,
    network_bytes_s: float,
    usable: int,
    constants: estimate.Constants,
    kernels=None,
) -> PlanCandidate:
    mesh = tuple(row["mesh_shape"])
    out = PlanCandidate(
        strategy=row["strategy"],
        mesh_shape=list(mesh),
        axes=placement.node_axes(mesh, gpus_per_node, strategy_records.get(row["strategy"]).mesh_axes),
    )
    if "error" in row:
        out.note = f"does not compile for {devices} devices: {row['error']}"
        return out
    memory = row.get("memory") or {}
    if kernels and row.get("kernels"):
        k = kernel_estimate.predict(row["kernels"], kernels[0], kernels[1], network_bytes_s, gpu.nvlink_bytes_s, gpus_per_node)
        t = k["terms"]
        p = {
            "compute_s": k["kernels_s"],
            "communication_s": t["NVLink"] + t["network"],
            "step_s": k["step_s"],
            "gpu_peak_bytes": memory.get("peak_estimate_bytes"),
        }
        terms = dict(t)
    else:
        p = estimate.predict(row, devices, gpu, network_bytes_s, constants)
        terms = {"compute": p["compute_s"], "NVLink": p["nvlink_s"], "network": p["network_s"]}
    out.state_bytes_per_device = row["state_bytes_per_device"]
    out.cpu_peak_bytes = None if kernels else memory.get("peak_estimate_bytes")
    out.gpu_peak_bytes = p["gpu_peak_bytes"]
    out.flops_per_step = row["flops_per_step"]
    out.collectives = {k: PlanCollective(**v) for k, v in row["collectives"].items() if v["count"]}
    out.nvlink_bytes = sum(c.nvlink_bytes for c in out.collectives.values())
    out.network_bytes = sum(c.network_bytes for c in out.collectives.values())
    out.compute_s, out.communication_s, out.step_s = p["compute_s"], p["communication_s"], p["step_s"]
    out.dominant = max(terms, key=terms.get)  # the term a faster GPU, link or network would shorten most
    out.compile_s = row.get("compile_s")
    out.fits = out.gpu_peak_bytes is not None and out.gpu_peak_bytes <= usable
    if not out.fits:
        out.note = f"needs {out.gpu_peak_bytes / 1e9:.1f} GB per GPU, {usable / 1e9:.1f} GB usable"
    if row.get("weight_gather"):
        out.note = "; ".join(filter(None, [row["weight_gather"], out.note]))
    if not row.get("groups_read", True):
        out.note = (out.note + "; " if out.note else "") + "some replica groups unreadable: assumed to span all devices"
    return out


def _rank(rows: List[PlanCandidate]) -> Optional[int]:
    fitting = sorted((i for i, r in enumerate(rows) if r.fits and r.step_s is not None), key=lambda i: rows[i].step_s)
    for rank, i in enumerate(fitting, 1):
        rows[i].rank = rank
    return fitting[0] if fitting else None


def _leaves(compiled: List[Dict[str, Any]], row: PlanCandidate) -> List[Leaf]:
    for r in compiled:
        if r["strategy"] == row.strategy and list(r["mesh_shape"]) == row.mesh_shape:
            return [Leaf(**leaf) for leaf in r.get("params") or []]
    return []


def load_layers(preset: Optional[str], config_path: Optional[str]):
    """The preset's and the --config file's settings, as train reads them (a built-in's sizes may stand at
    a file's top level)."""
    from alpa_job.models import size_names
    from alpa_job.settings import config as config_lib

    return config_lib.load_layers(preset, config_path, model_keys=size_names())


def job_config(layers, values: Dict[str, Any]):
    """The job config from the file layers and the plan's values, where a built-in's size may be given by
    its own name (`num_layers`, as its flag): that is its model_args entry."""
    from alpa_job.models import size_names
    from alpa_job.settings import config as config_lib

    sizes = size_names()
    flags = {k: v for k, v in values.items() if k in sizes}
    given = {k: v for k, v in values.items() if k not in sizes}
    return config_lib.build_config(config_lib.merge_layers(layers), given, flags)


def model_values(values: Dict[str, Any]) -> Dict[str, Any]:
    """The settings that decide the model and its step (what a plan compiles): the model and its own
    settings, the batch, the dtype, a pipeline's micro-batches; plain values (JSON), None left out."""
    from alpa_job.setting import model_args

    # model_args: a mapping (a config's), or the KEY=VALUE texts of repeated --model-arg flags
    return {
        k: (dict(model_args(v, "--model-arg")) if k == "model_args" else v)
        for k, v in values.items()
        if v is not None and k in MODEL_SETTINGS
    }


def _model_settings(config) -> Dict[str, Any]:
    return model_values(config.as_dict())
