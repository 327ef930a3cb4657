"""Write Alpa `dump_debug_info` fixture folders from REAL Alpa / jax / flax / optax objects.

Runs ONLY in the Python 3.9 venv pinned by requirements/alpa-fixtures-py39.txt:

    .venv39/bin/python tests/alpa_fixtures/make_dumps.py [OUT_DIR]   # default: this folder

What is real here:
  * `PlacementSpec` is Alpa 0.2.3's own class, loaded from the installed `alpa/parallel_plan.py`
    (`import alpa` itself cannot work on these machines; that one file only needs jax).
  * `ShardingSpec` / `Chunked` / `NoSharding` / `ShardedAxis` / `Replicated` are jax 0.4.13's
    `jax.interpreters.pxla` classes, i.e. the classes Alpa uses.
  * The ShardingSpec of every leaf is produced by Alpa 0.2.3's own conversion
    `_hlo_sharding_to_sharding_spec_no_tuple` (+ `check_arithmetic_sequence`), whose source is
    taken from the installed package with `ast` and fed an HLO-sharding-like proto built from
    the intended placement (which tensor dim is tiled over which logical mesh axis) -- so the
    order of `mesh_mapping`, `Replicated(...)` entries and the `Chunked(a,b)` special case are
    exactly Alpa's.
  * The pytrees are real: a flax 0.6.2 `TrainState` (params from `Module.init`, opt_state from
    `optax` init), the batch dict, and the (state, metrics) output; the placement specs are put
    in with `tree_unflatten` exactly like Alpa's `get_input_placement_specs()`; the files are
    written the way alpa 0.2.3's `dump_debug_info` writes them (`f.write(str(tree))`).

What is synthetic (documented deviations):
  * `tx` (a static field that gets printed) is replaced by a `GradientTransformation` whose
    functions print with fixed addresses, so the output is byte-for-byte reproducible.
  * Stage HLO text and `mem_usage` numbers are written from templates (no Alpa compile can run
    here): HLO in the Alpa-0.2.3-era syntax, with collectives derived from the placements.

Every leaf's intended strategy label is computed here from the construction (never by
running the kit's parser) and written to `expected.json`.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

warnings.filterwarnings("ignore")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import flax.linen as nn  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.interpreters import pxla  # noqa: E402
from jax._src.lib import xla_client as xc  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# ----------------------------------------------------------------------------- real Alpa code
def _alpa_dir() -> str:
    spec = importlib.util.find_spec("alpa")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("alpa is not installed in this interpreter (see requirements/alpa-fixtures-py39.txt)")
    return list(spec.submodule_search_locations)[0]


def _load_parallel_plan():
    path = os.path.join(_alpa_dir(), "parallel_plan.py")
    spec = importlib.util.spec_from_file_location("alpa_parallel_plan", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _alpa_function(relpath: str, name: str, namespace: Dict[str, Any]):
    """Compile one top-level function of an installed alpa module, by its source."""
    path = os.path.join(_alpa_dir(), relpath)
    with open(path) as f:
        src = f.read()
    for node in ast.parse(src).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            code = ast.get_source_segment(src, node)
            exec(compile(code, f"{path}:{name}", "exec"), namespace)  # noqa: S102
            return namespace[name]
    raise SystemExit(f"{name} not found in {path}")


PP = _load_parallel_plan()
PlacementSpec = PP.PlacementSpec
_NS: Dict[str, Any] = {"np": np, "pxla": pxla, "xc": xc, "ShapedArray": jax.core.ShapedArray, "Sequence": Sequence}
_NS["check_arithmetic_sequence"] = _alpa_function("util.py", "check_arithmetic_sequence", _NS)
alpa_hlo_sharding_to_spec = _alpa_function("shard_parallel/auto_sharding.py", "_hlo_sharding_to_sharding_spec_no_tuple", _NS)


class _Proto:
    """The three fields of an xla OpSharding proto that Alpa's conversion reads."""

    def __init__(self, type_, dims=(), devices=()):
        self.type = type_
        self.tile_assignment_dimensions = list(dims)
        self.tile_assignment_devices = list(devices)


class _LogicalMesh:
    def __init__(self, shape):
        self.shape = tuple(shape)


def sharding_spec(aval, mesh_shape: Tuple[int, ...], dim_axes: Dict[int, Tuple[int, ...]]):
    """The ShardingSpec Alpa reports for `aval` tiled as {tensor dim: logical mesh axes}.

    Builds the tile assignment XLA's auto-sharding produces (device ids = arange over the
    logical mesh, row-major; split axes in tensor-dim order, then the remaining axes as the
    replicated last tile dim) and converts it with Alpa's own function.
    """
    assert all(0 <= d < len(aval.shape) for d in dim_axes), (aval, dim_axes)
    id_mesh = np.arange(int(np.prod(mesh_shape))).reshape(mesh_shape)
    used = [a for d in sorted(dim_axes) for a in dim_axes[d] if mesh_shape[a] > 1]
    if not used:
        return alpa_hlo_sharding_to_spec(_Proto(xc.OpSharding.Type.REPLICATED), aval, _LogicalMesh(mesh_shape))
    rest = [a for a in range(len(mesh_shape)) if a not in used]
    devices = id_mesh.transpose(used + rest).flatten()
    dims = []
    for d in range(len(aval.shape)):
        n = 1
        for a in dim_axes.get(d, ()):
            n *= mesh_shape[a]
        dims.append(n)
    repl = int(np.prod([mesh_shape[a] for a in rest])) if rest else 1
    if repl > 1:
        dims.append(repl)
    return alpa_hlo_sharding_to_spec(_Proto(xc.OpSharding.Type.OTHER, dims, devices.tolist()), aval, _LogicalMesh(mesh_shape))


class _FixedFn:
    """A function stand-in that prints like `<function chain.<locals>.init_fn at 0x...>`."""

    def __init__(self, qualname: str, addr: int):
        self.qualname, self.addr = qualname, addr

    def __call__(self, *a, **k):  # pragma: no cover - never called
        raise NotImplementedError

    def __repr__(self):
        return f"<function {self.qualname} at {self.addr:#x}>"


def fixed_tx():
    return optax.GradientTransformation(
        init=_FixedFn("chain.<locals>.init_fn", 0x7F6D305DF160), update=_FixedFn("chain.<locals>.update_fn", 0x7F6D305DF5E0)
    )


# ----------------------------------------------------------------------------- models
class BottleneckResNetBlock(nn.Module):
    filters: int
    strides: Tuple[int, int] = (1, 1)

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = lambda **kw: nn.BatchNorm(use_running_average=not train, **kw)  # noqa: E731
        residual = x
        y = nn.Conv(self.filters, (1, 1), use_bias=False)(x)
        y = norm()(y)
        y = nn.relu(y)
        y = nn.Conv(self.filters, (3, 3), self.strides, use_bias=False)(y)
        y = norm()(y)
        y = nn.relu(y)
        y = nn.Conv(self.filters * 4, (1, 1), use_bias=False)(y)
        y = norm(scale_init=nn.initializers.zeros)(y)
        if residual.shape != y.shape:
            residual = nn.Conv(self.filters * 4, (1, 1), self.strides, use_bias=False, name="conv_proj")(residual)
            residual = norm(name="norm_proj")(residual)
        return nn.relu(residual + y)


class WideResNet(nn.Module):
    stage_sizes: Sequence[int]
    num_classes: int
    num_filters: int = 8
    width_factor: int = 1

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(self.num_filters, (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.BatchNorm(use_running_average=not train, name="bn_init")(x)
        x = nn.relu(x)
        for i, n in enumerate(self.stage_sizes):
            for j in range(n):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = BottleneckResNetBlock(self.num_filters * 2**i * self.width_factor, strides)(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


class MLPStack(nn.Module):
    """A GPT-style MLP stack: Dense layers with LayerNorm (the benchmark's pipeline model)."""

    hidden: int
    num_layers: int
    vocab: int

    @nn.compact
    def __call__(self, x):
        x = nn.Embed(self.vocab, self.hidden, name="embed")(x)
        for i in range(self.num_layers):
            h = nn.LayerNorm(name=f"ln_{i}")(x)
            h = nn.Dense(self.hidden * 4, name=f"fc1_{i}")(h)
            h = nn.relu(h)
            x = x + nn.Dense(self.hidden, name=f"fc2_{i}")(h)
        return nn.Dense(self.vocab, name="head")(x)


class TrainState(train_state.TrainState):
    """The TrainState of Alpa's WideResNet benchmark: + batch_stats, dynamic_scale."""

    batch_stats: Any = None
    dynamic_scale: Any = None


# ----------------------------------------------------------------------------- helpers
def key_str(k) -> Optional[str]:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            if type(k).__name__ == "FlattenedIndexKey":
                return None  # FrozenDict's wrapper level
            return str(getattr(k, attr))
    return str(k)


def kit_path(keypath) -> Tuple[int, str]:
    """(argument index, the path the kit uses) for a keypath of the (args...) / outputs tree."""
    parts = [p for p in (key_str(k) for k in keypath) if p is not None]
    return int(parts[0]), "/".join(parts[1:])


def label(split: Sequence[int], batch: Sequence[int]) -> str:
    """The intended label, straight from the strategy definitions (independent of the kit)."""
    split, batch = set(split), set(batch)
    if not split:
        return "DP" if batch else "replicated"
    if split <= batch:
        return "ZeRO"
    if not split & batch:
        return "MP"
    return "MP+ZeRO"


class Placement:
    """Intended placement of one leaf: {mesh id: {tensor dim: logical mesh axes}}."""

    def __init__(self, per_mesh: Dict[int, Dict[int, Tuple[int, ...]]]):
        self.per_mesh = per_mesh

    @property
    def mesh_ids(self):
        return tuple(self.per_mesh)

    def split_axes(self, mesh_id: int, mesh_shape) -> List[int]:
        return [a for axes in self.per_mesh[mesh_id].values() for a in axes if mesh_shape[a] > 1]


def on(mesh_id: int, **dims) -> Placement:
    """on(0) = replicated on mesh 0; on(0, d1=(1,)) = dim 1 split over logical axis 1."""
    return Placement({mesh_id: {int(k[1:]): tuple(v) for k, v in dims.items()}})


def on_many(*mesh_ids: int) -> Placement:
    return Placement({m: {} for m in mesh_ids})


def placement_tree(tree, rule, meshes: Dict[int, Tuple[int, ...]]):
    """Alpa's `tree_unflatten(in_tree, placement_specs)` with our placements; + intent rows."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    specs, rows = [], []
    for keypath, value in leaves:
        arg, path = kit_path(keypath)
        aval = jax.api_util.shaped_abstractify(value)
        pl = rule(arg, path, aval)
        specs.append(PlacementSpec(aval, tuple(pl.mesh_ids), tuple(sharding_spec(aval, meshes[m], pl.per_mesh[m]) for m in pl.mesh_ids)))
        rows.append((arg, path, pl))
    return jax.tree_util.tree_unflatten(treedef, specs), rows


def write(path: str, text: str):
    with open(path, "w") as f:
        f.write(text)


def reduced_axes(mesh_shape) -> Dict[int, str]:
    """Logical mesh axis -> the axis name the dump shows (index among the axes of size > 1)."""
    names, n = {}, 0
    for a, s in enumerate(mesh_shape):
        if s > 1:
            names[a] = str(n)
            n += 1
    return names


def expected(meshes, in_rows, out_rows, collectives, state_arg=0, extra=None):
    """expected.json from the construction: labels use the OUTPUT placement of state leaves."""
    batch_axes = {m: [] for m in meshes}
    batch = {}
    for arg, path, pl in in_rows:
        if arg == state_arg:
            continue
        for m in pl.mesh_ids:
            for a in pl.split_axes(m, meshes[m]):
                if a not in batch_axes[m]:
                    batch_axes[m].append(a)
    bpath = lambda arg, path: f"batch/{path}"  # noqa: E731  (one batch argument)

    def lab(pl):
        split, b = [], []
        for m in pl.mesh_ids:
            split += pl.split_axes(m, meshes[m])
            b += batch_axes[m]
        return label(split, b)

    for arg, path, pl in in_rows:
        if arg != state_arg:
            batch[bpath(arg, path)] = lab(pl)
    leaves = {path: lab(pl) for arg, path, pl in out_rows if arg == 0}
    in_state = {path for arg, path, _ in in_rows if arg == state_arg}
    assert set(leaves) == in_state, "output state must mirror input state"
    out = {
        "meshes": [
            {"id": m, "shape": [s for s in shape if s > 1], "batch_axes": sorted(reduced_axes(shape)[a] for a in batch_axes[m])}
            for m, shape in sorted(meshes.items())
        ],
        "leaves": leaves,
        "batch": batch,
        "collectives": collectives,
    }
    out.update(extra or {})
    return json.dumps(out, indent=1, sort_keys=True) + "\n"


# ----------------------------------------------------------------------------- HLO templates
DT = {"float32": ("f32", 4), "int32": ("s32", 4)}


def _shape(aval, dims_div: Dict[int, int] = None) -> Tuple[str, int]:
    t, size = DT[str(aval.dtype)]
    dims = [d // (dims_div or {}).get(i, 1) for i, d in enumerate(aval.shape)]
    n = size
    for d in dims:
        n *= d
    layout = "{" + ",".join(str(i) for i in reversed(range(len(dims)))) + "}" if dims else ""
    return f"{t}[{','.join(map(str, dims))}]{layout}", n


def stage_hlo(name: str, ops: List[Tuple[str, Any, Dict[int, int], int]]) -> Tuple[str, Dict]:
    """An Alpa-0.2.3-style optimized HLO module with the given collectives.

    ops: (kind, aval, {dim: divisor} of the RESULT, replica group size). Returns text, counts.
    """
    lines = [
        f"HloModule {name}, input_output_alias={{ {{0}}: (0, {{}}, may-alias) }}",
        "",
        "%add (x: f32[], y: f32[]) -> f32[] {",
        "  %x = f32[] parameter(0)",
        "  %y = f32[] parameter(1)",
        "  ROOT %add = f32[] add(f32[] %x, f32[] %y)",
        "}",
        "",
        f"ENTRY %{name}_spmd (param: f32[16]) -> f32[16] {{",
        "  %param = f32[16]{0} parameter(0)",
    ]
    counts: Dict[str, Dict[str, int]] = {}
    for i, (kind, aval, div, group) in enumerate(ops):
        res, nbytes = _shape(aval, div)
        groups = "{{" + ",".join(str(j) for j in range(group)) + "}}"
        dim = next(iter(div), 0)
        if kind == "reduce-scatter":  # operand: the full gradient; result: this device's shard
            arg, _ = _shape(aval)
        elif kind == "all-gather":  # operand: the shard; result: the gathered array
            arg, _ = _shape(aval, {dim: group})
        else:
            arg = res
        operand = f"%param.{i}"
        lines.append(f"  {operand} = {arg} parameter({i + 1})")
        if kind == "all-reduce":
            lines.append(
                f"  %all-reduce.{i} = {res} all-reduce({arg} {operand}), channel_id={i + 1}, "
                f"replica_groups={groups}, use_global_device_ids=true, to_apply=%add, "
                f'metadata={{op_type="psum" op_name="parallelize(train_step)/jit(main)/psum"}}'
            )
        elif kind == "all-gather":
            lines.append(
                f"  %all-gather.{i} = {res} all-gather({arg} {operand}), channel_id={i + 1}, "
                f"replica_groups={groups}, dimensions={{{dim}}}, use_global_device_ids=true"
            )
        elif kind == "reduce-scatter":
            lines.append(
                f"  %reduce-scatter.{i} = {res} reduce-scatter({arg} {operand}), channel_id={i + 1}, "
                f"replica_groups={groups}, use_global_device_ids=true, dimensions={{{dim}}}, "
                f"to_apply=%add"
            )
        slot = counts.setdefault(kind, {"count": 0, "bytes": 0})
        slot["count"] += 1
        slot["bytes"] += nbytes
    lines += ["  ROOT %copy = f32[16]{0} copy(f32[16]{0} %param)", "}", ""]
    return "\n".join(lines), counts


def merge(*cs):
    out: Dict[str, Dict[str, int]] = {}
    for c in cs:
        for k, v in c.items():
            s = out.setdefault(k, {"count": 0, "bytes": 0})
            s["count"] += v["count"]
            s["bytes"] += v["bytes"]
    return out


def avals_by_path(rows_tree) -> Dict[str, Any]:
    leaves, _ = jax.tree_util.tree_flatten_with_path((rows_tree,))
    return {kit_path(k)[1]: jax.api_util.shaped_abstractify(v) for k, v in leaves if kit_path(k)[0] == 0}


# ----------------------------------------------------------------------------- fixture (a)
def fixture_wide_resnet_dp(out: str):
    """Seed 003's WideResNet dump: shard-parallel, one 1-D mesh (logical (1, 2)), data parallel."""
    mesh = (1, 2)
    model = WideResNet(stage_sizes=[1, 1], num_classes=10, num_filters=4)
    x = jnp.zeros((16, 32, 32, 3), jnp.float32)
    variables = model.init(jax.random.PRNGKey(0), x, train=False)
    tx = optax.sgd(optax.constant_schedule(1e-3), momentum=0.9)
    state = TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=tx, batch_stats=variables["batch_stats"], dynamic_scale=None
    )
    state = state.replace(tx=fixed_tx())
    batch = {"images": x, "labels": jnp.zeros((16,), jnp.int32)}
    metrics = {"accuracy": jnp.float32(0), "loss": jnp.float32(0), "lr": jnp.asarray(1e-3) * 1}

    def rule(inputs: bool):
        def r(arg, path, aval):
            if arg == 1 and inputs:  # batch: images split on the batch dim; labels replicated
                return on(0, d0=(1,)) if path == "images" else on(0)
            if arg == 1:  # metrics
                return on(0)
            if path.startswith("params/"):
                # one input param differs from its output placement: labels come from OUTPUT
                if inputs and path == "params/conv_init/kernel":
                    return on(0, d3=(1,))
                return on(0)
            if path.startswith("opt_state/0/trace/"):  # momentum: ZeRO on kernels and BN bias
                if path.endswith("kernel"):  # conv: input channels; dense: rows
                    return on(0, d2=(1,)) if len(aval.shape) == 4 else on(0, d0=(1,))
                if path.endswith("bias") and "BatchNorm" in path:
                    return on(0, d0=(1,))
                return on(0)
            if path.startswith("batch_stats/"):
                return on(0, d0=(1,))
            return on(0)

        return r

    meshes = {0: mesh}
    in_tree, in_rows = placement_tree((state, batch), rule(True), meshes)
    out_tree, out_rows = placement_tree((state, metrics), rule(False), meshes)
    prefix = os.path.join(out, "train_step_func")
    write(f"{prefix}_input_placement_specs.txt", str(in_tree))
    write(f"{prefix}_output_placement_specs.txt", str(out_tree))
    write(f"{prefix}.mem_usage.txt", f"total_allocation_size: {0.0213:.3f} GB\n")
    av = avals_by_path(state)
    ops = [("all-reduce", av[p], {}, 2) for p in sorted(av) if p.startswith("params/") and "kernel" in p]
    ops += [("reduce-scatter", av[p], {2: 2}, 2) for p in sorted(av) if p.startswith("opt_state/0/trace/") and p.endswith("kernel")]
    ops += [("all-gather", av["params/conv_init/kernel"], {3: 1}, 2)]
    hlo, counts = stage_hlo("train_step_func_shard_parallel", ops)
    write(f"{prefix}.hlo", hlo)
    write(
        os.path.join(out, "expected.json"),
        expected(
            meshes,
            in_rows,
            out_rows,
            counts,
            extra={"kind": "shard_parallel", "prefix": "train_step_func", "memory": {"train_step_func": 0.021}},
        ),
    )


# ----------------------------------------------------------------------------- fixture (b)
def mlp_stack_step_args(num_layers: int):
    """(Adam train state, token batch, metrics) of a small MLPStack LM step, as Alpa sees them."""
    model = MLPStack(hidden=16, num_layers=num_layers, vocab=32)
    tokens = jnp.zeros((8, 12), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    state = state.replace(tx=fixed_tx())
    batch = {"input_ids": tokens, "labels": jnp.zeros((8, 12), jnp.int32)}
    return state, batch, {"loss": jnp.float32(0)}


def fixture_pipeshard_zero(out: str):
    """Pipeshard, two meshes (ids 0 and 1, logical (1, 2) each), Adam state ZeRO-partitioned."""
    meshes = {0: (1, 2), 1: (1, 2)}
    state, batch, metrics = mlp_stack_step_args(num_layers=2)

    def mesh_of(path: str) -> int:  # layer 0 + embed on mesh 0; layer 1 + head on mesh 1
        return 0 if ("_0" in path or "embed" in path) else 1

    def rule(inputs: bool):
        def r(arg, path, aval):
            if arg == 1 and inputs:
                return on(0, d0=(1,)) if path == "input_ids" else on(1, d0=(1,))
            if arg == 1:
                return on(1)
            if path == "step":  # used by the apply-grad stage of both meshes
                return on_many(0, 1) if inputs else on(0)
            if path.endswith("/count"):
                return on(0)
            m = mesh_of(path)
            if path.startswith("params/"):
                if path == "params/head/kernel":  # ZeRO-3 style: the head weight stays split
                    return on(m, d1=(1,))
                return on(m)
            if path.startswith("opt_state/0/mu/") or path.startswith("opt_state/0/nu/"):
                return on(m, d0=(1,)) if aval.shape and aval.shape[0] % 2 == 0 else on(m)
            return on(m)

        return r

    in_tree, in_rows = placement_tree((state, batch), rule(True), meshes)
    out_tree, out_rows = placement_tree((state, metrics), rule(False), meshes)
    prefix = os.path.join(out, "train_step")
    av = avals_by_path(state)
    stage_meshes = [0, 1, 1, 0]  # forward 0, forward 1, backward 1, backward 0 (+ apply_grad fused)
    all_counts, mems = [], []
    for i, m in enumerate(stage_meshes):
        mine = [p for p in sorted(av) if p.startswith("params/") and mesh_of(p) == m]
        if i < 2:  # forward: all-gather the ZeRO-3 head weight
            ops = [("all-gather", av[p], {1: 1}, 2) for p in mine if p == "params/head/kernel"]
        else:  # backward: reduce-scatter grads of ZeRO leaves, all-reduce the rest
            ops = [("reduce-scatter", av[p], {0: 2}, 2) for p in mine if av[p].shape[0] % 2 == 0]
            ops += [("all-reduce", av[p], {}, 2) for p in mine if av[p].shape[0] % 2 != 0]
        ops = ops or [("all-reduce", jax.core.ShapedArray((), jnp.float32), {}, 2)]
        text, counts = stage_hlo(f"train_step_pipeshard_parallel_stage_{i}", ops)
        write(f"{prefix}_stage_{i}.hlo", text)
        mem = [0.004, 0.005, 0.011, 0.009][i]
        write(f"{prefix}_stage_{i}.mem_usage.txt", f"total_allocation_size: {mem:.3f} GB\n")
        all_counts.append(counts)
        mems.append(mem)
    tasks = []
    for shape in ((8, 12, 16),):
        s = jax.core.ShapedArray(shape, jnp.float32)
        src = sharding_spec(s, meshes[0], {0: (1,)})
        dst = sharding_spec(s, meshes[1], {0: (1,)})
        tasks.append(f"ReshardingTask(shape: {shape}, mesh_id: 0->1,\n{src} ->\n{dst})")
    write(f"{prefix}_resharding_tasks.txt", "".join(t + "\n\n" for t in tasks))
    write(f"{prefix}_input_placement_specs.txt", str(in_tree))
    write(f"{prefix}_output_placement_specs.txt", str(out_tree))
    write(
        os.path.join(out, "expected.json"),
        expected(
            meshes,
            in_rows,
            out_rows,
            merge(*all_counts),
            extra={
                "kind": "pipeshard",
                "prefix": "train_step",
                "memory": {f"train_step_stage_{i}": m for i, m in enumerate(mems)},
                "stage_collectives": {f"train_step_stage_{i}": c for i, c in enumerate(all_counts)},
            },
        ),
    )


# ----------------------------------------------------------------------------- fixture (c)
def fixture_mesh2d_mp(out: str):
    """Shard-parallel on a 2-D (2, 2) mesh: batch over axis 0, MP over 1."""
    mesh = (2, 2)
    meshes = {0: mesh}
    state, batch, metrics = mlp_stack_step_args(num_layers=1)

    def rule(inputs: bool):
        def r(arg, path, aval):
            if arg == 1 and inputs:
                return on(0, d0=(0,))  # batch dim over mesh axis 0
            if arg == 1:
                return on(0)
            leaf = path.rsplit("/", 1)[-1]
            layer = path.split("/")[-2] if "/" in path else ""
            is_opt = path.startswith("opt_state/0/mu/") or path.startswith("opt_state/0/nu/")
            if path.startswith("params/") or is_opt:
                if layer.startswith("fc1") and leaf == "kernel":  # column-parallel
                    return on(0, d0=(0,), d1=(1,)) if is_opt else on(0, d1=(1,))
                if layer.startswith("fc2") and leaf == "kernel":  # row-parallel
                    return on(0, d0=(1,), d1=(0,)) if is_opt else on(0, d0=(1,))
                if layer.startswith("fc1") and leaf == "bias":  # split over (1, 0): Chunked(2,2)
                    return on(0, d0=(1, 0))
                if layer == "embed":  # ZeRO-style: split over the batch axis only
                    return on(0, d0=(0,))
                if layer == "head" and leaf == "kernel":  # split 4 ways over (0, 1): Chunked(4)
                    return on(0, d1=(0, 1))
                return on(0, d0=(0,)) if is_opt and aval.shape and aval.shape[0] % 2 == 0 else on(0)
            return on(0)

        return r

    in_tree, in_rows = placement_tree((state, batch), rule(True), meshes)
    out_tree, out_rows = placement_tree((state, metrics), rule(False), meshes)
    prefix = os.path.join(out, "train_step")
    av = avals_by_path(state)
    ops = [
        ("all-reduce", av["params/fc2_0/kernel"], {0: 2}, 2),  # row-parallel output sum
        ("all-gather", av["params/fc1_0/kernel"], {0: 1}, 2),
        ("reduce-scatter", av["params/embed/embedding"], {0: 2}, 2),
        ("all-reduce", av["params/head/bias"], {}, 4),
    ]
    text, counts = stage_hlo("train_step_shard_parallel", ops)
    write(f"{prefix}.hlo", text)
    write(f"{prefix}.mem_usage.txt", f"total_allocation_size: {0.0071:.3f} GB\n")
    write(f"{prefix}_input_placement_specs.txt", str(in_tree))
    write(f"{prefix}_output_placement_specs.txt", str(out_tree))
    write(
        os.path.join(out, "expected.json"),
        expected(
            meshes, in_rows, out_rows, counts, extra={"kind": "shard_parallel", "prefix": "train_step", "memory": {"train_step": 0.007}}
        ),
    )


FIXTURES = {
    "wide_resnet_dp": fixture_wide_resnet_dp,
    "pipeshard_zero": fixture_pipeshard_zero,
    "mesh2d_mp": fixture_mesh2d_mp,
}


def main(argv: List[str]) -> int:
    root = argv[1] if len(argv) > 1 else HERE
    for name, fn in FIXTURES.items():
        out = os.path.join(root, name)
        os.makedirs(out, exist_ok=True)
        fn(out)
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
