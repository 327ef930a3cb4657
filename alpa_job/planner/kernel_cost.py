"""The kernels of a step compiled for GPUs (gpu_target.py), each with the work that decides its time.

Walks the optimized HLO of a GPU compile in the order it runs: every instruction of the entry computation
that launches work on the GPU is one kernel (a fusion, a cuBLAS or cuDNN call, a copy, a collective); a
`while` with a known trip count contributes its body that many times, a `call` its callee, a `conditional`
its costliest branch. Each kernel gets

- `flops`: the matrix products in it (dots and convolutions, from their shapes and dimension numbers;
  cuDNN's fused attention from its batch, heads, lengths and head size, half where it is causal); the
  elementwise arithmetic is left out, as it never decides a GPU kernel's time;
- `bytes`: what it reads from and writes to memory: its operands and results, except where a fusion only
  slices an operand (it reads the slice) or updates a buffer in place (it writes the update);
- `precision` of its products (bf16, fp32, tf32, fp8), which picks the matmul rate;
- for a collective: its kind and the instruction's name, which the traffic model (record/traffic.py) costs
  over the links it takes.

Stdlib only: the text comes from the worker, and tests build it by hand.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

from alpa_job.record import hlo, traffic

_OPERAND = re.compile(r"%([A-Za-z0-9_.\-]+(?:#\d+)?)")  # name#k: the k-th array of a tuple-shaped result
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([A-Za-z0-9_.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
# Backend configs are JSON whose spacing differs by how XLA printed them (a GPU's dump or a deviceless compile).
_TRIP = re.compile(r'"known_trip_count":\s*\{\s*"n":\s*"(\d+)"\s*\}')
_INTERMEDIATE = re.compile(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]')
_CAUSAL = re.compile(r'"mask_type":\s*"CAUSAL"')
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_DIM_LABELS = re.compile(r"dim_labels=([0-9a-z]+)_([0-9a-z]+)->([0-9a-z]+)")
_INDEX = re.compile(r"\s*(\d+)\)")  # a parameter's number, after "parameter("

# Instructions that launch nothing: they name, reshape or group buffers the kernels around them own.
NO_KERNEL = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
    "replica-id", "opt-barrier", "add-dependency", "domain", "iota",
}  # fmt: skip
# Inside a fusion: the ops that read only part of an operand.
SLICING = {"slice", "dynamic-slice", "gather"}
_ASYNC_WRAPPER = {"async-start", "async-update", "async-done"}


@dataclass
class Kernel:
    name: str
    kind: str  # matmul | attention | convolution | fusion | copy | other
    flops: float = 0.0
    bytes: float = 0.0
    precision: str = "bf16"
    runs: int = 1  # times a step (the trip counts of the loops around it)


@dataclass
class _Inst:
    name: str
    shape: str
    opcode: str
    rest: str
    operands: List[str] = field(default_factory=list)


class Module:
    """An HLO module's computations, each an ordered list of instructions with their shapes."""

    def __init__(self, text: str):
        self.computations: Dict[str, List[_Inst]] = {}
        self.entry: Optional[str] = None
        for computation, is_entry, (name, shape, opcode, rest), operands in hlo.instructions(text):
            self.computations.setdefault(computation, []).append(_Inst(name, shape, opcode, rest, _OPERAND.findall(operands)))
            if is_entry:
                self.entry = computation
        if self.entry is None:
            raise ValueError("no ENTRY computation in the HLO text")
        self.shapes = _Shapes({i.name: i.shape for insts in self.computations.values() for i in insts})

    def called(self, inst: _Inst) -> List[str]:
        names = _CALLS.findall(inst.rest)
        branches = _BRANCHES.search(inst.rest)
        if branches:
            names += _OPERAND.findall(branches.group(1))
        return [n for n in names if n in self.computations]

    def reachable(self, computation: str) -> Iterator[_Inst]:
        """Every instruction of `computation` and of the computations it calls."""
        seen, todo = set(), [computation]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            for inst in self.computations.get(name, []):
                yield inst
                todo.extend(self.called(inst))


def tuple_elements(shape: str) -> List[str]:
    """The top-level elements of a tuple shape `(a, (b, c), d)`; [shape] for an array."""
    shape = re.sub(r"/\*[^*]*\*/", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(shape):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (depth == 0 and ch == ")"):
            part = shape[start:i].strip()
            if part:
                out.append(part)
            start = i + 1
    return out


class _Shapes(dict):
    """Instruction name -> result shape, where `name#k` is the k-th element of a tuple-shaped result."""

    def get(self, key, default=None):
        if key in self:
            return self[key]
        name, _, index = key.partition("#")
        if index and name in self:
            elements = tuple_elements(self[name])
            return elements[int(index)] if int(index) < len(elements) else default
        return default


def _contracting(rest: str, key: str = "lhs_contracting_dims") -> List[int]:
    m = re.search(key + r"=\{([0-9,]*)\}", rest)
    if m:
        return [int(d) for d in m.group(1).split(",") if d]
    m = re.search(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]', rest)  # a library call's backend config
    return [int(d.strip(' "')) for d in m.group(1).split(",") if d.strip()] if m else []


def dot_flops(out_shape: str, lhs_shape: str, rest: str) -> float:
    """2 x output elements x contracted size."""
    lhs = hlo.array_dims(lhs_shape)
    k = math.prod(lhs[d] for d in _contracting(rest) if d < len(lhs))
    return 2.0 * hlo.array_elements(hlo.first_array(out_shape)) * k


def conv_flops(out_shape: str, kernel_shape: str, rest: str) -> float:
    """2 x output elements x the kernel's window x its input features (per group): a forward, backward-input
    or backward-filter convolution alike, each written as a convolution with its own dimension labels."""
    labels = _DIM_LABELS.search(rest)
    kernel = hlo.array_dims(kernel_shape)
    if not labels or len(labels.group(2)) != len(kernel):
        return 0.0
    kernel_labels = labels.group(2)
    per_output = math.prod(size for label, size in zip(kernel_labels, kernel) if label.isdigit())
    per_output *= kernel[kernel_labels.index("i")]
    return 2.0 * hlo.array_elements(hlo.first_array(out_shape)) * per_output


def attention_flops(inst: _Inst, shapes: Dict[str, str]) -> float:
    """cuDNN fused attention: forward 2 products of B x H x S x S x D (2 FLOPs a multiply-add), backward
    5; half of it where the mask is causal (the masked blocks are skipped)."""
    m = _INTERMEDIATE.search(inst.rest)
    if not m or not inst.operands:
        return 0.0
    b, h, s_q, s_k = (int(d.strip(' "')) for d in m.group(1).split(","))
    q = hlo.array_dims(shapes.get(inst.operands[0], ""))
    d = q[-1] if q else 0
    products = 5 if "Backward" in _TARGET.search(inst.rest).group(1) else 2
    causal = 0.5 if _CAUSAL.search(inst.rest) else 1.0
    return products * 2.0 * b * h * s_q * s_k * d * causal


def _precision(dtypes: List[str], rest: str) -> str:
    if any(d.startswith("f8") for d in dtypes):
        return "fp8"
    if "f32" in dtypes and not any(d in ("bf16", "f16") for d in dtypes):
        return "fp32" if "HIGHEST" in rest else "tf32"
    return "bf16"


@dataclass
class Collective:
    """One collective: its result bytes and replica groups (for record/traffic.py), and the compute kernels
    that run between its start and its done (an async pair) in `Costs.kernels`: [first, stop)."""

    kind: str
    name: str
    bytes: int
    attributes: str  # the text that holds its replica groups or source-target pairs
    runs: int
    first: int
    stop: int


class Costs:
    """The kernels of one compiled module (`kernels`, compute in the order they run; a loop's body once,
    with `runs` its trip count) and its collectives (`collectives`)."""

    def __init__(self, text: str):
        self.module = Module(text)
        self.kernels: List[Kernel] = []
        self.collectives: List[Collective] = []
        self._pending: Dict[str, Collective] = {}
        self._walk(self.module.entry, 1)

    def _walk(self, computation: str, runs: int) -> None:
        module = self.module
        for inst in module.computations[computation]:
            op = inst.opcode
            if op in NO_KERNEL:
                continue
            if op == "while":
                trip = _TRIP.search(inst.rest)
                count = int(trip.group(1)) if trip else 1
                body = re.search(r"\bbody=%?([A-Za-z0-9_.\-]+)", inst.rest)
                cond = re.search(r"\bcondition=%?([A-Za-z0-9_.\-]+)", inst.rest)
                if cond and cond.group(1) in module.computations:
                    self._walk(cond.group(1), runs * (count + 1))
                if body and body.group(1) in module.computations:
                    self._walk(body.group(1), runs * count)
                continue
            if op == "call":
                for callee in module.called(inst):
                    self._walk(callee, runs)
                continue
            if op == "conditional":
                self._costliest_branch(inst, runs)
                continue
            if self._collective(inst, runs):
                continue
            if op in _ASYNC_WRAPPER:  # work on another stream (not a collective): counted as it runs
                if op == "async-start":
                    for callee in module.called(inst):
                        self._walk(callee, runs)
                continue
            self.kernels.append(self._kernel(inst, runs))

    def _collective(self, inst: _Inst, runs: int) -> bool:
        """Record `inst` where it is a collective or one's start or done; False where it is neither."""
        kind, phase = hlo.collective_phase(inst.opcode)
        attributes, name = inst.rest, inst.name  # a wrapped collective: the op inside (the profiler's name)
        if inst.opcode in _ASYNC_WRAPPER:
            if inst.opcode == "async-update":
                return inst.operands[0] in self._pending if inst.operands else False
            if inst.opcode == "async-done":
                phase = "done"
            else:
                inner = self._wrapped(inst)
                if inner is None:
                    return False
                kind, phase, attributes, name = inner.opcode, "start", inner.rest, inner.name
        if phase == "done":
            start = next((o for o in inst.operands if o in self._pending), None)
            if start is None:
                return kind is not None
            record = self._pending.pop(start)
            record.bytes, record.stop = hlo.shape_bytes(inst.shape), len(self.kernels)
            return True
        if kind is None:
            return False
        here = len(self.kernels)
        record = Collective(kind, name, hlo.shape_bytes(inst.shape), attributes, runs, here, here)
        self.collectives.append(record)
        if phase == "start":
            self._pending[inst.name] = record
        return True

    def _wrapped(self, inst: _Inst) -> Optional[_Inst]:
        """The collective an async-start wraps, or None."""
        for callee in self.module.called(inst):
            for inner in self.module.computations[callee]:
                kind, phase = hlo.collective_phase(inner.opcode)
                if kind is not None and phase == "sync":
                    return inner
        return None

    def _costliest_branch(self, inst: _Inst, runs: int) -> None:
        """A conditional runs one branch: the costliest's kernels and collectives are counted."""
        best: Optional[Costs] = None
        for branch in self.module.called(inst):
            sub = Costs.__new__(Costs)
            sub.module, sub.kernels, sub.collectives, sub._pending = self.module, [], [], {}
            sub._walk(branch, runs)
            if best is None or sum(k.bytes + k.flops for k in sub.kernels) >= sum(k.bytes + k.flops for k in best.kernels):
                best = sub
        if best is None:
            return
        offset = len(self.kernels)  # the branch's kernel indices become the step's
        self.kernels.extend(best.kernels)
        self.collectives.extend(dataclasses.replace(c, first=c.first + offset, stop=c.stop + offset) for c in best.collectives)

    def _product(self, inst: _Inst) -> Tuple[float, List[str]]:
        """(FLOPs, operand dtypes) of a dot or a convolution."""
        lhs = self.module.shapes.get(inst.operands[0], "") if inst.operands else ""
        rhs = self.module.shapes.get(inst.operands[1], "") if len(inst.operands) > 1 else ""
        flops = dot_flops(inst.shape, lhs, inst.rest) if inst.opcode == "dot" else conv_flops(inst.shape, rhs, inst.rest)
        return flops, [hlo.array_dtype(lhs), hlo.array_dtype(rhs)]

    def _operand_bytes(self, inst: _Inst) -> float:
        return float(sum(hlo.shape_bytes(self.module.shapes.get(o, "")) for o in inst.operands))

    def _kernel(self, inst: _Inst, runs: int) -> Kernel:
        shapes = self.module.shapes
        out_bytes = float(hlo.shape_bytes(inst.shape))
        if inst.opcode == "custom-call":
            target = _TARGET.search(inst.rest)
            target = target.group(1) if target else ""
            result = hlo.first_array(inst.shape)
            moved = self._operand_bytes(inst) + hlo.shape_bytes(result)
            dtypes = [hlo.array_dtype(shapes.get(o, "")) for o in inst.operands] + [hlo.array_dtype(result)]
            if "$fmha" in target:
                return Kernel(inst.name, "attention", attention_flops(inst, shapes), moved, "bf16", runs)
            if target.startswith("__cublas"):
                lhs = shapes.get(inst.operands[0], "") if inst.operands else ""
                return Kernel(inst.name, "matmul", dot_flops(inst.shape, lhs, inst.rest), moved, _precision(dtypes, inst.rest), runs)
            if target.startswith("__cudnn$conv"):
                kernel_shape = shapes.get(inst.operands[1], "") if len(inst.operands) > 1 else ""
                flops = conv_flops(inst.shape, kernel_shape, inst.rest)
                return Kernel(inst.name, "convolution", flops, moved, _precision(dtypes, inst.rest), runs)
            return Kernel(inst.name, "other", 0.0, moved, runs=runs)
        if inst.opcode == "fusion":
            return self._fusion(inst, runs, out_bytes)
        if inst.opcode in ("dot", "convolution"):
            flops, dtypes = self._product(inst)
            return Kernel(inst.name, "matmul", flops, self._operand_bytes(inst) + out_bytes, _precision(dtypes, inst.rest), runs)
        kind = "copy" if inst.opcode in ("copy", "transpose", "dynamic-slice", "dynamic-update-slice", "slice", "concatenate") else "other"
        moved = out_bytes * 2 if inst.opcode == "dynamic-update-slice" else self._operand_bytes(inst) + out_bytes
        if inst.opcode == "dynamic-update-slice" and len(inst.operands) > 1:
            moved = 2.0 * hlo.shape_bytes(shapes.get(inst.operands[1], ""))
        return Kernel(inst.name, kind, 0.0, moved, runs=runs)

    def _fusion(self, inst: _Inst, runs: int, out_bytes: float) -> Kernel:
        module = self.module
        callees = module.called(inst)
        fused = callees[0] if callees else None
        body = list(module.reachable(fused)) if fused else []
        flops, dtypes, has_product = 0.0, [], False
        for inner in body:
            if inner.opcode in ("dot", "convolution"):
                has_product = True
                inner_flops, inner_dtypes = self._product(inner)
                flops, dtypes = flops + inner_flops, dtypes + inner_dtypes
        moved = self._fusion_bytes(inst, fused, out_bytes)
        if has_product:
            return Kernel(inst.name, "matmul", flops, moved, _precision(dtypes, inst.rest), runs)
        return Kernel(inst.name, "fusion", 0.0, moved, runs=runs)

    def _fusion_bytes(self, inst: _Inst, fused: Optional[str], out_bytes: float) -> float:
        """Operands as the fused computation reads them (a sliced one: its slices), the result as it is written
        (a buffer updated in place: its updates)."""
        if fused is None:
            return self._operand_bytes(inst) + out_bytes
        insts = self.module.computations[fused]
        users: Dict[str, List[_Inst]] = {}
        for inner in insts:
            for o in inner.operands:
                users.setdefault(o, []).append(inner)
        params = {int(m.group(1)): i.name for i in insts if i.opcode == "parameter" for m in [_INDEX.match(i.rest)] if m}
        total = 0.0
        in_place = set()
        root = insts[-1] if insts else None
        for i in insts:
            if i.opcode == "dynamic-update-slice" and i.operands:
                in_place.add(i.operands[0])
        for index, operand in enumerate(inst.operands):
            param = params.get(index)
            full = float(hlo.shape_bytes(self.module.shapes.get(operand, "")))
            uses = users.get(param, []) if param else []
            if param in in_place:
                continue  # the buffer updated in place: only its updates move, counted below
            if uses and all(u.opcode in SLICING for u in uses):
                total += min(full, float(sum(hlo.shape_bytes(u.shape) for u in uses)))
            else:
                total += full
        if in_place and root is not None:
            updates = [i for i in insts if i.opcode == "dynamic-update-slice"]
            written = float(sum(hlo.shape_bytes(self.module.shapes.get(u.operands[1], "")) for u in updates if len(u.operands) > 1))
            others = out_bytes - float(sum(hlo.shape_bytes(u.shape) for u in updates))
            return total + written + max(others, 0.0)
        return total + out_bytes


def features(text: str, num_devices: int, gpus_per_node: int) -> Dict[str, Any]:
    """What the planner's time model reads of a compiled step, as plain data (JSON):

    kernels      [[kind, precision, flops, bytes, runs a step], ...]: alike kernels (a transformer's
                 layers) one row
    collectives  [{kind, name, runs, nvlink_bytes, network_bytes, groups_read, beside}], beside: [[row of
                 kernels, count]] the compute that runs between an async collective's start and done
    """
    return costed_features(Costs(text), num_devices, gpus_per_node)


def costed_features(costs: Costs, num_devices: int, gpus_per_node: int) -> Dict[str, Any]:
    """`features` of a module already walked."""
    table: List[List[Any]] = []
    rows: Dict[Tuple[str, str, float, float], int] = {}
    row_of: List[int] = []
    for k in costs.kernels:
        key = (k.kind, k.precision, k.flops, k.bytes)
        if key not in rows:
            rows[key] = len(table)
            table.append([k.kind, k.precision, k.flops, k.bytes, 0])
        table[rows[key]][4] += k.runs
        row_of.append(rows[key])
    collectives = []
    for c in costs.collectives:
        groups = traffic.replica_groups(c.attributes, num_devices)
        sent = traffic.traffic(c.kind, c.bytes, groups, num_devices, gpus_per_node)
        beside: Dict[int, int] = {}
        for row in row_of[c.first : c.stop]:
            beside[row] = beside.get(row, 0) + 1
        collectives.append(
            {
                "kind": c.kind,
                "name": c.name,
                "runs": c.runs,
                "bytes": c.bytes,
                "nvlink_bytes": sent.nvlink_bytes,
                "network_bytes": sent.network_bytes,
                "groups_read": sent.groups_read,
                "beside": sorted(beside.items()),
            }
        )
    return {"kernels": table, "collectives": collectives}
