"""Read a folder written by Alpa's `executable.dump_debug_info(folder)` into a `ParallelPlan`.

Offline and engine-free: stdlib + `alpa_job.record.plan` only, runs on Python 3.9 and 3.11.

Files read (Alpa 0.2.3 names; `<prefix>` is the function name, e.g. `train_step_func`):
  <prefix>_input_placement_specs.txt / <prefix>_output_placement_specs.txt
      `str()` of the pytree of `alpa.parallel_plan.PlacementSpec` (flax FrozenDict / TrainState /
      optax named tuples / dicts / tuples).
  <prefix>.mem_usage.txt (shard-parallel) or <prefix>_stage_<i>.mem_usage.txt (pipeshard)
      `total_allocation_size: 0.123 GB`
  <prefix>.hlo or <prefix>_stage_<i>.hlo: optimized HLO; collectives counted with `hlo.py`.

Mapping to the plan model:
  * The input tree is the tuple of the train step's arguments; the train state is the argument
    with a `params` field/key (else the first argument); every other argument is batch.
    State leaves keep their field paths: `params/...`, `opt_state/<i>/<field>/...`, `step`,
    `batch_stats/...`. Batch leaves get `batch/...` (`batch<i>/...` when several batch args).
  * State leaves are classified from the OUTPUT specs (the state the step returns), falling back
    to the input spec for a leaf the output lacks.
  * Mesh axes are the positions of a ShardingSpec's `mesh_mapping`, named "0", "1", ... per
    mesh (Alpa drops logical mesh axes of size 1 and orders the rest by device stride). A spec
    with fewer positions than the mesh (e.g. `Replicated(replicas=4)` on a 2x2 mesh, or
    `Chunked(4)` over both axes) is matched to consecutive mesh axes by size.
  * A mesh's batch axes are the axes that split any batch leaf placed on it.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections import Counter
from typing import Any, Dict, List, Optional, Sequence, Tuple

from alpa_job.errors import KitError
from alpa_job.record.hlo import count_collectives, merge_counts
from alpa_job.record.plan import Leaf, Mesh, ParallelPlan, batch_axes_from_leaves

INPUT_SUFFIX = "_input_placement_specs.txt"
OUTPUT_SUFFIX = "_output_placement_specs.txt"

_ITEMSIZE = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


# ============================================================================ printed-pytree AST
@dataclasses.dataclass
class Call:
    """`Name(args..., key=value, ...)`: named tuples, dataclasses, FrozenDict, PlacementSpec."""

    name: str
    args: List[Any]
    kwargs: List[Tuple[str, Any]]  # ordered


@dataclasses.dataclass
class DictNode:
    items: List[Tuple[str, Any]]


@dataclasses.dataclass
class TupleNode:
    items: List[Any]


@dataclasses.dataclass
class ListNode:
    items: List[Any]


@dataclasses.dataclass
class ArrayType:
    """`float32[2,3]` inside ShapedArray(...)."""

    dtype: str
    shape: Tuple[int, ...]


@dataclasses.dataclass
class Opaque:
    """Anything printed with <...>, or a bare name: kept as text, never a leaf."""

    text: str


class ParseError(Exception):
    def __init__(self, msg: str, pos: int, text: str):
        line = text.count("\n", 0, pos) + 1
        col = pos - (text.rfind("\n", 0, pos) + 1) + 1
        snippet = text[pos : pos + 40].split("\n")[0]
        super().__init__(f"line {line}, column {col}: {msg} (at {snippet!r})")
        self.line, self.col = line, col


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|inf|nan)")
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


class _Parser:
    """Tolerant recursive descent over Python-repr-like text."""

    def __init__(self, text: str):
        self.t = text
        self.i = 0

    # -- lexing helpers
    def ws(self):
        t, n = self.t, len(self.t)
        while self.i < n:
            c = t[self.i]
            if c.isspace():
                self.i += 1
            elif c == "#":  # flax module reprs: "# attributes"
                j = t.find("\n", self.i)
                self.i = n if j < 0 else j
            else:
                break

    def peek(self) -> str:
        self.ws()
        return self.t[self.i] if self.i < len(self.t) else ""

    def expect(self, ch: str):
        if self.peek() != ch:
            got = self.t[self.i] if self.i < len(self.t) else "end of file"
            raise ParseError(f"expected {ch!r}, found {got!r}", self.i, self.t)
        self.i += 1

    def fail(self, msg: str):
        raise ParseError(msg, self.i, self.t)

    # -- grammar
    def parse_document(self) -> Any:
        value = self.value()
        if self.peek():
            self.fail("unexpected text after the end of the tree")
        return value

    def value(self) -> Any:
        c = self.peek()
        if not c:
            self.fail("unexpected end of file")
        if c == "{":
            return self.dict_()
        if c == "(":
            return self.tuple_()
        if c == "[":
            return ListNode(self.seq("[", "]")[0])
        if c == "<":
            return self.angle()
        if c in "'\"":
            return self.string("string")
        m = _IDENT.match(self.t, self.i)
        if m and m.group(0) not in ("inf", "nan"):
            name = m.group(0)
            self.i = m.end()
            nxt = self.t[self.i] if self.i < len(self.t) else ""
            if nxt == "(":
                return self.call(name)
            if nxt == "[" and name in _ITEMSIZE or nxt == "[" and _looks_dtype(name):
                return self.array_type(name)
            if name == "None":
                return None
            if name in ("True", "False"):
                return name == "True"
            return Opaque(name)
        m = _NUMBER.match(self.t, self.i)
        if m and m.group(0):
            self.i = m.end()
            s = m.group(0)
            try:
                return int(s)
            except ValueError:
                return float(s)
        self.fail(f"unexpected character {c!r}")

    def seq(self, open_: str, close: str) -> Tuple[List[Any], bool]:
        """Comma-separated values; returns (items, had_trailing_or_any_comma)."""
        self.expect(open_)
        items, comma = [], False
        while True:
            if self.peek() == close:
                self.i += 1
                return items, comma
            items.append(self.value())
            c = self.peek()
            if c == ",":
                self.i += 1
                comma = True
            elif c != close:
                self.fail(f"expected ',' or {close!r}")

    def tuple_(self) -> TupleNode:
        items, _ = self.seq("(", ")")
        return TupleNode(items)

    def dict_(self) -> DictNode:
        self.expect("{")
        items: List[Tuple[str, Any]] = []
        while True:
            if self.peek() == "}":
                self.i += 1
                return DictNode(items)
            key = self.key()
            self.expect(":")
            items.append((key, self.value()))
            c = self.peek()
            if c == ",":
                self.i += 1
            elif c != "}":
                self.fail("expected ',' or '}'")

    def string(self, what: str) -> str:
        """A quoted python string literal at the cursor."""
        m = _STRING.match(self.t, self.i)
        if not m:
            self.fail("unterminated " + what)
        self.i = m.end()
        return _unquote(m.group(0))

    def key(self) -> str:
        c = self.peek()
        if c in "'\"":
            return self.string("string key")
        # bare key (flax FrozenDict prints keys unquoted): anything up to ':' on this line
        j = self.i
        while j < len(self.t) and self.t[j] not in ":\n{}":
            j += 1
        if j >= len(self.t) or self.t[j] != ":" or j == self.i:
            self.fail("expected a dict key followed by ':'")
        k = self.t[self.i : j].strip()
        self.i = j
        return k

    def call(self, name: str) -> Any:
        self.expect("(")
        args: List[Any] = []
        kwargs: List[Tuple[str, Any]] = []
        while True:
            if self.peek() == ")":
                self.i += 1
                break
            m = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*=(?!=)").match(self.t, self.i)
            if m:
                self.i = m.end()
                kwargs.append((m.group(1), self.value()))
            else:
                args.append(self.value())
            c = self.peek()
            if c == ",":
                self.i += 1
            elif c != ")":
                self.fail(f"expected ',' or ')' in {name}(...)")
        return Call(name, args, kwargs)

    def array_type(self, dtype: str) -> ArrayType:
        self.expect("[")
        j = self.t.find("]", self.i)
        if j < 0:
            self.fail("unterminated shape")
        dims = [d.strip() for d in self.t[self.i : j].split(",") if d.strip()]
        try:
            shape = tuple(int(d) for d in dims)
        except ValueError:
            self.fail("non-integer dimension in shape")
        self.i = j + 1
        return ArrayType(dtype, shape)

    def angle(self) -> Opaque:
        """`<bound method Module.apply of WideResNet(\n ...)>`, `<function f at 0x..>`."""
        start, depth, pairs = self.i, 0, {"(": ")", "[": "]", "{": "}"}
        stack: List[str] = []
        t = self.t
        while self.i < len(t):
            c = t[self.i]
            if c in pairs:
                stack.append(pairs[c])
            elif stack and c == stack[-1]:
                stack.pop()
            elif c == "<" and not stack:
                depth += 1
            elif c == ">" and not stack and t[self.i - 1] != "-":
                depth -= 1
                if depth == 0:
                    self.i += 1
                    return Opaque(t[start : self.i])
            self.i += 1
        self.i = start
        self.fail("unterminated <...>")


def _looks_dtype(name: str) -> bool:
    return bool(re.fullmatch(r"(?:float|int|uint|bfloat|complex)\d+|bool|float8\w*", name))


def _unquote(s: str) -> str:
    return s[1:-1].encode("utf-8").decode("unicode_escape") if "\\" in s else s[1:-1]


def parse_tree(text: str) -> Any:
    """Parse the printed pytree; raises ParseError with line/column."""
    return _Parser(text).parse_document()


# ============================================================================ placement specs
@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """One ShardingSpec: per array dim the chunk counts; per mapping position an entry."""

    dims: Tuple[Tuple[int, ...], ...]  # () for NoSharding, (k,) Chunked(k), (a, b) Chunked(a,b)
    mapping: Tuple[Tuple[str, int], ...]  # ("shard", flat chunk index) / ("repl", replicas)

    def position_sizes(self) -> Tuple[int, ...]:
        flat = [k for d in self.dims for k in d]
        out = []
        for kind, v in self.mapping:
            if kind == "shard":
                out.append(flat[v] if 0 <= v < len(flat) else 1)
            else:
                out.append(v)
        return tuple(out)

    def text(self) -> str:
        dims = ", ".join("NoSharding()" if not d else f"Chunked({','.join(map(str, d))})" for d in self.dims)
        if len(self.dims) == 1:
            dims += ","
        maps = ", ".join(f"ShardedAxis(axis={v})" if k == "shard" else f"Replicated(replicas={v})" for k, v in self.mapping)
        if len(self.mapping) == 1:
            maps += ","
        return f"ShardingSpec(({dims}), ({maps}))"


@dataclasses.dataclass(frozen=True)
class RawLeaf:
    path: str
    arg: int  # top-level argument (or output) index; -1 when the tree is not a tuple
    dtype: str
    shape: Tuple[int, ...]
    mesh_ids: Tuple[int, ...]
    specs: Tuple[MeshSpec, ...]


def _kw(call: Call, name: str, pos: int) -> Any:
    for k, v in call.kwargs:
        if k == name:
            return v
    if pos < len(call.args):
        return call.args[pos]
    raise ValueError(f"{call.name}(...) has no {name}")


def _items(node: Any) -> List[Any]:
    if isinstance(node, (TupleNode, ListNode)):
        return node.items
    if isinstance(node, list):
        return node
    raise ValueError(f"expected a tuple, got {type(node).__name__}")


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"expected an integer, got {v!r}")
    return v


def _sharding_spec(node: Any) -> MeshSpec:
    if not (isinstance(node, Call) and node.name.endswith("ShardingSpec")):
        raise ValueError("expected ShardingSpec(...)")
    sharding = _items(_kw(node, "sharding", 0))
    mapping = _items(_kw(node, "mesh_mapping", 1))
    dims: List[Tuple[int, ...]] = []
    for s in sharding:
        if not isinstance(s, Call):
            raise ValueError(f"unexpected sharding entry {s!r}")
        base = s.name.rsplit(".", 1)[-1]
        if base == "NoSharding":
            dims.append(())
        elif base == "Chunked":
            chunks: List[int] = []
            for a in list(s.args) + [v for _, v in s.kwargs]:
                if isinstance(a, (TupleNode, ListNode)):
                    chunks.extend(_int(x) for x in a.items)
                else:
                    chunks.append(_int(a))
            dims.append(tuple(chunks))
        elif base == "Unstacked":
            dims.append((_int(_kw(s, "size", 0)),))
        else:
            raise ValueError(f"unknown sharding {s.name}")
    maps: List[Tuple[str, int]] = []
    for m in mapping:
        if not isinstance(m, Call):
            raise ValueError(f"unexpected mesh_mapping entry {m!r}")
        base = m.name.rsplit(".", 1)[-1]
        if base == "ShardedAxis":
            maps.append(("shard", _int(_kw(m, "axis", 0))))
        elif base == "Replicated":
            maps.append(("repl", _int(_kw(m, "replicas", 0))))
        else:
            raise ValueError(f"unknown mesh mapping {m.name}")
    return MeshSpec(tuple(dims), tuple(maps))


def _placement(node: Call) -> Tuple[str, Tuple[int, ...], Tuple[int, ...], Tuple[MeshSpec, ...]]:
    aval = _kw(node, "aval", 0)
    if isinstance(aval, Call) and aval.args and isinstance(aval.args[0], ArrayType):
        at = aval.args[0]
    elif isinstance(aval, ArrayType):
        at = aval
    else:
        raise ValueError("PlacementSpec aval is not ShapedArray(dtype[dims])")
    mesh_ids = tuple(_int(x) for x in _items(_kw(node, "mesh_ids", 1)))
    specs = tuple(_sharding_spec(s) for s in _items(_kw(node, "sharding_specs", 2)))
    if len(specs) != len(mesh_ids):
        raise ValueError(f"{len(mesh_ids)} mesh ids but {len(specs)} sharding specs")
    return at.dtype, at.shape, mesh_ids, specs


def collect_leaves(tree: Any) -> List[RawLeaf]:
    """Every PlacementSpec in the tree, with '/'-joined paths (top tuple index = `arg`)."""
    out: List[RawLeaf] = []

    def walk(node: Any, parts: List[str], arg: int):
        if isinstance(node, Call):
            base = node.name.rsplit(".", 1)[-1]
            if base == "PlacementSpec":
                dtype, shape, mesh_ids, specs = _placement(node)
                out.append(RawLeaf("/".join(parts), arg, dtype, shape, mesh_ids, specs))
                return
            if base == "FrozenDict" or not node.kwargs:  # wrappers: FrozenDict({...}), Foo(x)
                for i, a in enumerate(node.args):
                    walk(a, parts if len(node.args) == 1 else parts + [str(i)], arg)
                for k, v in node.kwargs:
                    walk(v, parts + [k], arg)
                return
            for i, a in enumerate(node.args):
                walk(a, parts + [str(i)], arg)
            for k, v in node.kwargs:
                walk(v, parts + [k], arg)
        elif isinstance(node, DictNode):
            for k, v in node.items:
                walk(v, parts + [str(k)], arg)
        elif isinstance(node, (TupleNode, ListNode)):
            for i, v in enumerate(node.items):
                walk(v, parts + [str(i)], arg)

    if isinstance(tree, TupleNode):
        for i, v in enumerate(tree.items):
            walk(v, [], i)
    else:
        walk(tree, [], -1)
    return out


def _has_params(node: Any) -> bool:
    if isinstance(node, Call):
        return any(k == "params" for k, _ in node.kwargs) or (
            node.name.rsplit(".", 1)[-1] == "FrozenDict" and any(_has_params(a) for a in node.args)
        )
    if isinstance(node, DictNode):
        return any(k == "params" for k, _ in node.items)
    return False


def _state_arg(tree: Any) -> int:
    """Index of the train-state argument in a top-level tuple (-1: the tree is the state)."""
    if not isinstance(tree, TupleNode):
        return -1
    for i, v in enumerate(tree.items):
        if _has_params(v):
            return i
    return 0


# ============================================================================ meshes
def _group(sizes: Sequence[int], shape: Sequence[int]) -> Optional[List[List[int]]]:
    """Match mapping positions to consecutive mesh axes by size (product)."""
    groups, a = [], 0
    for s in sizes:
        g, prod = [], 1
        while a < len(shape) and (prod < s or (not g and s == 1)):
            g.append(a)
            prod *= shape[a]
            a += 1
            if prod == s:
                break
        if prod != s:
            return None
        groups.append(g)
    return groups if a == len(shape) else None


def infer_mesh_shape(specs: Sequence[MeshSpec]) -> Tuple[int, ...]:
    """The mesh shape: most common position sizes among the specs with the most positions."""
    if not specs:
        return ()
    sized = [tuple(s for s in sp.position_sizes()) for sp in specs]
    longest = max(len(s) for s in sized)
    cands = Counter(s for s in sized if len(s) == longest)
    return cands.most_common(1)[0][0]


def dim_axes_of(spec: MeshSpec, shape: Sequence[int]) -> Tuple[Tuple[str, ...], ...]:
    """Per array dim, the mesh axes (names) that split it, in chunk order."""
    sizes = spec.position_sizes()
    if len(sizes) == len(shape):
        groups = [[i] for i in range(len(sizes))]
    else:
        groups = _group(sizes, shape) or [[i] for i in range(len(sizes))]
    flat_owner: List[int] = []
    for d, chunks in enumerate(spec.dims):
        flat_owner.extend([d] * len(chunks))
    by_flat: Dict[int, List[str]] = {}
    for pos, (kind, v) in enumerate(spec.mapping):
        if kind == "shard" and 0 <= v < len(flat_owner):
            by_flat.setdefault(v, []).extend(str(a) for a in groups[pos])
    out: List[List[str]] = [[] for _ in spec.dims]
    for flat in sorted(by_flat):
        out[flat_owner[flat]].extend(by_flat[flat])
    return tuple(tuple(x) for x in out)


# ============================================================================ public API
@dataclasses.dataclass(frozen=True)
class AlpaDump:
    """An Alpa dump folder, read. `plan` is what the renderers show; the rest are extras."""

    folder: str
    prefix: str
    kind: str  # "pipeshard" (has *_stage_<i>.hlo) or "shard_parallel"
    plan: ParallelPlan
    memory_gb: Dict[str, float]  # file stem (e.g. train_step_stage_0) -> total_allocation_size
    collectives: Dict[str, Dict[str, int]]  # all stages summed: kind -> {count, bytes}
    stage_collectives: Dict[str, Dict[str, Dict[str, int]]]  # file stem -> kind -> {count, bytes}
    files: Tuple[str, ...]  # file names read


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as e:
        raise KitError(f"cannot read {path}: {e.strerror}")


def _parse_file(path: str) -> List[RawLeaf]:
    text = _read(path)
    try:
        tree = parse_tree(text)
    except ParseError as e:
        raise KitError(f"cannot parse {path}: {e}")
    try:
        leaves = collect_leaves(tree)
    except ValueError as e:
        raise KitError(f"cannot read the placement specs in {path}: {e}")
    if not leaves:
        raise KitError(f"no PlacementSpec(...) in {path}; is it an Alpa *_placement_specs.txt file?")
    return leaves, _state_arg(tree)


def _itemsize(dtype: str) -> int:
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    m = re.search(r"(\d+)$", dtype)
    return max(1, int(m.group(1)) // 8) if m else 4


_MEM_RE = re.compile(r"total_allocation_size:\s*([0-9.eE+-]+)\s*GB")


def _memory(folder: str, prefix: str) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), glob.escape(prefix) + "*.mem_usage.txt"))):
        m = _MEM_RE.search(_read(path))
        if m:
            out[os.path.basename(path)[: -len(".mem_usage.txt")]] = float(m.group(1))
    return dict(sorted(out.items(), key=lambda kv: _natural(kv[0])))


def _natural(s: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]


def _pick_prefix(folder: str, prefix: Optional[str]) -> str:
    found = sorted(glob.glob(os.path.join(glob.escape(folder), "*" + INPUT_SUFFIX)))
    if not found:
        raise KitError(f"no *{INPUT_SUFFIX} in {folder}; point inspect at the folder you passed to executable.dump_debug_info()")
    prefixes = [os.path.basename(p)[: -len(INPUT_SUFFIX)] for p in found]
    if prefix is not None:
        if prefix not in prefixes:
            raise KitError(f"no {prefix}{INPUT_SUFFIX} in {folder} (found: {', '.join(prefixes)})")
        return prefix
    if len(prefixes) > 1:
        raise KitError(f"{folder} holds dumps of several functions ({', '.join(prefixes)}); pick one with prefix=")
    return prefixes[0]


def load_alpa_dump(path: str, prefix: Optional[str] = None) -> AlpaDump:
    """Read one Alpa `dump_debug_info` folder (or one of its spec files) into an `AlpaDump`."""
    folder = path
    if os.path.isfile(path):
        base = os.path.basename(path)
        folder = os.path.dirname(path) or "."
        for suf in (INPUT_SUFFIX, OUTPUT_SUFFIX):
            if base.endswith(suf):
                prefix = prefix or base[: -len(suf)]
    if not os.path.isdir(folder):
        raise KitError(f"{path} is not a folder; point inspect at the folder you passed to executable.dump_debug_info()")
    prefix = _pick_prefix(folder, prefix)
    in_path = os.path.join(folder, prefix + INPUT_SUFFIX)
    out_path = os.path.join(folder, prefix + OUTPUT_SUFFIX)
    files = [os.path.basename(in_path)]

    in_leaves, state_arg = _parse_file(in_path)
    out_by_path: Dict[str, RawLeaf] = {}
    if os.path.exists(out_path):
        out_leaves, out_state = _parse_file(out_path)
        files.append(os.path.basename(out_path))
        out_by_path = {l.path: l for l in out_leaves if l.arg == out_state}

    state_raw = [l for l in in_leaves if l.arg == state_arg]
    batch_args = sorted({l.arg for l in in_leaves if l.arg != state_arg})
    batch_raw = [l for l in in_leaves if l.arg != state_arg]

    # mesh shapes from every spec seen, per mesh id
    per_mesh: Dict[int, List[MeshSpec]] = {}
    for l in list(in_leaves) + list(out_by_path.values()):
        for mid, sp in zip(l.mesh_ids, l.specs):
            per_mesh.setdefault(mid, []).append(sp)
    shapes = {mid: infer_mesh_shape(sps) for mid, sps in per_mesh.items()}

    def to_leaf(raw: RawLeaf, path: str) -> Leaf:
        first = raw.mesh_ids[0] if raw.mesh_ids else None
        dim_axes = dim_axes_of(raw.specs[0], shapes[first]) if raw.specs else ()
        if len(dim_axes) != len(raw.shape):
            dim_axes = tuple(() for _ in raw.shape)
        spec = " | ".join(sp.text() for sp in raw.specs)
        return Leaf(
            path=path, shape=raw.shape, dtype=raw.dtype, mesh_ids=raw.mesh_ids, dim_axes=dim_axes, spec=spec, itemsize=_itemsize(raw.dtype)
        )

    def batch_path(raw: RawLeaf) -> str:
        head = "batch" if len(batch_args) == 1 else f"batch{raw.arg}"
        return f"{head}/{raw.path}" if raw.path else head

    batch = tuple(to_leaf(l, batch_path(l)) for l in batch_raw)
    state = tuple(to_leaf(out_by_path.get(l.path, l), l.path) for l in state_raw)

    meshes = []
    for mid in sorted(shapes):
        shape = shapes[mid]
        meshes.append(
            Mesh(
                mesh_id=mid,
                shape=tuple(shape),
                axes=tuple(str(i) for i in range(len(shape))),
                batch_axes=tuple(sorted(batch_axes_from_leaves(batch, mid))),
            )
        )
    plan = ParallelPlan(meshes=tuple(meshes), leaves=state, batch=batch)

    # HLO and memory extras
    hlo_paths = sorted(glob.glob(os.path.join(glob.escape(folder), glob.escape(prefix) + "_stage_*.hlo")), key=_natural)
    kind = "pipeshard" if hlo_paths else "shard_parallel"
    if not hlo_paths and os.path.exists(os.path.join(folder, prefix + ".hlo")):
        hlo_paths = [os.path.join(folder, prefix + ".hlo")]
    stage_collectives: Dict[str, Dict[str, Dict[str, int]]] = {}
    for p in hlo_paths:
        stage_collectives[os.path.basename(p)[: -len(".hlo")]] = count_collectives(_read(p))
        files.append(os.path.basename(p))
    memory = _memory(folder, prefix)
    files.extend(f"{stem}.mem_usage.txt" for stem in memory)
    return AlpaDump(
        folder=folder,
        prefix=prefix,
        kind=kind,
        plan=plan,
        memory_gb=memory,
        collectives=merge_counts(*stage_collectives.values()),
        stage_collectives=stage_collectives,
        files=tuple(files),
    )
