"""Checks that run in the driver before Ray starts or is joined: fail in seconds, not after a join.

Everything that follows from the config alone is checked here: flags that would do nothing for this
engine/strategy/model ("inert": an error, so a typo'd experiment never runs silently as another), the
dataset and the batch against it, the data-parallel size the run will have and the batch's divisibility
by it, the tensor mesh. No jax, no ray, no dataset loading: the whole pass takes milliseconds.

The only fact not known before a cluster join is how many nodes (and GPUs) it has; `check_cluster_size`
runs right after the join with the alive nodes, before any actor starts.
"""

from __future__ import annotations

import os
from typing import Any, FrozenSet, Iterable, List, Optional, Tuple

from alpa_job import strategies
from alpa_job.errors import KitError
from alpa_job.settings.catalog import FILE_DATASETS
from alpa_job.settings.config import JobConfig
from alpa_job.setting import flag_of

ALPA_ONLY = ("pipeline_layers", "plan_cache")
PIPELINE_SETTINGS = ("micro_batches", "pipeline_stages", "pipeline_repeats")  # Alpa's and the JAX engine's pipelines
JAX_AUTO_ONLY = ("auto_trial_steps", "auto_rank_on", "auto_compile_workers", "memory_limit_gb")


def given_fields(config: JobConfig, explicit: Iterable[str] = ()) -> FrozenSet[str]:
    """The fields the user named (flags, --config file); a preset's or an API caller's values are not
    checked for inertness (a preset may carry settings for another engine)."""
    return frozenset(explicit)


def check_inert(config: JobConfig, engine: str, given: FrozenSet[str], address: str) -> None:
    """A flag that this engine, strategy, model or dataset never reads is an error naming why."""
    for name in sorted(given):
        why = _inert_reason(config, engine, name, address)
        if why:
            raise KitError(f"{flag_of(name)} does nothing here: {why}")


def _inert_reason(config: JobConfig, engine: str, name: str, address: str) -> Optional[str]:
    strategy = config.strategy
    if name in PIPELINE_SETTINGS and engine == "jax" and not _is_pipelined(strategy):
        what = {"micro_batches": "micro-batches", "pipeline_stages": "stage count", "pipeline_repeats": "circular schedule"}[name]
        return (
            f"it sets a pipeline's {what} and --strategy {strategy} has no stages; drop it or use --strategy "
            "pipeline (or --engine alpa's pipeshard methods)"
        )
    if name in ALPA_ONLY and engine != "alpa":
        what = {"pipeline_layers": "Alpa pipeshard-auto's layer count", "plan_cache": "Alpa pipeshard-auto's saved search"}[name]
        return f"it sets {what} and the {engine} engine has none; drop it or use --engine alpa"
    if name == "pipeline_repeats" and engine != "jax":
        return "it sets the JAX engine's circular pipeline, and Alpa schedules its own stages; drop it or use --engine jax"
    if name == "pipeline_stages" and engine == "alpa" and strategy != "pipeshard-manual":
        return f"it is read by --strategy pipeshard-manual only (this run: {strategy}); drop it or switch strategy"
    if name in ("pipeline_layers", "plan_cache") and engine == "alpa" and strategy != "pipeshard-auto":
        return f"it is read by --strategy pipeshard-auto only (this run: {strategy}); drop it or switch strategy"
    if name == "model_parallel" and (engine != "jax" or not _has_model_axis(strategy)):
        return f"it sizes the model axis of --strategy tensor (this run: {engine}/{strategy}); drop it or use --strategy tensor"
    if name == "fsdp_gather" and (engine != "jax" or not (strategy == "auto" or _gathers_layers(strategy))):
        users = "/".join(s.name for s in strategies.STRATEGIES.values() if s.gathers_layers)
        return f"it places the gathers of --strategy {users}'s split weights (this run: {engine}/{strategy}); drop it or use one of those"
    if name == "network_gbps" and (engine != "jax" or address == "none"):
        return (
            f"it tells the JAX engine's step what the network between hosts costs (this run: {engine}, --address "
            f"{address}: one host); drop it or run the JAX engine on a Ray cluster"
        )
    if name in JAX_AUTO_ONLY and (engine != "jax" or strategy != "auto"):
        return f"it tunes --strategy auto's search (this run: {engine}/{strategy}); drop it or use --strategy auto"
    if name == "data_dir" and config.dataset != "cifar10":
        return "only --dataset cifar10 reads it; drop it or add --dataset cifar10"
    if name in ("data_path", "eval_data_path") and config.dataset not in FILE_DATASETS:
        return f"--dataset {config.dataset} reads no files; drop it or add --dataset {'|'.join(FILE_DATASETS)}"
    if name == "token_dtype" and config.dataset != "tokens":
        return "only --dataset tokens reads it; drop it or add --dataset tokens"
    if name == "num_samples" and config.dataset != "synthetic":
        return "it sizes the synthetic dataset and --dataset cifar10 has its own size; drop it"
    if name == "processes" and address == "none":
        return "--address none trains in this one process; drop it or run on Ray (--address local/HOST:PORT)"
    if name in ("max_restarts", "restart_wait") and (engine != "jax" or address == "none"):
        return (
            "restarts replace lost JAX processes on Ray nodes (this run: "
            f"{engine}, --address {address}); drop it or run the JAX engine on Ray"
        )
    if name == "hang_timeout" and (engine != "jax" or address == "none"):
        return (
            "the watchdog is the Ray driver's, watching each JAX process's step (this run: "
            f"{engine}, --address {address}); drop it or run the JAX engine on Ray"
        )
    if name == "straggler_window" and (engine != "jax" or address == "none" or not config.straggler_every):
        return (
            "it is the straggler watch's window, which runs with several JAX processes on Ray and --straggler-every "
            f"above 0 (this run: {engine}, --address {address}, --straggler-every {config.straggler_every}); drop it"
        )
    if name == "restart_wait" and not getattr(config, "max_restarts", 0):
        return "it is how long a restart waits, and --max-restarts is 0; drop it or add --max-restarts N"
    if name == "precision" and engine != "jax":
        return "it sets the JAX engine's matmul precision; Alpa compiles its own; drop it or use --engine jax"
    if name == "init_from" and engine != "jax":
        return "the JAX engine reads Hugging Face weights; Alpa initialises its own state; drop it or use --engine jax"
    if name == "devices" and engine == "alpa":
        return "Alpa runs on the nodes' GPUs, it never emulates CPU devices; drop it"
    return None


def gpu_present() -> bool:
    """An NVIDIA device node: the in-process JAX engine then sees GPUs, not --devices CPU devices."""
    return os.path.exists("/dev/nvidia0")


def planned_devices(config: JobConfig, engine: str, address: str) -> Optional[int]:
    """The device count the run will have, when the config alone says (None: only the cluster knows)."""
    if engine != "jax" or gpu_present():
        return None
    if address == "none":
        return config.devices
    if address == "local":
        if config.processes > 1:
            raise KitError(
                f"--processes {config.processes} but a local Ray has one node; drop --processes or pass --address HOST:PORT of a cluster"
            )
        return config.devices
    return None  # a cluster: known after the join (check_cluster_size)


def _is_pipelined(strategy: str) -> bool:
    return strategy in strategies.STRATEGIES and strategies.get(strategy).pipelined


def _gathers_layers(strategy: str) -> bool:
    return strategy in strategies.STRATEGIES and strategies.get(strategy).gathers_layers


def _has_model_axis(strategy: str) -> bool:
    return strategy in strategies.STRATEGIES and strategies.get(strategy).model_axis


def check_divisibility(
    config: JobConfig, devices: int, where: str = "", rows: Optional[int] = None, devices_per_process: Optional[int] = None
) -> None:
    """The mesh the strategy builds on `devices` devices (`devices_per_process` each, default all in one),
    and the batch split over its data axis. `rows`: the dataset's size where the config alone says it (then
    only batches it can fill are suggested, and --devices it can emulate: advice that then fails is worse
    than none)."""
    if config.strategy == "auto":
        return  # the search tries every mesh and skips the ones the batch does not divide
    data = _data_size(config, devices, devices_per_process)
    processes = devices // (devices_per_process or devices)
    if _has_model_axis(config.strategy) and data % processes:  # the engine's own check, before any actor
        raise KitError(
            f"{config.strategy} with --model-parallel {config.model_parallel}: its data-parallel size {data} does not "
            f"give each of the {processes} processes its own rows of the batch; use a --model-parallel "
            f"that divides one process's {devices_per_process} devices{where}"
        )
    if _is_pipelined(config.strategy):
        _check_micro_batches(config, devices, devices_per_process, where)
    if config.batch_size % data:
        lower = config.batch_size // data * data
        near = [b for b in (lower, lower + data) if b > 0 and (rows is None or b <= rows)]
        if near:  # only batches the dataset can fill are suggested
            advice = f"use a multiple of {data} (--batch-size {' or '.join(map(str, near))})"
        else:
            fewer = next(d for d in range(devices, 0, -1) if _divides_batch(config, d))
            advice = (
                f"no multiple of {data} fits the dataset's {rows} samples; use --devices {fewer} (its data-parallel size divides the batch)"
            )
        strategies.check_batch_split(config.batch_size, data, advice, where)


def _check_micro_batches(config: JobConfig, devices: int, devices_per_process: Optional[int], where: str) -> None:
    mesh = strategies.get(config.strategy).mesh_shape(devices, 0, devices_per_process, config.pipeline_stages)
    strategies.check_micro_batches(config.batch_size, mesh, strategies.micro_batches(config.micro_batches, mesh[0]), where)


def _data_size(config: JobConfig, devices: int, devices_per_process: Optional[int] = None) -> int:
    return strategies.data_axis_size(config.strategy, devices, config.model_parallel, devices_per_process)


def _divides_batch(config: JobConfig, devices: int) -> bool:
    try:
        return config.batch_size % _data_size(config, devices) == 0
    except KitError:  # --model-parallel does not divide this many devices
        return False


# Emulated CPU devices: each is a device of XLA's CPU client with its own buffers (~25 MB of host memory
# each for the tutorial MLP) and every step runs on all of them, so past a few per core a run only
# thrashes (1,000 on 2 cores: 90 s for 2 steps). 16 per core, never fewer than 64 (a laptop still emulates
# a large mesh).
DEVICES_PER_CORE = 16
MIN_DEVICE_CAP = 64


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_emulated_devices(devices: int, cores: int, where: str = "this host") -> None:
    """Refuse more emulated CPU devices than `cores` cores can run."""
    cap = max(MIN_DEVICE_CAP, DEVICES_PER_CORE * cores)
    if devices > cap:
        raise KitError(
            f"--devices {devices} is more CPU devices than {where} can emulate: {cores} core(s) run at "
            f"most {cap} ({DEVICES_PER_CORE} a core, at least {MIN_DEVICE_CAP}; each is a full device "
            f"with its own buffers and every step runs on all of them); use --devices {cap} or fewer, "
            "or GPUs"
        )


def parse_profile(text: Optional[str]) -> Optional[Tuple[int, int]]:
    """'START:COUNT' -> (start, count): trace steps start..start+count-1 (global steps, 1 is the first)."""
    if text is None:
        return None
    start, sep, count = str(text).partition(":")
    if not sep or not start.strip().isdigit() or not count.strip().isdigit() or int(count) < 1 or int(start) < 1:
        raise KitError(
            f"--profile {text!r} is not START:COUNT; give the first step to trace (1 or more) and how "
            "many, e.g. --profile 10:3 (start after the first steps: they are compile and warm-up)"
        )
    return int(start), int(count)


def preflight(config: JobConfig, engine: str, address: str, explicit: Iterable[str] = ()) -> Optional[int]:
    """Every check the job's settings allow, before Ray; returns the planned device count (None: the
    cluster's). The model's and the data's checks run where the model is resolved (the launcher)."""
    check_inert(config, engine, given_fields(config, explicit), address)
    if engine == "alpa":
        if address == "none":
            raise KitError("--engine alpa needs Ray (Alpa places its meshes with Ray); drop --address none")
        if config.checkpoint_every or config.resume:
            raise KitError(
                "--checkpoint-every/--resume: the alpa engine does not checkpoint (its state lives in "
                "Alpa's distributed arrays); drop the flags or use --engine jax"
            )
        if config.micro_batches and config.batch_size % config.micro_batches:
            raise KitError(
                f"--batch-size {config.batch_size} is not divisible by --micro-batches "
                f"{config.micro_batches}; use a multiple of {config.micro_batches}"
            )
    parse_profile(config.profile)
    if getattr(config, "precision", "dtype") == "fp8" and config.dtype != "bfloat16":
        raise KitError(
            f"--precision fp8 runs the dense products in fp8 and the rest of the step in bf16; --dtype is "
            f"{config.dtype}: add --dtype bfloat16"
        )
    if config.profile and engine == "alpa":
        raise KitError("--profile traces the jax engine's steps; Alpa has its own (ALPA_PROF); drop it or use --engine jax")
    devices = planned_devices(config, engine, address)
    if devices is not None:
        check_emulated_devices(devices, host_cores())
        where = f"; the run has {devices} emulated CPU devices (--devices)"
        rows = config.num_samples if config.dataset == "synthetic" and config.remainder == "drop" else None
        check_divisibility(config, devices, where, rows=rows)
    return devices


def check_cluster_size(config: JobConfig, nodes: List[Any]) -> None:
    """After a join, before any actor: the run's device count from the alive nodes (ray_api.RayNode)."""
    usable = [n for n in nodes if n.cpus() >= 1]
    count = config.processes or len(usable)
    if count > len(usable):
        raise KitError(
            f"--processes {count} but only {len(usable)} alive Ray nodes have a free CPU; use --processes {len(usable)} or add nodes"
        )
    if not usable:
        return
    chosen = usable[:count]
    for node in chosen:
        if not int(node.gpus()):
            check_emulated_devices(config.devices, int(node.cpus()), f"node {node.ip}")
    per_node = [int(n.gpus()) or config.devices for n in chosen]
    check_divisibility(
        config, sum(per_node), f"; the cluster gives {count} node(s) x {per_node[0]} devices", devices_per_process=per_node[0]
    )
