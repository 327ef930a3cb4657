"""The collectives of a step compiled for emulated CPU devices, counted as XLA:GPU would run them.

The planner compiles every candidate on CPU devices, and two of XLA:CPU's rewrites change what the same
program's collectives send:

- Float normalisation: XLA:CPU runs a collective of bf16 (or f16) values in f32. Its operand is a fusion that
  rounds f32 through bf16 (a convert to bf16, then back), or each of its outputs is converted to bf16 at
  once. XLA:GPU sends the values in bf16, so they count at half their CPU bytes.
- An all-reduce whose every output is only sliced by the device's own partition (a slice that takes
  `partition-id` and keeps 1/n of it) stays an all-reduce on CPU. XLA:GPU turns that pattern into a
  reduce-scatter, which sends half of what an all-reduce sends.

Anything this module cannot recognise is counted as XLA:CPU compiled it, so it errs towards more bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from alpa_job.record import hlo

_NARROW = ("bf16", "f16")
_CALLS = re.compile(r"calls=%?([A-Za-z0-9_.\-]+)")
_INDEX = re.compile(r"\bindex=(\d+)")
_OPERAND = re.compile(r"%([A-Za-z0-9_.\-]+)")
_CONVERT_ONLY = {"parameter", "convert", "bitcast", "copy", "reshape"}


@dataclass
class _Inst:
    shape: str
    opcode: str
    operands: List[str]
    calls: Optional[str]
    index: Optional[int]


class _Program:
    """Every instruction of an HLO module's text, with its users and the computations fusions call."""

    def __init__(self, text: str):
        self.insts: Dict[str, _Inst] = {}
        self.computations: Dict[str, List[str]] = {}
        self.users: Dict[str, List[str]] = {}
        for computation, _, (name, shape, opcode, rest), operand_text in hlo.instructions(text):
            operands = _OPERAND.findall(operand_text)
            calls, index = _CALLS.search(rest), _INDEX.search(rest)
            self.insts[name] = _Inst(shape, opcode, operands, calls and calls.group(1), index and int(index.group(1)))
            self.computations.setdefault(computation, []).append(name)
            for operand in operands:
                self.users.setdefault(operand, []).append(name)

    def converts_only(self, name: str) -> Optional[List[str]]:
        """The dtypes a convert (or a fusion of converts alone) passes its value through, else None."""
        inst = self.insts.get(name)
        if inst is None:
            return None
        if inst.opcode == "convert":
            return [hlo.array_dtype(self.insts[o].shape) for o in inst.operands if o in self.insts] + [hlo.array_dtype(inst.shape)]
        if inst.opcode != "fusion" or inst.calls not in self.computations:
            return None
        body = [self.insts[n] for n in self.computations[inst.calls]]
        if not body or any(b.opcode not in _CONVERT_ONLY for b in body):
            return None
        return [hlo.array_dtype(b.shape) for b in body]

    def rounds_through_narrow(self, name: str) -> bool:
        """An f32 value that was bf16 a moment ago (XLA:CPU widened it for the collective)."""
        dtypes = self.converts_only(name)
        return bool(dtypes) and dtypes[-1] == "f32" and any(d in _NARROW for d in dtypes)

    def narrowed(self, name: str) -> bool:
        dtypes = self.converts_only(name)
        return bool(dtypes) and dtypes[-1] in _NARROW

    def takes_partition_id(self, name: str) -> bool:
        operands = self.insts[name].operands if name in self.insts else []
        return any(self.insts[o].opcode == "partition-id" for o in operands if o in self.insts)

    def elements(self, name: str) -> int:
        return hlo.array_elements(self.insts[name].shape)

    def outputs(self, name: str) -> List[Tuple[str, List[str]]]:
        """(shape, users) of each of a collective's outputs: its tuple's elements, or the value itself."""
        inst = self.insts[name]
        if not inst.shape.startswith("("):
            return [(inst.shape, self.users.get(name, []))]
        elements = [u for u in self.users.get(name, []) if self.insts[u].opcode == "get-tuple-element"]
        return [(self.insts[u].shape, self.users.get(u, [])) for u in elements]


def collective_instances(hlo_text: str, group_size_of) -> List[Tuple[str, str, int]]:
    """hlo.collective_instances of a CPU-compiled step, as XLA:GPU would run it: (kind, name, output bytes).
    `group_size_of(name)`: the size of that collective's replica groups."""
    program = _Program(hlo_text)
    out: List[Tuple[str, str, int]] = []
    for kind, name, nbytes in hlo.collective_instances(hlo_text):
        inst = program.insts.get(name)
        if inst is None or kind not in ("all-reduce", "all-gather"):
            out.append((kind, name, nbytes))
            continue
        widened_in = bool(inst.operands) and all(program.rounds_through_narrow(o) for o in inst.operands)
        n = max(group_size_of(name), 1)
        counted: Dict[str, float] = {}
        for shape, users in program.outputs(name):
            size = hlo.shape_bytes(shape)
            narrow_out = bool(users) and all(program.narrowed(u) for u in users)
            if hlo.array_dtype(shape) == "f32" and (widened_in or narrow_out):
                size /= 2
            ends = [e for u in users for e in (program.users.get(u, []) if program.narrowed(u) else [u])]
            sliced = (
                kind == "all-reduce"
                and n > 1
                and bool(ends)
                and all(program.takes_partition_id(e) and program.elements(e) * n == hlo.array_elements(shape) for e in ends)
            )
            target = "reduce-scatter" if sliced else kind
            counted[target] = counted.get(target, 0.0) + (size / n if sliced else size)
        if not counted:  # a tuple whose elements were not all read through get-tuple-element
            counted[kind] = float(nbytes)
        out.extend((k, name, int(round(b))) for k, b in counted.items())
    return out
