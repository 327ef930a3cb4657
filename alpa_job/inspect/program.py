"""`plan_of`: the run record of any JAX program, for users who keep their own training script.

Give it a jitted function with example arguments (arrays, or `jax.ShapeDtypeStruct`s with shardings),
its `.lower(...)`, or its `.lower(...).compile()`; it reads the compiled program's shardings into the
same record a training run writes -- per-leaf DP / ZeRO / MP / MP+ZeRO / replicated labels, the mesh,
the collectives in the compiled HLO, XLA's memory analysis -- which `write_report` renders as
report.json, report.md and report.html. jax is imported inside the functions: `inspect` stays light.
"""

from __future__ import annotations

import re
import socket
import time
from typing import Any, List, Optional, Sequence, Tuple

from alpa_job.errors import KitError
from alpa_job.record import jax_program
from alpa_job.record.hlo import count_collectives
from alpa_job.record.plan import STRATEGY_LABELS, ParallelPlan
from alpa_job.record.report_file import created_now
from alpa_job.record.run_record import Collective, DeviceInfo, MemoryRecord, MeshShape, ProcessInfo, RunRecord

WHAT_TO_PASS = "pass a jax.jit-ed function with example arguments, its .lower(...), or its .lower(...).compile()"


def plan_of(
    program: Any, *example_args: Any, mesh: Any = None, state_argnums: Sequence[int] = (0,), names: Optional[Sequence[str]] = None
) -> RunRecord:
    """The run record of a JAX program: its plan (per-leaf labels), mesh, collectives and memory.

    - `program`: a `jax.jit`-ed function (then `example_args` are its arguments), or its `Lowered`
      or `Compiled` form (then no arguments: the program already knows them).
    - `mesh`: the `jax.sharding.Mesh` it runs on; by default the one its NamedShardings name.
    - `state_argnums`: the arguments that are the train state (the other arguments are the batch,
      whose row split decides DP vs ZeRO). A state whose tree names `params` and `opt_state` (a
      flax TrainState, a dict) is grouped under those names in the report.
    - `names`: one path prefix per positional argument, e.g. ("params", "opt_state", "batch") for
      `step(params, opt_state, batch)` with state_argnums=(0, 1). By default a single state argument
      keeps its own paths, several are arg0/..., arg1/...; the others are batch/... (batch2/... where
      several).
    """
    compiled, seconds = _compile(program, example_args)
    (args_info, kwargs_info) = compiled.args_info
    (arg_shardings, kwarg_shardings) = compiled.input_shardings
    mesh = mesh if mesh is not None else _find_mesh(compiled, example_args)
    state_args = _state_argnums(state_argnums, len(args_info))
    prefixes = _prefixes(names, len(args_info), state_args)
    state, batch = [], []
    for i, (info, sharding) in enumerate(zip(args_info, arg_shardings)):
        prefix = prefixes[i] or ("" if not _is_arg_info(info) else f"arg{i}")  # a lone array needs a name
        leaves = jax_program.plan_leaves(info, sharding, mesh, prefix=prefix, is_leaf=_is_arg_info)
        (state if i in state_args else batch).extend(leaves)
    batch.extend(jax_program.plan_leaves(kwargs_info, kwarg_shardings, mesh, is_leaf=_is_arg_info))
    plan = jax_program.build_plan(mesh, state, batch)
    return _record(compiled, plan, mesh, seconds)


def _compile(program: Any, example_args: Tuple[Any, ...]) -> Tuple[Any, Optional[float]]:
    """(the Compiled program, seconds spent compiling it here; None when it came compiled)."""
    import jax

    if isinstance(program, jax.stages.Compiled):
        _no_arguments(example_args, "compiled program")
        return program, None
    start = time.perf_counter()
    if isinstance(program, jax.stages.Lowered):
        _no_arguments(example_args, "lowered program")
        compiled = program.compile()
    elif callable(program) and hasattr(program, "lower"):
        if not example_args:
            raise KitError(
                "plan_of(step) needs the step's example arguments (arrays or jax.ShapeDtypeStructs "
                "with shardings): plan_of(step, state, batch)"
            )
        compiled = program.lower(*example_args).compile()
    else:
        raise KitError(f"plan_of got a {type(program).__name__}; {WHAT_TO_PASS}")
    return compiled, round(time.perf_counter() - start, 3)


def _no_arguments(example_args: Tuple[Any, ...], what: str) -> None:
    if example_args:
        raise KitError(
            f"plan_of: a {what} already has its arguments; pass example arguments only with the "
            "jitted function itself: plan_of(step, state, batch)"
        )


def _is_arg_info(x: Any) -> bool:
    return type(x).__name__ == "ArgInfo"


def _find_mesh(compiled: Any, example_args: Tuple[Any, ...]):
    """The mesh the program's NamedShardings name: its inputs', its example arguments', its outputs'."""
    import jax

    trees = (
        compiled.input_shardings,
        jax.tree_util.tree_map(lambda a: getattr(a, "sharding", None), example_args),
        compiled.output_shardings,
    )
    devices = set()
    for tree in trees:
        for _path, sharding in jax_program.flatten(tree, is_leaf=lambda x: x is None or hasattr(x, "device_set")):
            if getattr(getattr(sharding, "mesh", None), "devices", None) is not None:
                return sharding.mesh
            devices |= set(getattr(sharding, "device_set", ()) or ())
    if len(devices) == 1:  # a one-device program: nothing is split
        import numpy as np

        return jax.sharding.Mesh(np.asarray(list(devices)), ("devices",))
    raise KitError("plan_of: the program's shardings name no mesh; pass mesh= the jax.sharding.Mesh it runs on")


def _state_argnums(state_argnums: Sequence[int], count: int) -> Tuple[int, ...]:
    numbers = (state_argnums,) if isinstance(state_argnums, int) else tuple(state_argnums)
    for n in numbers:
        if not isinstance(n, int) or not -count <= n < count:
            raise KitError(
                f"plan_of: state_argnums={state_argnums!r} names no argument of a program with {count}; "
                f"pass positions from 0 to {count - 1}"
            )
    return tuple(n % count for n in numbers)


def _prefixes(names: Optional[Sequence[str]], count: int, state_args: Tuple[int, ...]) -> List[str]:
    if names is not None:
        if isinstance(names, str) or len(names) != count:
            raise KitError(
                f'plan_of: names={names!r} needs one name per positional argument ({count}); e.g. names=("params", "opt_state", "batch")'
            )
        return [str(n) for n in names]
    batch_args = [i for i in range(count) if i not in state_args]
    return [
        ("" if len(state_args) == 1 else f"arg{i}") if i in state_args else ("batch" if len(batch_args) == 1 else f"batch{i}")
        for i in range(count)
    ]


def strategy_name(plan: ParallelPlan) -> str:
    """The plan in a word: the labels its parameters carry (all its state's where none is under params/)."""
    leaves = [leaf for leaf in plan.leaves if leaf.path.startswith("params/")] or list(plan.leaves)
    found = {plan.strategy_of(leaf) for leaf in leaves}
    return ", ".join(label for label in STRATEGY_LABELS if label in found) or "no state"


def _program_name(hlo_text: str) -> str:
    """The jitted function's name, as XLA names the module ('jit_train_step' -> 'train_step')."""
    match = re.match(r"\s*HloModule\s+([^\s,]+)", hlo_text or "")
    name = match.group(1) if match else "program"
    return name[len("jit_") :] if name.startswith("jit_") and len(name) > len("jit_") else name


def _record(compiled: Any, plan: ParallelPlan, mesh: Any, seconds: Optional[float]) -> RunRecord:
    import jax

    from alpa_job import versions

    text = compiled.as_text()
    name = _program_name(text)
    first = mesh.devices.flat[0]
    process = ProcessInfo(
        id=jax.process_index(),
        count=jax.process_count(),
        host=socket.gethostname(),
        local_devices=[str(d) for d in mesh.devices.flat if getattr(d, "process_index", 0) == jax.process_index()],
    )
    record = RunRecord(
        engine="jax",
        strategy=strategy_name(plan),
        mesh=MeshShape(shape=list(mesh.devices.shape), axes=list(mesh.axis_names)),
        meshes=plan.mesh_records(),
        params=plan.leaf_records(),
        batch_sharding=plan.batch_records(),
        compiles=1,
        compile_seconds=seconds,
        collectives=None if text is None else Collective.table(count_collectives(text)),
        memory=MemoryRecord.from_xla(jax_program.memory_analysis(compiled)),
        process=process,
        processes=[process],
        devices=DeviceInfo(count=int(mesh.devices.size), platform=first.platform, kind=first.device_kind),
        versions=versions.collect(),
        config={"model": name},
        created=created_now(),
        source=f"jax program {name} (plan_of)",
    )
    record.summary = record.summarize()
    return record
