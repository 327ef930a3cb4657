"""The Alpa engine (`--engine alpa`): alpa 0.2.3 / jax 0.3.22 / flax 0.6.2 / ray 2.1.0, Python 3.9.

Runs only in the kit's Alpa image on NVIDIA GPU nodes (CUDA 11.x); every `import alpa` is inside
a function, so this module imports anywhere. The driver runs on a cluster node (`ray job submit`).

Methods (`--strategy` with --engine alpa):
  data              alpa.DataParallel()
  shard             alpa.ShardParallel()  (auto-sharding ILP)
  pipeshard-manual  alpa.PipeshardParallel(layer_option=ManualLayerOption(), stage_option=Uniform)
                    with `mark_pipeline_boundary()` placed after every k-th model layer
  pipeshard-auto    alpa.PipeshardParallel(layer_option=AutoLayerOption(layer_num),
                    stage_option=AutoStageOption) -- or, on a --plan-cache hit, ManualStageOption
The train step uses `alpa.grad`; evaluation uses `alpa.FollowParallel` on the train step's
placement; batches come from alpa_job.data (one fixed shape + mask), as in the JAX engine.
"""
from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from typing import Any, Dict, List, Optional

from alpa_job import progress, versions
from alpa_job.data import epoch_batches, load_dataset, plan_epoch
from alpa_job.engines import alpa_guards as guards
from alpa_job.engines import plan_cache as cache_lib
from alpa_job.train import loop_statistics
from alpa_job.errors import KitError

ALPA_METHODS = ("data", "shard", "pipeshard-manual", "pipeshard-auto")


# ----------------------------------------------------------------------------- pure helpers
def model_layer_count(config) -> int:
    """The model's repeated layers (what pipeline boundaries are counted in)."""
    if config.model == "mlp":
        return 4  # Dense 4h -> h -> 4h -> h
    if config.model == "gpt":
        return config.num_layers
    return 3 * ((config.depth - 4) // 6)  # wide_resnet: 3 stages x n blocks


def boundary_after(num_layers: int, num_stages: int) -> List[int]:
    """0-based layer indices after which to call mark_pipeline_boundary (num_stages - 1 of them),
    splitting num_layers as evenly as possible by count."""
    if num_stages < 1 or num_stages > num_layers:
        raise KitError(f"--pipeline-stages {num_stages} does not fit a model of {num_layers} layers; "
                       f"use 1..{num_layers}")
    return [(num_layers * s) // num_stages - 1 for s in range(1, num_stages)]


def default_stages(num_nodes: int, devices: int, num_layers: int) -> int:
    stages = num_nodes if num_nodes > 1 else 2
    while stages > 1 and (devices % stages or stages > num_layers):
        stages -= 1
    return max(stages, 1)


def method_settings(config, num_nodes: int, devices_per_node: int) -> Dict[str, Any]:
    """The parallel method as plain data (also part of the plan-cache key)."""
    strategy = config.strategy
    if strategy not in ALPA_METHODS:
        raise KitError(f"--strategy {strategy!r} is not an Alpa method; with --engine alpa use one of: "
                       f"{', '.join(ALPA_METHODS)}")
    devices = num_nodes * devices_per_node
    layers = model_layer_count(config)
    micro = config.micro_batches
    if config.batch_size % micro:
        raise KitError(f"--batch-size {config.batch_size} is not divisible by --micro-batches {micro}")
    out: Dict[str, Any] = {"strategy": strategy, "micro_batches": micro}
    if strategy == "pipeshard-manual":
        stages = config.pipeline_stages or default_stages(num_nodes, devices, layers)
        if devices % stages:
            raise KitError(f"--pipeline-stages {stages} does not divide the {devices} GPUs "
                           f"({num_nodes} node(s) x {devices_per_node}); use a divisor of {devices}")
        out.update(stages=stages, boundaries=boundary_after(layers, stages))
    elif strategy == "pipeshard-auto":
        out.update(layer_num=config.pipeline_layers or layers)
    return out


# ----------------------------------------------------------------------------- joining
def join_cluster(address: Optional[str], xla_env: Dict[str, str]) -> str:
    """ray.init for Alpa: never Ray Client; the XLA port range reaches every worker via runtime_env."""
    guards.refuse_ray_client(address)
    if address and address.startswith(("http://", "https://")):
        raise KitError(f"--address {address} is the dashboard/jobs URL; submit with `ray job submit --address "
                       f"{address} -- python -m alpa_job ...` or pass the GCS address HOST:6379")
    import ray

    if ray.is_initialized():
        return "already connected"
    env_vars = guards.ray_env_vars(xla_env)
    kwargs: Dict[str, Any] = {"runtime_env": {"env_vars": env_vars}, "namespace": "alpa_default_space",
                              "log_to_driver": True}
    if address in (None, "", "local"):
        ray.init(**kwargs)  # a single GPU machine: local Ray with its GPUs
        return "local Ray"
    ray.init(address=address, **kwargs)
    return f"Ray cluster at {address}"


# ----------------------------------------------------------------------------- the step
def _train_state_cls():
    from flax.training import train_state

    class TrainState(train_state.TrainState):
        batch_stats: Any = None

    return TrainState


def _loss_fn(model, state, batch):
    return lambda params: model.masked_loss(params, state.batch_stats, batch)


def make_train_step(model):
    import alpa

    def train_step(state, batch):
        grads, (loss, new_stats) = alpa.grad(_loss_fn(model, state, batch), has_aux=True)(state.params)
        new_state = state.apply_gradients(grads=grads)
        if model.has_batch_stats:
            new_state = new_state.replace(batch_stats=new_stats)
        return new_state, loss

    return train_step


def make_eval_step(model):
    import jax.numpy as jnp

    def eval_step(state, batch):
        variables = {"params": state.params}
        if model.has_batch_stats:
            variables["batch_stats"] = state.batch_stats
            outputs = model.module.apply(variables, batch[model.input_key], train=False)
        else:
            outputs = model.module.apply(variables, batch[model.input_key])
        per_example = model.loss(outputs, batch).astype(jnp.float32)
        return (per_example * batch["mask"]).sum(), batch["mask"].sum()

    return eval_step


def _layer_class(config):
    """The flax class whose calls are the model's layers (boundaries go after them)."""
    if config.model == "mlp":
        import flax.linen as nn

        return nn.Dense
    if config.model == "gpt":
        from alpa_job.models.gpt import DecoderBlock

        return DecoderBlock
    from alpa_job.models.wide_resnet import WideBlock

    return WideBlock


@contextlib.contextmanager
def pipeline_boundaries(layer_cls, after: List[int], num_layers: int):
    """While tracing, call alpa.mark_pipeline_boundary() after the listed layer calls.

    The model files stay engine-free: the layer class's __call__ is wrapped only for the trace.
    Calls are counted modulo the model's layer count, so a function traced more than once (layer
    construction, then compile) gets the same boundaries each time."""
    import alpa

    original = layer_cls.__call__
    marks = set(after)
    count = [0]

    def counted(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        index = count[0] % num_layers
        count[0] += 1
        if index in marks:
            alpa.mark_pipeline_boundary()
        return out

    layer_cls.__call__ = counted
    try:
        yield count
    finally:
        layer_cls.__call__ = original


def build_method(settings: Dict[str, Any], cached_plan: Optional[Dict[str, Any]] = None):
    import alpa

    strategy, micro = settings["strategy"], settings["micro_batches"]
    if strategy == "data":
        return alpa.DataParallel(num_micro_batches=micro if micro > 1 else None)
    if strategy == "shard":
        return alpa.ShardParallel(num_micro_batches=micro if micro > 1 else None)
    if strategy == "pipeshard-manual":
        return alpa.PipeshardParallel(num_micro_batches=micro, layer_option=alpa.ManualLayerOption(),
                                      stage_option=alpa.UniformStageOption(num_stages=settings["stages"]))
    layer_option = alpa.AutoLayerOption(layer_num=settings["layer_num"])
    if cached_plan is not None:
        stage_option = alpa.ManualStageOption(**cache_lib.manual_stage_kwargs(cached_plan))
    else:
        stage_option = alpa.AutoStageOption(submesh_physical_shape_space="power_of_two",
                                            submesh_logical_shape_space="single_node_model_parallel")
    return alpa.PipeshardParallel(num_micro_batches=micro, layer_option=layer_option, stage_option=stage_option)


def _to_float(x) -> float:
    import numpy as np

    value = getattr(x, "_value", None)
    return float(np.asarray(value if value is not None else x))


# ----------------------------------------------------------------------------- the run
def run_alpa(config, address: Optional[str]) -> Dict[str, Any]:
    """Join the cluster, start Alpa, train, inspect; returns one result dict (train.py's format)."""
    from alpa_job.cluster.spec import load_spec

    guards.check_alpa_version(guards.installed_alpa_version())
    xla_env = load_spec(config.cluster_spec).xla_env()
    guards.apply_xla_port_env(xla_env)  # before `import alpa`: global_env reads it at import
    where = join_cluster(address, xla_env)
    print(f"[alpa_job] joined {where}", file=sys.stderr, flush=True)

    import ray

    nodes = ray.nodes()
    num_nodes, per_node = guards.cluster_shape(nodes)
    driver_ip = ray.util.get_node_ip_address()
    guards.check_driver_on_cluster(driver_ip, nodes)

    import alpa

    guards.check_alpa_version(getattr(alpa, "__version__", None))
    guards.apply_xla_port_env(xla_env, global_config=alpa.global_config)
    alpa.init(cluster="ray", num_nodes=num_nodes, num_devices_per_node=per_node)
    try:
        return _train(config, alpa, num_nodes, per_node, driver_ip)
    finally:
        alpa.shutdown()


def _train(config, alpa, num_nodes: int, per_node: int, driver_ip: str) -> Dict[str, Any]:
    import jax

    from alpa_job.inspect.alpa_live import dump_from_placement_specs, stage_layout
    from alpa_job.inspect.hlo import count_collectives, merge_counts
    from alpa_job.models import get_model

    settings = method_settings(config, num_nodes, per_node)
    model = get_model(config)
    dataset = load_dataset(config)
    epoch = plan_epoch(dataset.num_samples, config.batch_size, config.remainder)
    total_steps = config.steps if config.steps is not None else config.epochs * epoch.steps
    example, _ = next(epoch_batches(dataset, config.batch_size, config.remainder, config.seed, 0))
    signature = guards.shape_signature(example)
    vers = versions.collect()

    # ---- plan cache decision (pipeshard-auto only)
    cache_info: Optional[Dict[str, Any]] = None
    cached_plan = None
    cache = None
    key = key_inputs = None
    if config.plan_cache and settings["strategy"] == "pipeshard-auto":
        cache = cache_lib.PlanCache(config.plan_cache)
        key_inputs = cache_lib.plan_key_inputs(config.as_dict(), signature, num_nodes, per_node,
                                               _gpu_kind(), vers, settings)
        key = cache_lib.plan_key(key_inputs)
        entry = cache.lookup(key)
        decision = "hit" if entry else "miss"
        cached_plan = entry["plan"] if entry else None
        print(cache_lib.decision_line(key, decision, config.plan_cache), flush=True)
        cache_info = {"dir": os.path.abspath(config.plan_cache), "key": key, "decision": decision,
                      "key_inputs": key_inputs}
    elif config.plan_cache:
        progress.note(f"--plan-cache is used only by --strategy pipeshard-auto; ignored for {settings['strategy']}")

    method = build_method(settings, cached_plan)
    auto_search = settings["strategy"] == "pipeshard-auto" and cached_plan is None
    guard = guards.SearchGuard(auto_search)

    TrainState = _train_state_cls()
    import jax.numpy as jnp
    import optax

    tx = optax.adam(config.learning_rate)
    init_kwargs = {"train": False} if model.has_batch_stats else {}
    sample = {k: jnp.asarray(v) for k, v in example.items()}
    variables = model.module.init(jax.random.PRNGKey(config.seed), sample[model.input_key], **init_kwargs)
    state = TrainState.create(apply_fn=model.module.apply, params=variables["params"], tx=tx,
                              batch_stats=variables.get("batch_stats"))

    train_fn = make_train_step(model)
    train_step = alpa.parallelize(train_fn, method=method, batch_argnums=(1,), donate_argnums=(0,))

    # ---- first call: compile (and search) under pipeline boundaries / stdout capture
    search_started = time.time()
    compile_start = time.perf_counter()
    boundaries = (pipeline_boundaries(_layer_class(config), settings["boundaries"],
                                      model_layer_count(config))
                  if settings["strategy"] == "pipeshard-manual" else contextlib.nullcontext())
    guard.check(signature)
    with cache_lib.tee_stdout() as captured, boundaries:
        executable = train_step.get_executable(state, example)
    compile_seconds = time.perf_counter() - compile_start

    dp_result = None
    if settings["strategy"] == "pipeshard-auto":
        from alpa.pipeline_parallel.stage_construction import get_last_dp_result

        dp_result = tuple(get_last_dp_result())
        if cached_plan is not None:
            dp_result = (None, cached_plan["forward_stage_layer_ids"], cached_plan["submesh_physical_shapes"],
                         cached_plan["submesh_logical_shapes"], cached_plan["submesh_autosharding_option_dicts"])
        elif cache is not None:
            profile = cache_lib.find_profile_file(captured.getvalue(), os.getcwd(), since=search_started)
            entry = cache.save(key, key_inputs, dp_result, profile,
                               extra={"search_seconds": round(compile_seconds, 1)})
            cache_info.update(decision="saved", profile=entry.get("profile_path"),
                              profile_source=profile)
            print(cache_lib.decision_line(key, "saved", config.plan_cache), flush=True)
            if profile is None:
                progress.note("Alpa's profile-results-*.npy was not found (no 'Profile result saved to:' line, "
                              "none in the driver's cwd); the plan is saved without the profile")

    # ---- the loop
    steps = samples_seen = samples_dropped = 0
    losses: List[float] = []
    global_step = 0
    bar = progress.Progress("train", total_steps)
    loop_start = time.perf_counter()
    executables = {id(executable)}
    while global_step < total_steps:
        epoch_index = global_step // epoch.steps
        pending = []
        for batch, real in epoch_batches(dataset, config.batch_size, config.remainder, config.seed, epoch_index):
            if global_step >= total_steps:
                break
            guard.check(guards.shape_signature(batch))
            state, loss = train_step(state, batch)
            executables.add(id(train_step.get_last_executable()))
            pending.append(loss)
            global_step += 1
            steps += 1
            samples_seen += real
            bar.update(1, epoch=epoch_index + 1)
        else:
            samples_dropped += epoch.samples_dropped
        losses.extend(_to_float(x) for x in pending)
    loop_seconds = time.perf_counter() - loop_start
    bar.close()

    # ---- eval with FollowParallel (the train step's input placement)
    eval_loss = None
    try:
        follow = alpa.FollowParallel(
            train_step, num_micro_batches=settings["micro_batches"],
            get_input_placement_specs=lambda: train_step.get_last_executable().get_input_placement_specs())
        eval_step = alpa.parallelize(make_eval_step(model), method=follow, batch_argnums=(1,), donate_argnums=())
        total, count = eval_step(state, example)
        eval_loss = round(_to_float(total) / max(_to_float(count), 1.0), 6)
    except Exception as err:  # noqa: BLE001 - eval is a report extra; the training result stands
        progress.note(f"evaluation with FollowParallel failed ({type(err).__name__}: {err}); report has no eval_loss")

    # ---- inspection (in-process, same labels as the JAX engine and `inspect DUMP_DIR`)
    executable = train_step.get_last_executable()
    dump = dump_from_placement_specs(executable.get_input_placement_specs(),
                                     executable.get_output_placement_specs())
    plan = dump.plan
    stage_mem = None
    memory: Dict[str, Any] = {}
    collectives = None
    try:
        if hasattr(executable, "get_stage_allocation_size"):
            stage_mem = list(executable.get_stage_allocation_size())
            memory = {f"stage_{i}": int(b) for i, b in enumerate(stage_mem)}
        else:
            memory = {"total_allocation_size": int(executable.get_total_allocation_size())}
        texts = executable.get_hlo_text()
        texts = texts if isinstance(texts, (list, tuple)) else [texts]
        collectives = merge_counts(*(count_collectives(t) for t in texts))
    except Exception as err:  # noqa: BLE001 - the KeyError case: point at the worker log
        kit = guards.explain_dump_failure(err, _mesh_hosts(executable))
        progress.note(str(kit) if kit else f"could not read HLO/memory from the workers ({type(err).__name__}: {err})")
    if config.out:
        try:
            guards.safe_dump_debug_info(executable.dump_debug_info, os.path.join(config.out, "alpa_dump"),
                                        _mesh_hosts(executable))
        except KitError as err:
            progress.note(str(err))

    return {
        "engine": "alpa",
        "strategy": settings["strategy"],
        "requested_strategy": config.strategy,
        "alpa_method": settings,
        "mesh": {"shape": [num_nodes, per_node], "axes": ["node", "gpu"]},
        "meshes": plan.mesh_rows(),
        "params": plan.leaf_rows(),
        "batch_sharding": plan.batch_rows(),
        "stages": stage_layout(dp_result, stage_mem),
        "plan_cache": cache_info,
        "compiles": len(executables),
        "backend_compiles_during_loop": len(executables) - 1,
        "compile_seconds": round(compile_seconds, 3),
        "collectives": collectives,
        "memory": memory,
        "search": None,
        "resumed_from_step": None,
        "eval_loss": eval_loss,
        **loop_statistics(steps, samples_seen, samples_dropped, loop_seconds, losses),
        "process": {"id": 0, "count": 1, "host": socket.gethostname(), "ip": driver_ip,
                    "local_devices": [], "coordinator": None},
        "devices": {"count": num_nodes * per_node, "platform": "gpu", "kind": _gpu_kind()},
        "versions": vers,
    }


def _gpu_kind() -> Optional[str]:
    try:
        import ray

        for n in ray.nodes():
            for r in (n.get("Resources") or {}):
                if r.startswith("accelerator_type:"):
                    return r.split(":", 1)[1]
    except Exception:  # noqa: BLE001
        pass
    return None


def _mesh_hosts(executable) -> List[str]:
    hosts: List[str] = []
    meshes = getattr(getattr(executable, "mesh_group", None), "meshes", None)
    if meshes is None and getattr(executable, "physical_mesh", None) is not None:
        meshes = [executable.physical_mesh]
    for mesh in meshes or []:
        for ip in getattr(mesh, "host_ips", None) or []:
            if ip not in hosts:
                hosts.append(ip)
    return hosts
