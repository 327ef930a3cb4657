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
placement. `AlpaEngine` implements engines.base.Engine, so the one loop (train/loop.py) drives it (data,
ragged policy, progress, timing, statistics) exactly as it drives the JAX engine; this module keeps
what only Alpa has: the session (guards, alpa.init), pipeline boundaries, the plan cache, the dump.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

from alpa_job import versions
from alpa_job.progress.events import note, timed
from alpa_job.cluster import ray_api
from alpa_job.engines import alpa_guards as guards
from alpa_job.engines import plan_cache as cache_lib
from alpa_job.engines.base import CompileStats, Engine, check_supported
from alpa_job.errors import KitError
from alpa_job.record.run_record import MemoryRecord

ALPA_METHODS = ("data", "shard", "pipeshard-manual", "pipeshard-auto")


# ----------------------------------------------------------------------------- pure helpers
def model_layer_count(config) -> int:
    """The model's repeated layers (what pipeline boundaries are counted in), as its builder declared."""
    from alpa_job.models import build_model

    count = build_model(config)[0].layer_count
    if not count:
        raise KitError(
            f"--model {config.model} declares no layer_count; Alpa's pipelines split a model at its "
            "repeated layers: set layer_count and layer_class in its api.Model, or use --strategy data "
            "or shard"
        )
    return count


def boundary_after(num_layers: int, num_stages: int) -> List[int]:
    """0-based layer indices after which to call mark_pipeline_boundary (num_stages - 1 of them),
    splitting num_layers as evenly as possible by count."""
    if num_stages < 1 or num_stages > num_layers:
        raise KitError(f"--pipeline-stages {num_stages} does not fit a model of {num_layers} layers; use 1..{num_layers}")
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
        raise KitError(f"--strategy {strategy!r} is not an Alpa method; with --engine alpa use one of: {', '.join(ALPA_METHODS)}")
    devices = num_nodes * devices_per_node
    layers = model_layer_count(config)
    micro = config.micro_batches or 1
    if config.batch_size % micro:
        raise KitError(f"--batch-size {config.batch_size} is not divisible by --micro-batches {micro}")
    out: Dict[str, Any] = {"strategy": strategy, "micro_batches": micro}
    if strategy == "pipeshard-manual":
        stages = config.pipeline_stages or default_stages(num_nodes, devices, layers)
        if devices % stages:
            raise KitError(
                f"--pipeline-stages {stages} does not divide the {devices} GPUs "
                f"({num_nodes} node(s) x {devices_per_node}); use a divisor of {devices}"
            )
        out.update(stages=stages, boundaries=boundary_after(layers, stages))
    elif strategy == "pipeshard-auto":
        out.update(layer_num=config.pipeline_layers or layers)
    return out


# ----------------------------------------------------------------------------- joining
def join_cluster(address: Optional[str], xla_env: Dict[str, str], spec=None, timeout_s: float = ray_api.JOIN_TIMEOUT_S) -> str:
    """Join Ray for Alpa (bounded, ray_api.join_ray): never Ray Client; the XLA port range reaches
    every worker via the runtime_env. No address / "local": a local Ray with this machine's GPUs."""
    guards.refuse_ray_client(address)
    address = ray_api.normalize_address(address or ray_api.LOCAL, spec, default=ray_api.LOCAL)
    return ray_api.join_ray(
        address, timeout_s, runtime_env={"env_vars": guards.ray_env_vars(xla_env)}, namespace="alpa_default_space", log_to_driver=True
    )


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
    def eval_step(state, batch):
        return model.eval_sums(state.params, state.batch_stats, batch)

    return eval_step


def _layer_class(config):
    """The flax class whose calls are the model's layers (boundaries go after them), as its builder declared."""
    from alpa_job.models import build_model

    layer_class = build_model(config)[0].layer_class
    if layer_class is None:
        raise KitError(
            f"--model {config.model} declares no layer_class; Alpa's pipelines mark a boundary after "
            "its layers' calls: set layer_class (the repeated flax class) in its api.Model"
        )
    return layer_class


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
        return alpa.PipeshardParallel(
            num_micro_batches=micro,
            layer_option=alpa.ManualLayerOption(),
            stage_option=alpa.UniformStageOption(num_stages=settings["stages"]),
        )
    layer_option = alpa.AutoLayerOption(layer_num=settings["layer_num"])
    if cached_plan is not None:
        stage_option = alpa.ManualStageOption(**cache_lib.manual_stage_kwargs(cached_plan))
    else:
        stage_option = alpa.AutoStageOption(
            submesh_physical_shape_space="power_of_two", submesh_logical_shape_space="single_node_model_parallel"
        )
    return alpa.PipeshardParallel(num_micro_batches=micro, layer_option=layer_option, stage_option=stage_option)


def _to_float(x) -> float:
    import numpy as np

    value = getattr(x, "_value", None)
    return float(np.asarray(value if value is not None else x))


# ----------------------------------------------------------------------------- the session
@dataclasses.dataclass(frozen=True)
class AlpaCluster:
    """What Alpa was started on (alpa.init's arguments and the driver's node)."""

    num_nodes: int
    per_node: int  # GPUs per node (Alpa's meshes are uniform)
    driver_ip: str
    gpu_kind: Optional[str] = None


def refuse_unsupported(config) -> None:
    """Flags the Alpa engine cannot honour, refused before joining the cluster."""
    check_supported(config, AlpaEngine)


@contextlib.contextmanager
def alpa_session(config, address: Optional[str], spec) -> Iterator[AlpaCluster]:
    """Guard the versions and ports, join the cluster, alpa.init; alpa.shutdown on the way out.

    `spec` is the job's resolved ClusterSpec (its XLA port range must reach the driver's env
    before `import alpa` and every worker through the runtime_env)."""
    refuse_unsupported(config)
    guards.check_alpa_version(guards.installed_alpa_version())
    xla_env = spec.xla_env()
    guards.apply_xla_port_env(xla_env)  # before `import alpa`: global_env reads it at import
    where = join_cluster(address, xla_env, spec)
    print(f"[alpa_job] joined {where}", file=sys.stderr, flush=True)

    import ray

    nodes = ray_api.alive_nodes()
    rows = [n.row for n in nodes]
    num_nodes, per_node = guards.cluster_shape(rows)
    driver_ip = ray.util.get_node_ip_address()
    guards.check_driver_on_cluster(driver_ip, rows)

    import alpa

    guards.check_alpa_version(getattr(alpa, "__version__", None))
    guards.apply_xla_port_env(xla_env, global_config=alpa.global_config)
    alpa.init(cluster="ray", num_nodes=num_nodes, num_devices_per_node=per_node)
    try:
        yield AlpaCluster(num_nodes, per_node, driver_ip, _gpu_kind(nodes))
    finally:
        alpa.shutdown()


# ----------------------------------------------------------------------------- the engine
class AlpaEngine(Engine):
    """The `Engine` (engines/base.py) for alpa 0.2.3: alpa.parallelize drives every GPU node from
    the driver, so the one loop (train/loop.py) runs once, on the driver.

    The constructor is pure (no `import alpa`): the interface test builds one on Python 3.9."""

    name = "alpa"
    checkpoints = False  # the state lives in Alpa's DistributedArrays; orbax does not save those

    def __init__(self, config, model, example_batch: Dict[str, Any], cluster: AlpaCluster, schedule_steps: Optional[int] = None):
        """`schedule_steps`: the learning-rate schedule's horizon (optimizer.schedule_steps; default: --steps)."""
        self.config, self.model, self.cluster = config, model, cluster
        self._schedule_steps = schedule_steps if schedule_steps is not None else config.steps
        self.settings = method_settings(config, cluster.num_nodes, cluster.per_node)
        super().__init__(self.settings["strategy"])
        self._example = example_batch
        self._signature = guards.shape_signature(example_batch)
        self._guard = guards.SearchGuard(False)  # replaced in compile() once the method is known
        self._train_step = None
        self.executable = None  # the train step's last compiled executable (what inspection reads)
        self._executables: set = set()  # ids of the train step's executables (1 = never recompiled)
        self._initial_state = None
        self._optimizer = None
        self._cache: Optional[cache_lib.PlanCache] = None
        self._key: Optional[str] = None
        self._key_inputs: Optional[Dict[str, Any]] = None
        self._dp_result = None
        self._stage_memory: Optional[List[int]] = None
        self.cache_info: Optional[Dict[str, Any]] = None

    @classmethod
    def factory(cls, cluster: AlpaCluster):
        """train.train_process's `build_engine`: construct and compile on `cluster`."""

        def build(config, model, data):
            from alpa_job.engines.optimizer import schedule_steps

            engine = cls(config, model, data.example, cluster, schedule_steps=schedule_steps(config, data.epoch.steps))
            engine.compile()
            return engine

        return build

    # ----- state -------------------------------------------------------------------------------
    def _init(self, seed: int):
        import jax
        import jax.numpy as jnp

        model = self.model
        init_kwargs = {"train": False} if model.has_batch_stats else {}
        sample = {k: jnp.asarray(v) for k, v in self._example.items()}
        variables = model.module.init(jax.random.PRNGKey(seed), sample[model.input_key], **init_kwargs)
        return _train_state_cls().create(
            apply_fn=model.module.apply, params=variables["params"], tx=self._tx(), batch_stats=variables.get("batch_stats")
        )

    def _tx(self):
        from alpa_job.engines.optimizer import default_optimizer

        if self._optimizer is None:  # one object: it is part of the state's treedef
            # The same warmup + decay as the JAX engine: one default for every engine.
            self._optimizer = default_optimizer(self.config.learning_rate, self._schedule_steps)
        return self._optimizer

    def init_state(self, seed: int):
        # Alpa compiles against concrete arguments (get_executable(state, batch)), so compile()
        # already made the initial state: hand that one over instead of initialising twice.
        if self._initial_state is not None and seed == self.config.seed:
            state, self._initial_state = self._initial_state, None
            return state
        return self._init(seed)

    @property
    def abstract_state(self):
        import jax

        return jax.eval_shape(lambda: self._init(self.config.seed))

    # ----- compile (and search) --------------------------------------------------------------------
    def compile(self) -> CompileStats:
        """parallelize the step and compile it for the one batch shape: under pipeline boundaries
        (pipeshard-manual), the plan cache (pipeshard-auto) and the second-search guard."""
        import alpa

        cached_plan = self._plan_cache_lookup()
        method = build_method(self.settings, cached_plan)
        self._guard = guards.SearchGuard(self.strategy == "pipeshard-auto" and cached_plan is None)
        self._initial_state = self._init(self.config.seed)
        self._train_step = alpa.parallelize(make_train_step(self.model), method=method, batch_argnums=(1,), donate_argnums=(0,))
        boundaries = (
            pipeline_boundaries(_layer_class(self.config), self.settings["boundaries"], model_layer_count(self.config))
            if self.strategy == "pipeshard-manual"
            else contextlib.nullcontext()
        )
        self._guard.check(self._signature)
        search_started = time.time()
        start = time.perf_counter()
        with timed(
            f"compiling train step ({self.config.model}, alpa {self.strategy}, "
            f"{self.cluster.num_nodes} node(s) x {self.cluster.per_node} GPU)"
        ):
            with cache_lib.tee_stdout() as captured, boundaries:
                executable = self._train_step.get_executable(self._initial_state, self._example)
        self.stats.compile_seconds = time.perf_counter() - start
        self._track(executable)
        if self.strategy == "pipeshard-auto":
            self._keep_stage_plan(cached_plan, captured.getvalue(), search_started)
        self.read_executable(executable)
        return self.stats

    def _track(self, executable) -> None:
        self.executable = executable
        self._executables.add(id(executable))
        self.stats.compiles = len(self._executables)

    def _plan_cache_lookup(self) -> Optional[Dict[str, Any]]:
        """The cached stage plan on a --plan-cache hit (pipeshard-auto only), else None."""
        config = self.config
        if not config.plan_cache:
            return None
        if self.strategy != "pipeshard-auto":
            note(f"--plan-cache is used only by --strategy pipeshard-auto; ignored for {self.strategy}")
            return None
        self._cache = cache_lib.PlanCache(config.plan_cache)
        self._key_inputs = cache_lib.plan_key_inputs(
            config.as_dict(),
            self._signature,
            self.cluster.num_nodes,
            self.cluster.per_node,
            self.cluster.gpu_kind,
            versions.collect(),
            self.settings,
        )
        self._key = cache_lib.plan_key(self._key_inputs)
        entry = self._cache.lookup(self._key)
        decision = "hit" if entry else "miss"
        print(cache_lib.decision_line(self._key, decision, config.plan_cache), flush=True)
        self.cache_info = {
            "dir": os.path.abspath(config.plan_cache),
            "key": self._key,
            "decision": decision,
            "key_inputs": self._key_inputs,
        }
        return entry["plan"] if entry else None

    def _keep_stage_plan(self, cached_plan: Optional[Dict[str, Any]], stdout: str, search_started: float) -> None:
        """The stage plan in use (for the report) and, after a fresh search, the plan-cache entry."""
        from alpa.pipeline_parallel.stage_construction import get_last_dp_result

        self._dp_result = tuple(get_last_dp_result())
        if cached_plan is not None:
            self._dp_result = (
                None,
                cached_plan["forward_stage_layer_ids"],
                cached_plan["submesh_physical_shapes"],
                cached_plan["submesh_logical_shapes"],
                cached_plan["submesh_autosharding_option_dicts"],
            )
        elif self.cache_info is not None:
            profile = cache_lib.find_profile_file(stdout, os.getcwd(), since=search_started)
            entry = self._cache.save(
                self._key, self._key_inputs, self._dp_result, profile, extra={"search_seconds": round(self.stats.compile_seconds, 1)}
            )
            self.cache_info.update(decision="saved", profile=entry.get("profile_path"), profile_source=profile)
            print(cache_lib.decision_line(self._key, "saved", self.config.plan_cache), flush=True)
            if profile is None:
                note(
                    "Alpa's profile-results-*.npy was not found (no 'Profile result saved to:' line, "
                    "none in the driver's cwd); the plan is saved without the profile"
                )

    def read_executable(self, executable) -> None:
        """HLO texts and memory (per pipeline stage where it has stages) from a compiled executable,
        which asks the workers; a failure is a note (KeyError: the worker log names the cause)."""
        try:
            if hasattr(executable, "get_stage_allocation_size"):
                self._stage_memory = [int(b) for b in executable.get_stage_allocation_size()]
                memory = MemoryRecord.from_stage_bytes(self._stage_memory)
            else:
                memory = MemoryRecord.from_stage_bytes(total_bytes=int(executable.get_total_allocation_size()))
            self.stats.memory = {k: v for k, v in dataclasses.asdict(memory).items() if v is not None}
            texts = executable.get_hlo_text()
            self.stats.hlo_texts = list(texts) if isinstance(texts, (list, tuple)) else [texts]
        except Exception as err:  # noqa: BLE001 - the KeyError case: point at the worker log
            kit = guards.explain_dump_failure(err, _mesh_hosts(executable))
            note(str(kit) if kit else f"could not read HLO/memory from the workers ({type(err).__name__}: {err})")

    # ----- the step ----------------------------------------------------------------------------
    def put_batch(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        self._guard.check(guards.shape_signature(batch))  # before Alpa could start a second search
        return batch  # alpa.parallelize shards host batches itself (batch_argnums)

    def step(self, state, batch):
        if self._train_step is None:
            raise RuntimeError("compile() before step()")
        state, loss = self._train_step(state, batch)
        self._track(self._train_step.get_last_executable())
        return state, loss

    def to_floats(self, values: List[Any]) -> List[float]:
        return [_to_float(x) for x in values]

    def wait(self, state) -> None:
        # The loop fetched every loss with to_floats; Alpa's step returns them last, as before.
        return None

    def watch_compiles(self) -> Callable[[], int]:
        base = len(self._executables)
        return lambda: len(self._executables) - base

    # ----- inspection ----------------------------------------------------------------------------
    def plan(self):
        """The plan from the last executable's placement specs (same labels as `inspect DUMP_DIR`)."""
        from alpa_job.record.alpa_live import dump_from_placement_specs

        executable = self.executable
        return dump_from_placement_specs(executable.get_input_placement_specs(), executable.get_output_placement_specs()).plan

    def topology(self) -> Dict[str, Any]:
        c = self.cluster
        return {
            "mesh": {"shape": [c.num_nodes, c.per_node], "axes": ["node", "gpu"]},
            "process": {"id": 0, "count": 1, "local_devices": []},  # the driver drives every node
            "devices": {"count": c.num_nodes * c.per_node, "platform": "gpu", "kind": c.gpu_kind},
        }

    def eval_loss(self, state, batch: Dict[str, Any]) -> Optional[float]:
        sums = self.eval_sums(state, batch)
        if sums is None:
            return None
        total, count = sums
        return round(_to_float(total) / max(_to_float(count), 1.0), 6)

    def eval_sums(self, state, batch: Dict[str, Any]):
        """(loss sum, real rows) with FollowParallel on the train step's input placement (built once)."""
        import alpa

        try:
            if getattr(self, "_eval_step", None) is None:
                train_step = self._train_step
                follow = alpa.FollowParallel(
                    train_step,
                    num_micro_batches=self.settings["micro_batches"],
                    get_input_placement_specs=lambda: train_step.get_last_executable().get_input_placement_specs(),
                )
                self._eval_step = alpa.parallelize(make_eval_step(self.model), method=follow, batch_argnums=(1,), donate_argnums=())
            return self._eval_step(state, batch)
        except Exception as err:  # noqa: BLE001 - eval is a report extra; the training result stands
            note(f"evaluation with FollowParallel failed ({type(err).__name__}: {err}); report has no eval_loss")
            return None

    def finish(self, out_dir: str) -> None:
        """Alpa's dump_debug_info under OUT/alpa_dump (what `inspect DUMP_DIR` reads)."""
        executable = self.executable
        try:
            guards.safe_dump_debug_info(executable.dump_debug_info, os.path.join(out_dir, "alpa_dump"), _mesh_hosts(executable))
        except KitError as err:
            note(str(err))

    def extra_report(self) -> Dict[str, Any]:
        from alpa_job.record.alpa_live import stage_layout

        return {"alpa_method": self.settings, "stages": stage_layout(self._dp_result, self._stage_memory), "plan_cache": self.cache_info}


def _gpu_kind(nodes: List[ray_api.RayNode]) -> Optional[str]:
    """The GPU model Ray reports as an `accelerator_type:<kind>` resource."""
    for n in nodes:
        for r in n.resources:
            if r.startswith("accelerator_type:"):
                return r.split(":", 1)[1]
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
