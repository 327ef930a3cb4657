"""The JAX engine: a named device mesh, sharding from logical-axis rules, one AOT compile.

The train step is lowered and compiled ahead of time for the one batch shape the data pipeline
produces, and every step calls that compiled executable: a batch of another shape raises instead
of silently recompiling (the failure mode behind https://github.com/alpa-projects/alpa/issues/776).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from alpa_job import strategies
from alpa_job.engines import compile_cache, flops, layer_gather, memory_fit, model_checks, network_schedule, weight_reads, xla_options
from alpa_job.engines.base import CompileStats, Engine
from alpa_job.engines.device_mesh import make_mesh  # noqa: F401 - also the module's name for it (auto, benches)
from alpa_job.engines.executable_store import StepStore, store_for
from alpa_job.engines.optimizer import default_optimizer
from alpa_job import api, models
from alpa_job.record import traffic
from alpa_job.strategies import axes_of, batch_mesh_axis, check_batch_split
from alpa_job.engines import every_process
from alpa_job.engines.state_init import StateInitializer
from alpa_job.errors import KitError
from alpa_job.record import jax_program, plan as plan_model
from alpa_job.models import ModelSpec


class TrainState(train_state.TrainState):
    batch_stats: Any = None  # BatchNorm running statistics (wide_resnet); None elsewhere


class StepStats(CompileStats):
    """CompileStats whose `hlo_texts` are printed from the compiled step on first read (`hlo_later`):
    printing a large step's HLO holds the interpreter a while, and nothing before the first step reads it
    (the report's collectives and traffic, a plan's compile do, afterwards)."""

    _hlo_texts: Optional[List[str]] = None
    _hlo_source: Optional[Callable[[], List[str]]] = None

    @property  # type: ignore[override] - the dataclass field, read through
    def hlo_texts(self) -> Optional[List[str]]:
        if self._hlo_texts is None and self._hlo_source is not None:
            self._hlo_texts, self._hlo_source = self._hlo_source(), None
        return self._hlo_texts

    @hlo_texts.setter
    def hlo_texts(self, texts: Optional[List[str]]) -> None:
        self._hlo_texts, self._hlo_source = texts, None

    def hlo_later(self, source: Callable[[], List[str]]) -> None:
        self._hlo_texts, self._hlo_source = None, source


class JaxEngine(Engine):
    """The `Engine` (engines/base.py) for jax >= 0.4: one JAX process per node, SPMD over a mesh."""

    name = "jax"
    # The state must fit this process's devices; a planner compiling for GPUs it does not have says no.
    check_memory = True

    def __init__(
        self,
        config,
        model: ModelSpec,
        example_batch: Dict[str, np.ndarray],
        strategy: str,
        mesh_shape: Tuple[int, int],
        schedule_steps: Optional[int] = None,
    ):
        """`schedule_steps`: the learning-rate schedule's horizon (optimizer.schedule_steps; default: --steps)."""
        super().__init__(strategy)
        self.stats = StepStats()
        self.config, self.model = config, model
        self.strategy_record = strategies.get(strategy)  # the strategy's one record: rules, update split, XLA options
        self.mesh = self.make_mesh(mesh_shape, self.strategy_record.mesh_axes)
        self.config_precision = getattr(config, "precision", "dtype")
        self._precision_notes = self._check_precision(self.mesh.devices.flat)
        self.rules = self.strategy_record.param_rules
        self.activation_rules = self.strategy_record.activation_rules
        self.compiler_options = xla_options.compiler_options(strategy)  # the step's, in the report too
        # Before anything compiles: a second identical run loads the executables (compile_cache.py).
        self.stats.compile_cache_dir = compile_cache.enable(compile_cache.resolve(getattr(config, "compile_cache", None)))
        self._example = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in example_batch.items()}
        self.batch_axis = batch_mesh_axis(self.rules)
        self._check_batch_divisible(example_batch)
        self.batch_sharding = NamedSharding(self.mesh, PartitionSpec(self.batch_axis))
        self._check_batch_rows_per_process()
        self._horizon = schedule_steps if schedule_steps is not None else config.steps
        self.tx = self.make_optimizer(config.learning_rate, self._horizon)
        start = time.perf_counter()
        model_checks.check_batch_field(model, self._example)
        self.pipeline = self._pipeline(config, model) if self.strategy_record.pipelined else None
        make_state = self._make_state if self.pipeline is None else self._make_pipelined_state
        self._initializer = StateInitializer(model, self._example, make_state)
        boxed = self._initializer.abstract_boxed()
        self.logical_specs = nn.get_partition_spec(boxed)
        unboxed = nn.meta.unbox(boxed)
        self.state_sharding = self._state_sharding(strategy, config, unboxed)
        if self.pipeline is not None:
            self.pipeline.place(jax.tree_util.tree_map(lambda s: s.spec, self.state_sharding.params))
        self._abstract_state = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), unboxed, self.state_sharding
        )
        why_not = layer_gather.unsupported(self.strategy_record, model)
        self._per_layer_possible = why_not is None  # fsdp's per-layer gathers (engines/layer_gather.py)
        asked = config.fsdp_gather == "layer" and self.strategy_record.gathers_layers
        self._gather_note = f"--fsdp-gather layer: {why_not}, so XLA places the gathers" if asked and why_not else None
        self._network_note: Optional[str] = None  # --network-gbps: what XLA was told, once the step compiled
        self.layer_gather = self._new_layer_gather() if layer_gather.starts_per_layer(config, self.strategy_record, model) else None
        if self.check_memory:
            memory_fit.check_state_fits(self._abstract_state, strategy, mesh_shape)  # before anything allocates
        if self.pipeline is None:
            self._notes = model_checks.check_against_step(model, strategy, self.logical_specs.params, unboxed, self._example)
        else:  # the checks run the model, which takes its parameters as it names them
            self._own_params = self._initializer.abstract_model_params()  # boxed; the initialiser's too
            self._notes = model_checks.check_against_step(
                model,
                strategy,
                nn.get_partition_spec(self._own_params),
                unboxed.replace(params=nn.meta.unbox(self._own_params)),
                self._example,
            )
        self.stats.setup_phases["abstract_state"] = time.perf_counter() - start
        self._compiled = None
        self._init_compiled: Optional[concurrent.futures.Future] = None
        self._seed_ahead: Optional[int] = None  # init_state_ahead(): the state made beside the step's compile
        self._state_ahead: Optional[TrainState] = None
        self._hits_before = 0
        self._store: Optional[StepStore] = None  # set while a freshly compiled step waits to be stored
        self._lowered_ahead = None  # (jitted, lowered) from lower_step(), for auto's candidates
        self.initialise_replicated = False  # auto's copies: their one state is created whole (auto_search)
        self.search_table: Optional[List[Dict[str, Any]]] = None  # set when --strategy auto chose this one

    def _check_precision(self, devices) -> List[str]:
        """--precision fp8 on GPUs without fp8 tensor cores: one line; on CPU devices: emulated, said."""
        if self.config_precision != "fp8":
            return []
        from alpa_job.engines import fp8

        unsupported = fp8.unsupported_gpu(devices)
        if unsupported:
            raise KitError(
                f"--precision fp8 needs fp8 tensor cores (compute capability 8.9 or later: Ada, Hopper), "
                f"and this run has {unsupported}; drop --precision fp8"
            )
        if all(d.platform == "cpu" for d in devices):
            return [
                "--precision fp8 on CPU devices: the products are rounded to fp8 as on a GPU (the numbers of fp8 "
                "training), but run emulated, no faster than bf16"
            ]
        return []

    @functools.cached_property
    def _read_dtypes(self):
        """The dtype the model reads each parameter in (weight_reads.py), found once, on first use: data's
        sharded update and fsdp's per-layer gathers gather each parameter in it."""
        abstract = self.abstract_state
        return weight_reads.gather_dtypes(self.model, abstract.params, abstract.batch_stats, self._example, self.config.dtype)

    def _new_layer_gather(self):
        rows = PartitionSpec(self.batch_axis)
        return layer_gather.LayerGather(self.model.layer_class, self.mesh, rows, self._read_dtypes, self.state_sharding.params)

    def _weight_gather(self) -> Dict[str, Any]:
        """Where the step gathers fsdp's weights, for the report. A step loaded from a store entry that predates
        the count was never traced here: one abstract trace of the loss then counts the layers."""
        gather = self.layer_gather
        if gather is None:
            chosen = self.config.fsdp_gather
            reason = {"xla": "--fsdp-gather xla", "auto": "--fsdp-gather auto: the step fits with XLA's placement"}.get(chosen)
            return {"placement": "xla", "reason": self._gather_note or reason or f"--fsdp-gather {chosen}"}
        if not gather.gathered_layers and not gather.under_own_remat:
            state = self.abstract_state
            jax.eval_shape(lambda p, b: gather.run(self.model.masked_loss, p, state.batch_stats, b), state.params, self._example)
        if gather.gathered_layers:
            return {"placement": "per layer", "layers": gather.gathered_layers}
        return {"placement": "xla", "reason": "the model's blocks run under its own remat, whose backward gathers the weights again"}

    # ----- pipeline stages (engines/pipeline.py) ------------------------------------------------
    def _pipeline(self, config, model):
        from alpa_job.engines.pipeline import Pipeline

        return Pipeline(
            model,
            self.mesh,
            strategies.micro_batches(config.micro_batches, self.mesh.shape["stage"]),
            self._example,
            repeats=config.pipeline_repeats,
            sum_dtype=jnp.bfloat16 if config.dtype == "bfloat16" else None,
        )

    def _make_pipelined_state(self, params, batch_stats):
        return self._make_state(self.pipeline.stack(params), batch_stats)

    def _model_layout_to_make(self):
        """The initialiser's pieces make a pipeline's parameters in the model's own layout, whole on every
        device; the state's first step stacks the blocks and splits them over the stages."""
        whole = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), nn.meta.unbox(self._own_params))

    # ----- state -------------------------------------------------------------------------------
    def _state_sharding(self, strategy: str, config, unboxed):
        """Each state leaf's NamedSharding: `strategy`'s split. Weight-update sharding: the parameters and
        the optimizer state split between steps as another strategy splits them (the step pins the gradients
        to the parameters' split so XLA reduce-scatters them; strategies.DATA says why)."""
        sharding = self._split_as(strategy, self.logical_specs, unboxed)
        update_like = self.strategy_record.update_split(config.data_update)
        if update_like is not None:
            sharding = sharding.replace(
                params=self._split_as(update_like, self.logical_specs.params, unboxed.params),
                opt_state=self._split_as(update_like, self.logical_specs.opt_state, unboxed.opt_state),
            )
        return sharding

    def _split_as(self, strategy: str, logical_specs, leaves):
        """Each leaf's NamedSharding on this mesh, as `strategy`'s rules split it."""
        split = strategies.get(strategy)
        return jax.tree_util.tree_map(
            lambda logical, leaf: NamedSharding(
                self.mesh, resolve_spec(logical, leaf.shape, split.param_rules, self.mesh, split.major_dimension_first)
            ),
            logical_specs,
            leaves,
            is_leaf=lambda x: isinstance(x, PartitionSpec),
        )

    @property
    def abstract_state(self):
        """The state's ShapeDtypeStructs with their shardings (built with the engine, before any compile)."""
        return self._abstract_state

    @functools.cached_property
    def state_bytes_per_device(self) -> int:
        """Bytes of the state one device holds: auto reads it for every candidate more than once."""
        return memory_fit.state_bytes_per_device(self._abstract_state)

    def make_optimizer(self, peak_learning_rate: float, horizon: Optional[int]):
        """The optimizer: engines/optimizer.py's default. A subclass that returns another must not use
        the step store (its key does not name the optimizer): the benches' engines compile their own."""
        return default_optimizer(peak_learning_rate, horizon)

    def _make_state(self, params, batch_stats):
        state = TrainState.create(apply_fn=None, params=params, tx=self.tx, batch_stats=batch_stats)
        # A strongly typed step counter: TrainState.create's python 0 is weak-typed, and a
        # weak/strong mismatch between the AOT signature and real calls costs a second compile.
        return state.replace(step=jnp.zeros((), jnp.int32))

    def _initialised_layout(self):
        """The abstract state the initialiser creates: this engine's, or every leaf whole on every device."""
        if not self.initialise_replicated:
            return self.abstract_state
        whole = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), self.abstract_state)

    def init_state(self, seed: int) -> TrainState:
        """The state, created on the devices already sharded (the initialiser compiled by compile()); the one
        init_state_ahead(seed) made, where it was asked for."""
        self._initializer_compiled()
        self._count_cache_hits()
        if self._state_ahead is not None and seed == self._seed_ahead:
            state, self._state_ahead = self._state_ahead, None  # handed over once: the step donates it
            return state
        return self._initializer(seed)

    def _drop_state_ahead(self) -> None:
        if self._seed_ahead is not None:
            self._initializer_compiled()  # the state is being made: wait for it, then free its memory
            self._seed_ahead = self._state_ahead = None

    def init_state_ahead(self, seed: int) -> None:
        """Before compile(): the initialiser's worker thread also creates the state from `seed` once it has
        compiled, while this thread loads or compiles the step; init_state(seed) then hands it over. For a
        run that starts from random parameters (not one that restores or reads weights: the state would
        take its memory for nothing). One process only: a program that spans processes runs in the same
        order on every one, and this thread's step compile is not ordered with it."""
        if jax.process_count() == 1:
            self._seed_ahead = seed

    def state_from_params(self, read_params) -> TrainState:
        """The state from given weights: `read_params(layout)` makes the model's parameters in `layout` (their
        ShapeDtypeStructs with the shardings the initialiser makes them in), then the state is made from them as
        from random ones (optimizer state fresh, step 0)."""
        self._initializer_compiled()
        if self.pipeline is not None:
            layout = self._model_layout_to_make()
        else:
            layout = self._initialised_layout().params
        return self._initializer.from_params(read_params(layout), self._initialised_layout())

    def wait_for_every_process(self) -> None:
        """Across processes: wait until every one has compiled its step and initialiser (every_process)."""
        if jax.process_count() == 1:
            return
        self._initializer_compiled()
        every_process.wait("alpa_job_compiled")

    def _initializer_compiled(self) -> None:
        """Wait for the initialiser's compile (started now if compile() has not)."""
        if self._init_compiled is None:
            self._start_init_compile()
        self._init_compiled.result()

    def _count_cache_hits(self) -> None:
        if self.stats.compile_cache_dir:
            self.stats.compile_cache_hits = compile_cache.hits() - self._hits_before

    def _start_init_compile(self) -> None:
        """Lower and compile the initialiser on a worker thread, beside the step's compile (JAX traces
        per thread; XLA compiles outside the GIL); its time is reported as init_compile_seconds."""

        def compile_init():
            start = time.perf_counter()
            self._initializer.lower(self._initialised_layout(), None if self.pipeline is None else self._model_layout_to_make())
            self._initializer.compile()
            self.stats.init_compile_seconds = round(time.perf_counter() - start, 3)
            if self._seed_ahead is not None:
                start = time.perf_counter()
                self._state_ahead = jax.block_until_ready(self._initializer(self._seed_ahead))
                self.stats.setup_phases["init_run_ahead"] = time.perf_counter() - start

        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="init-compile")
        self._init_compiled = pool.submit(compile_init)
        pool.shutdown(wait=False)

    # ----- the step ----------------------------------------------------------------------------
    def _train_step(self, state: TrainState, batch: Dict[str, jax.Array]):
        model = self.model
        if self.pipeline is not None:
            loss, grads = self.pipeline.value_and_grad(state.params, batch)
            return state.apply_gradients(grads=grads), loss

        def loss_fn(params):
            if self.layer_gather is not None:
                return self.layer_gather.run(model.masked_loss, params, state.batch_stats, batch)
            return model.masked_loss(params, state.batch_stats, batch)

        if self.strategy_record.update_split(self.config.data_update) is None:
            (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
        else:  # the split parameters' cast gathered first, the gradients reduce-scattered back to the split
            (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(self._gathered(state.params))
            grads = jax.lax.with_sharding_constraint(grads, self.state_sharding.params)
            grads = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), grads, state.params)
        state = state.apply_gradients(grads=grads)
        if model.has_batch_stats:
            state = state.replace(batch_stats=new_stats)
        return state, loss

    def _gathered(self, params):
        """The split parameters whole on every device, each in the dtype the model reads it in
        (weight_reads.py): the sharded update's one all-gather, at the step's start, where the forward's
        matmuls hide it."""
        cast = jax.tree_util.tree_map(lambda p, dtype: p.astype(dtype), params, self._read_dtypes)
        # Cast each device's share before the gather: left to itself XLA gathers the fp32 weights and fuses
        # the cast into the matmuls that read them, twice the bytes. jax 0.4.13 has no public barrier.
        barrier = getattr(jax.lax, "optimization_barrier", None)
        if barrier is not None:
            cast = barrier(cast)
        return jax.lax.with_sharding_constraint(cast, NamedSharding(self.mesh, PartitionSpec()))  # every leaf

    def compile(self) -> CompileStats:
        """Lower and compile the step once for the pipeline's fixed batch shape, the initialiser beside it."""
        self._hits_before = compile_cache.hits() if self.stats.compile_cache_dir else 0  # the initialiser's too
        # The store's key first: it reads every source file of the kit, and each read waits its turn for the
        # interpreter while the initialiser's thread traces (Python) beside it.
        store = self._step_store()
        if store is not None and self._may_gather_layers():
            # An earlier identical run found the step fits only with per-layer gathers, on this process or another
            # (each keeps its own entries, and every process must run one program).
            stored = not store.present() and self._store_for(per_layer=True).present()
            if every_process.any_process(stored, "fsdp-gather-stored"):
                self._gather_layers_instead()
                store = self._step_store()
        if store is None or not store.present():
            self._seed_ahead = None  # a step compiled beside it would autotune in less device memory
        if self._init_compiled is None:
            self._start_init_compile()
        stats = self._compile_step()
        try:
            self._check_step_fits(stats)
            refused = None
        except KitError as error:
            refused = error
        # Where XLA's placement does not fit on one process, every process switches: one program for all.
        if self._may_gather_layers() and every_process.any_process(refused is not None, "fsdp-gather-fits"):
            self._gather_layers_instead()
            stats = self._compile_step()
            self._check_step_fits(stats)
        elif refused is not None:
            raise refused
        self._schedule_for_network()
        self._store_step()
        return stats

    def _schedule_for_network(self) -> None:
        """--network-gbps on GPUs of several hosts: the step compiled again with XLA told what each of its
        collectives across hosts costs (network_schedule). A stored step was compiled so already (the setting is
        in its key), and what XLA was told came back with it."""
        gbps = getattr(self.config, "network_gbps", None)
        node_of = self._device_hosts()
        option = network_schedule.PROFILE_OPTION
        if not gbps or self.stats.step_source != "compiled" or self.mesh.devices.flat[0].platform != "gpu" or len(set(node_of)) < 2:
            return
        if option in xla_options.user_set_flags():
            self._network_note = f"--network-gbps {gbps:g}: not applied, XLA_FLAGS sets {option} (yours wins)"
            return
        costs = network_schedule.collective_costs(self.stats.hlo_texts[0], node_of, gbps)
        if not costs:
            return
        self.compiler_options = {**self.compiler_options, option: network_schedule.written_profile(costs)}
        self._compiled = self._jitted = None
        with network_schedule.profile_warnings_dropped():
            self._compile_step()
        self._check_step_fits(self.stats)
        self._network_note = (
            f"--network-gbps {gbps:g}: XLA scheduled the step knowing its {len(costs)} collective(s) across hosts "
            f"take {sum(costs.values()) / 1e3:.1f} ms at that rate"
        )

    def _check_step_fits(self, stats: CompileStats) -> None:
        memory_fit.check_step_fits(
            stats.memory,
            self.strategy,
            self.mesh.devices.shape,  # before the first step
            stronger_remat=models.stronger_remat(self.config),
            gather_layers=self.layer_gather is None and self._per_layer_possible,
        )

    def _may_gather_layers(self) -> bool:
        """Whether --fsdp-gather auto may still switch this step to per-layer gathers (the same on every process:
        it reads only the job's settings and the model)."""
        return self.config.fsdp_gather == "auto" and self.layer_gather is None and self._per_layer_possible

    def _gather_layers_instead(self) -> None:
        """--fsdp-gather auto, once XLA's placement of the gathers did not fit on some process of the job (or the
        step store holds this step with per-layer gathers, which an earlier identical run found it needs):
        per-layer gathers from now on (fewer bytes held, more gathered), said in the progress output and the
        report's notes."""
        self.layer_gather = self._new_layer_gather()
        where = "" if jax.process_count() == 1 else " on some process of the job"
        self._gather_note = (
            f"--fsdp-gather auto: the step did not fit with XLA's placement of the gathers{where}, so each layer "
            "gathers its weights just before it runs and again in the backward (less memory, more gather traffic)"
        )
        print(f"[train] {self._gather_note}", file=sys.stderr, flush=True)
        self.__dict__.pop("_keyed_store", None)  # the step's key names the placement
        self._compiled = self._jitted = None

    def make_mesh(self, mesh_shape: Tuple[int, int], axis_names: Tuple[str, str]) -> Mesh:
        """The step's mesh: of this process's devices (a planner compiling for GPUs it does not have
        gives their description instead)."""
        return make_mesh(mesh_shape, axis_names)

    def compile_step(self, with_initializer: bool = True) -> CompileStats:
        """The step for auto search's candidates, its initialiser compiling beside it (every candidate
        that fits is initialised and timed next) unless `with_initializer` is off (its state then comes
        from state_like). Through JAX's cache, not the step store: only the winner is put in the store
        (keep_step)."""
        self._hits_before = compile_cache.hits() if self.stats.compile_cache_dir else 0
        if with_initializer and self._init_compiled is None:  # beside the step, as compile() does
            self._start_init_compile()
        return self._compile_step(use_store=False)

    def state_like(self, state: TrainState) -> TrainState:
        """Another engine's state of the same model and optimizer moved into this engine's shardings, or of a
        deeper copy of it (auto's shallow copies): its leaves that this state's tree names, with the same
        shapes (the shell and the first layers). An initialiser compiles for one sharding and one depth; a
        reshard costs far less than compiling another. ValueError where the trees do not match."""
        source = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state)}
        wanted = jax.tree_util.tree_leaves_with_path(self.abstract_state)
        moved = []
        for path, abstract in wanted:  # each abstract leaf carries this engine's sharding for it
            leaf = source.get(jax.tree_util.keystr(path))
            if leaf is None or leaf.shape != abstract.shape or leaf.dtype != abstract.dtype:
                raise ValueError(f"the given state has no {abstract.dtype}{list(abstract.shape)} at {jax.tree_util.keystr(path)}")
            # A copy even where the shardings match: each engine's step donates (deletes) the state it is given.
            moved.append(jax.device_put(leaf, abstract.sharding, may_alias=False))
        return jax.tree_util.tree_structure(self.abstract_state).unflatten(moved)

    def _compile_step(self, use_store: bool = True) -> CompileStats:
        abstract_batch = self._abstract_batch()
        start = time.perf_counter()
        store = self._step_store() if use_store else None
        loaded = (
            store.load(
                jax.tree_util.tree_structure(((self.abstract_state, abstract_batch), {})),
                jax.tree_util.tree_structure((self.abstract_state, 0.0)),
            )
            if store
            else None
        )
        if loaded is not None:  # a previous identical run's step: no tracing, lowering or compiling
            self._compiled, saved = loaded
            self._jitted = self._compiled
            self.stats.flops_per_step = saved.get("flops_per_step")
            self.stats.causal_attention_flops_per_step = saved.get("causal_attention_flops_per_step")
            self.stats.step_source = "stored"
            if self.layer_gather is not None:  # what the trace that compiled it found: no trace here
                self.layer_gather.gathered_layers = saved.get("gathered_layers", 0)
                self.layer_gather.under_own_remat = saved.get("under_own_remat", False)
            self.stats.step_loaded_ahead = store.loaded_ahead
            told = saved.get("network_schedule")  # what XLA was told of the network, and the report says
            if told:
                self.compiler_options, self._network_note = told["options"], told["note"]
        else:
            self._drop_state_ahead()  # a stored step that did not load: compile with the device's memory free
            if self._lowered_ahead is not None:
                jitted, lowered = self._lowered_ahead
                self._lowered_ahead = None
            else:
                jitted, lowered = self._lower(self._step_name(store), abstract_batch)
            # Not into JAX's cache where the step store keeps it, nor for auto's candidates: only the
            # winner is kept (keep_step), and writing every loser would lengthen the search.
            with compile_cache.writes_skipped() if store or not use_store else contextlib.nullcontext():
                self._compiled = lowered.compile()
            # Steps go through `jitted`: its C++ dispatch path costs less per call than calling the
            # Compiled object from Python, and its cache already holds this
            # executable, so the first call does not compile again (the report's
            # backend_compiles_during_loop proves it). put_batch() refuses any other batch shape.
            self._jitted = jitted
            self.stats.step_source = "compiled"
            self._store = store
        self.stats.compile_seconds += time.perf_counter() - start
        self.stats.compiles += 1
        self._count_cache_hits()  # the step's; init_state() adds the initialiser's
        compiled = self._compiled
        self.stats.hlo_later(lambda: [compiled.as_text() or ""])
        self.stats.memory = jax_program.memory_analysis(self._compiled)
        return self.stats

    def lower_step(self) -> None:
        """Trace and lower auto's candidate step now (Python, under the GIL) so that its compile_step()
        only compiles: the search lowers the next candidates while the first one's XLA compile runs."""
        start = time.perf_counter()
        self._lowered_ahead = self._lower(self._step_name(), self._abstract_batch())
        self.stats.compile_seconds += time.perf_counter() - start

    def _abstract_batch(self) -> Dict[str, jax.ShapeDtypeStruct]:
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_sharding) for k, v in self._example.items()}

    def _step_name(self, store: Optional[StepStore] = None) -> str:
        """The step store's name for this step wherever a store could keep it, auto's candidates
        included: keep_step() may serialise a candidate, and one JAX loaded from its own cache (an
        entry an older kit wrote under a shared name) serialises into a step that fails to run."""
        store = store or self._step_store()
        return store.step_name if store else "train_step"

    def _lower(self, name: str, abstract_batch):
        options = {"compiler_options": self.compiler_options} if self.compiler_options else {}
        jitted = jax.jit(
            _named(self._train_step, name),
            in_shardings=(self.state_sharding, self.batch_sharding),
            out_shardings=(self.state_sharding, NamedSharding(self.mesh, PartitionSpec())),
            donate_argnums=(0,),
            **options,
        )
        with self.activation_layout():
            lowered, count = _lower_and_count(jitted, self.model.causal_attention, self.abstract_state, abstract_batch)
        self.stats.flops_per_step = count.total if count else None
        self.stats.causal_attention_flops_per_step = count.causal_attention if count else None
        return jitted, lowered

    def _step_store(self) -> Optional[StepStore]:
        return self._keyed_store

    @functools.cached_property
    def _keyed_store(self) -> Optional[StepStore]:
        """The step store for this engine's step key, built once (the key hashes the kit's source)."""
        if not self.stats.compile_cache_dir or not StepStore.supported():
            return None
        return self._store_for(per_layer=self.layer_gather is not None)

    def _store_for(self, per_layer: bool) -> StepStore:
        return store_for(self.stats.compile_cache_dir, self.config, self._horizon, self.strategy, self.mesh, self._example, per_layer)

    def keep_step(self) -> None:
        """Put the step compiled by compile_step() in the step store (auto search's winner), so an
        identical run that reuses the search loads it instead of compiling."""
        store = self._step_store()
        if store is not None and self._compiled is not None and self._store is None:
            self._store = store
            self._store_step()

    def _store_step(self) -> None:
        if self._store is not None:
            self._store.save_in_background(
                self._compiled,
                {
                    "flops_per_step": self.stats.flops_per_step,
                    "causal_attention_flops_per_step": self.stats.causal_attention_flops_per_step,
                    **self._gathers_traced(),
                    "network_schedule": {"options": self.compiler_options, "note": self._network_note} if self._network_note else None,
                },
            )

    def _gathers_traced(self) -> Dict[str, Any]:
        """What the step's trace found of its per-layer gathers, kept beside a stored step for the report."""
        gather = self.layer_gather
        return {} if gather is None else {"gathered_layers": gather.gathered_layers, "under_own_remat": gather.under_own_remat}

    def finish(self, out_dir: str) -> None:
        if self._store is not None:
            self._store.wait()

    def peak_memory_bytes(self) -> Optional[int]:
        peaks = []
        for device in jax.local_devices():
            try:
                stats = device.memory_stats() or {}
            except Exception:  # noqa: BLE001 - CPU and some runtimes keep no allocator statistics
                stats = {}
            if "peak_bytes_in_use" in stats:
                peaks.append(int(stats["peak_bytes_in_use"]))
        return max(peaks) if peaks else None

    def put_batch(self, batch: Dict[str, np.ndarray]) -> Dict[str, jax.Array]:
        """A host batch onto the mesh: this process's rows of the global batch (what the input pipeline
        reads), or the whole global batch, of which each process hands over only its own rows."""
        processes = jax.process_count()
        rows = len(batch["mask"])
        global_rows = self._example["mask"].shape[0]
        for key, expected in self._example.items():
            shape = batch[key].shape
            if shape[1:] != expected.shape[1:] or shape[0] not in (global_rows, global_rows // processes):
                raise KitError(
                    f"batch field {key!r} has shape {shape}, the step was compiled for "
                    f"{expected.shape}; a new shape means a second compile - keep batches fixed-size "
                    "(--drop-remainder or --pad-remainder)"
                )
        if processes == 1:
            return jax.device_put(batch, self.batch_sharding)
        if rows == global_rows:
            local = global_rows // processes
            lo = jax.process_index() * local
            batch = {k: v[lo : lo + local] for k, v in batch.items()}
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, v, self._example[k].shape) for k, v in batch.items()}

    def eval_sums(self, state: TrainState, batch: Dict[str, jax.Array]):
        """(loss sum, real rows) of a placed batch, in inference mode; compiled once, on first use."""
        if getattr(self, "_eval_jitted", None) is None:
            model = self.model
            if self.pipeline is not None:
                self._eval_jitted = jax.jit(lambda st, b: self.pipeline.eval_sums(st.params, b))
            else:
                self._eval_jitted = jax.jit(lambda st, b: model.eval_sums(st.params, st.batch_stats, b))
        with self.activation_layout():  # traced on the first call
            return self._eval_jitted(state, batch)

    @contextlib.contextmanager
    def activation_layout(self):
        """While tracing: activations a model names with api.constrain are pinned to this strategy's
        layout (its record's activation_rules), resolved like the parameters' (resolve_spec); under
        --precision fp8 the products of api.dot_general run in fp8 (engines/fp8.py)."""

        def pin(x, axes):
            spec = resolve_spec(PartitionSpec(*axes), x.shape, self.activation_rules, self.mesh)
            return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

        # A pipeline's step runs under shard_map, where each device's layout is explicit: nothing to pin.
        token = api._ACTIVATION_LAYOUT.set(pin if self.pipeline is None else None)
        products = []  # the products traced in fp8, counted
        if self.config_precision == "fp8":
            from alpa_job.engines import fp8

            def matmul(*args, **kwargs):
                products.append(1)
                return fp8.dot_general(*args, **kwargs)
        else:
            matmul = None
        matmul_token = api._MATMUL.set(matmul)
        try:
            yield
        finally:
            api._ACTIVATION_LAYOUT.reset(token)
            api._MATMUL.reset(matmul_token)
        if matmul is not None and not products:
            raise KitError(
                f"--precision fp8: --model {self.model.name} has no dense layer whose product the kit can "
                "run in fp8; give its layers dot_general=alpa_job.api.dot_general, or drop --precision fp8"
            )

    def step(self, state: TrainState, batch: Dict[str, jax.Array]):
        if self._compiled is None:
            raise RuntimeError("compile() before step()")
        return self._jitted(state, batch)

    def to_floats(self, values: List[jax.Array]) -> List[float]:
        return [float(x) for x in jax.device_get(values)]  # one host sync for the lot

    def wait(self, state: TrainState) -> None:
        jax.block_until_ready(state)

    def watch_compiles(self) -> Callable[[], int]:
        """Counts XLA backend compiles from now on (proves the loop never recompiles)."""
        counter = [0]

        def listener(event: str, *_args: Any, **_kwargs: Any) -> None:
            if "backend_compile" in event:
                counter[0] += 1

        jax.monitoring.register_event_duration_secs_listener(listener)
        return lambda: counter[0]

    # ----- the plan ----------------------------------------------------------------------------
    def plan(self) -> plan_model.ParallelPlan:
        state_shardings = self.state_sharding
        if self._compiled is not None:  # what XLA actually chose for the output state
            state_shardings = self._compiled.output_shardings[0]
        leaves = jax_program.plan_leaves(self.abstract_state, state_shardings, self.mesh)
        # A pipeline reads its rows split over every device, and computes each data-parallel slot's rows on
        # all its stages: the plan shows the latter, so the blocks' split over stages reads as model parallel.
        computed = self.batch_sharding if self.pipeline is None else NamedSharding(self.mesh, PartitionSpec("data"))
        batch = jax_program.plan_leaves(self._example, jax.tree_util.tree_map(lambda _: computed, self._example), self.mesh, prefix="batch")
        return jax_program.build_plan(self.mesh, leaves, batch)

    def topology(self) -> Dict[str, Any]:
        return {
            "mesh": {"shape": list(self.mesh.devices.shape), "axes": list(self.mesh.axis_names)},
            "process": {"id": jax.process_index(), "count": jax.process_count(), "local_devices": [str(d) for d in jax.local_devices()]},
            "devices": {"count": jax.device_count(), "platform": jax.devices()[0].platform, "kind": jax.devices()[0].device_kind},
        }

    def notes(self) -> List[str]:
        said = [note for note in (self._gather_note, self._network_note) if note]
        return list(self._notes) + self._precision_notes + said

    def extra_report(self) -> Dict[str, Any]:
        out = {"search": self.search_table, "compiler_options": self.compiler_options or None, "network_traffic": self.network_traffic()}
        if self.strategy_record.gathers_layers:
            out["weight_gather"] = self._weight_gather()
        if self.pipeline is not None:
            rows = self.mesh.devices  # (stage, data): a stage's devices are a row
            out["pipeline"] = self.pipeline.describe([sorted({d.process_index for d in row}) for row in rows])
        return out

    def network_traffic(self) -> Optional[Dict[str, Any]]:
        """What one train step sends per device within its host and across hosts: the compiled step's
        collectives, their replica groups read from its HLO, each device's host its JAX process (one a
        node). None before the step is compiled."""
        if not self.stats.hlo_texts:
            return None
        node_of = self._device_hosts()
        rows = traffic.step_traffic(self.stats.hlo_texts[0], len(node_of), jax.local_device_count(), node_of)
        return {"hosts": len(set(node_of)), **traffic.summary(rows)}

    def _device_hosts(self) -> List[int]:
        """Each mesh device's host, in the mesh's order: its JAX process (one a node)."""
        return [d.process_index for d in self.mesh.devices.flat]

    # ----- checks that turn XLA errors into one-line fixes ---------------------------------------
    def _check_batch_rows_per_process(self) -> None:
        """Each process reads only its own share of the batch (the input pipeline's Shard), so its
        devices must hold exactly those rows: a mesh whose data-parallel size does not split into the
        processes would need rows another process read."""
        processes = jax.process_count()
        if processes == 1:
            return
        rows = self._example["mask"].shape[0]
        share = rows // processes
        for process, span in sorted(rows_by_process(self.batch_sharding, rows).items()):
            if span != (process * share, (process + 1) * share):
                data = axis_size(self.mesh, self.batch_axis)
                raise KitError(
                    f"{self.strategy} on mesh {tuple(self.mesh.devices.shape)}: its data-parallel size "
                    f"{data} does not give each of the {processes} processes its own rows of the batch "
                    f"(process {process}'s devices hold rows {span[0]}-{span[1] - 1}); use a mesh whose "
                    f"data-parallel size is a multiple of {processes} (a smaller --model-parallel)"
                )

    def _check_batch_divisible(self, batch: Dict[str, np.ndarray]) -> None:
        check_batch_split(len(batch["mask"]), axis_size(self.mesh, self.batch_axis))


def rows_by_process(sharding: NamedSharding, global_rows: int) -> Dict[int, Tuple[int, int]]:
    """{process: (first row, end row)} of the batch rows its devices hold under `sharding`."""
    spans: Dict[int, Tuple[int, int]] = {}
    for device, index in sharding.devices_indices_map((global_rows,)).items():
        lo, hi, _ = index[0].indices(global_rows)
        old = spans.get(device.process_index, (lo, hi))
        spans[device.process_index] = (min(old[0], lo), max(old[1], hi))
    return spans


def _named(fn: Callable, name: str) -> Callable:
    """`fn` under another name (jit names the XLA module, hence JAX's cache entry, after it)."""

    def step(state, batch):
        return fn(state, batch)

    step.__name__ = step.__qualname__ = name
    return step


def axis_size(mesh: Mesh, mesh_axes) -> int:
    """The number of ways `mesh_axes` (one mesh axis or several together) split a dimension."""
    return int(np.prod([mesh.shape[a] for a in axes_of(mesh_axes)]))


def resolve_spec(logical: PartitionSpec, shape: Tuple[int, ...], rules, mesh: Mesh, major_first: bool = False) -> PartitionSpec:
    """Map a leaf's logical axis names to mesh axes: rules in order, each mesh axis used once,
    and only where the dimension divides evenly (a dim no mesh size divides stays whole, e.g.
    10 classes or 4 heads on 8 devices) - so every strategy compiles for every model.
    `major_first`: a mesh axis goes to the outermost dimension any of its rules names
    (Strategy.major_dimension_first says why), not to the earliest rule's."""
    names = list(logical) + [None] * (len(shape) - len(logical))
    assigned: list = [None] * len(shape)
    used = set()
    for logical_name, mesh_axis in rules:
        size = axis_size(mesh, mesh_axis)
        if used.intersection(axes_of(mesh_axis)) or size == 1:
            continue
        wanted = {n for n, axis in rules if axis == mesh_axis} if major_first else {logical_name}
        for dim, name in enumerate(names):
            if name in wanted and assigned[dim] is None and shape[dim] % size == 0:
                assigned[dim] = mesh_axis
                used.update(axes_of(mesh_axis))
                break
    return PartitionSpec(*assigned)


def _lower_and_count(jitted, causal_attention: bool, *args) -> Tuple[Any, Optional[flops.FlopCount]]:
    """(the lowered step, its model FLOPs): counted on the jaxpr (engines/flops.py says why), causal attention's
    part found where the model declares it (`causal_attention`); jax without `.trace` (0.4.13 on Python 3.9)
    falls back to the lowered module's cost analysis, which cannot tell attention apart."""
    if hasattr(jitted, "trace"):
        traced = jitted.trace(*args)
        return traced.lower(), flops.step_count(traced, causal_attention)
    lowered = jitted.lower(*args)
    try:
        cost = lowered.cost_analysis()
    except Exception:  # noqa: BLE001 - not every backend implements it
        return lowered, None
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    count = (cost or {}).get("flops")
    return lowered, flops.FlopCount(float(count)) if count and count > 0 else None
