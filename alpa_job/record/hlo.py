"""Count collectives in HLO text (stdlib only; Python 3.9+).

Used by the offline Alpa dump reader (stage `*.hlo` files written by Alpa 0.2.3's
`dump_debug_info`) and by the JAX engine on `compiled.as_text()`. Both HLO text styles are read:

* Alpa 0.2.3 era, synchronous:   ``%all-reduce.1 = f32[8,8]{1,0} all-reduce(f32[8,8]{1,0} %x), ...``
* modern jax, asynchronous pairs: ``all-gather-start = (f32[4,8]{1,0}, f32[8,8]{1,0}) all-gather-start(p)``
  then ``all-gather-done = f32[8,8]{1,0} all-gather-done(all-gather-start)``; the pair counts once,
  with the bytes of the ``-done`` result (the collective's output). Ops wrapped in
  ``async-start(..., calls=%comp)`` are counted where the plain op appears inside ``%comp``.

`count_collectives(text)` returns ``{kind: {"count": n, "bytes": b}}`` for every kind in
`COLLECTIVE_KINDS` (zeros included); bytes are the result (output) bytes summed over instances,
tuple results summed over their arrays.
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, List, Optional, Tuple

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# bits per element; sub-byte types are rounded up per array
_DTYPE_BITS = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
}

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_NAME_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([A-Za-z0-9_.\-]+)\s*=\s*")
_OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")


def dtype_bits(dtype: str) -> int:
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    m = re.match(r"f(\d+)", dtype)  # f8e4m3fn, f8e5m2, ...
    if m:
        return int(m.group(1))
    return 0


def _elements(dims: str) -> int:
    """Elements of an array's dimension list (``8,8``, ``<=8``); an unreadable one counts 0."""
    n = 1
    for d in dims.split(","):
        d = d.strip().lstrip("<=").strip()
        if d:
            try:
                n *= int(d)
            except ValueError:
                return 0
    return n


def shape_bytes(shape_text: str) -> int:
    """Bytes of an HLO shape: ``f32[8,8]{1,0}``, ``(f32[2], s32[])``, ``f32[<=8]``; token -> 0."""
    return sum(-(-(_elements(dims) * dtype_bits(dtype)) // 8) for dtype, dims in _ARRAY_RE.findall(shape_text))


def array_elements(shape_text: str) -> int:
    """Elements of an array shape (``f32[8,8]{1,0}``: 64); a tuple or token shape counts 0."""
    m = re.match(r"\s*" + _ARRAY_RE.pattern, shape_text)
    return _elements(m.group(2)) if m else 0


def array_dims(shape_text: str) -> List[int]:
    """The dimensions of the first array of a shape (``f32[8,<=4]{1,0}``: [8, 4]); [] for a scalar or token."""
    m = _ARRAY_RE.search(shape_text)
    if not m:
        return []
    return [int(d.strip().lstrip("<=").strip()) for d in m.group(2).split(",") if d.strip()]


def first_array(shape_text: str) -> str:
    """The first array of a (possibly tuple) shape, e.g. a library call's result before its scratch space."""
    m = _ARRAY_RE.search(shape_text)
    return m.group(0) if m else shape_text


def array_dtype(shape_text: str) -> str:
    """The element type of a shape (of its first element for a tuple), or ''."""
    m = re.match(r"\s*\(?\s*" + _ARRAY_RE.pattern, shape_text)
    return m.group(1) if m else ""


def _array_bytes_list(shape_text: str) -> List[int]:
    return [shape_bytes(f"{d}[{dims}]") for d, dims in _ARRAY_RE.findall(shape_text)]


def closing_paren(text: str, depth: int = 0) -> int:
    """The index of the ')' that closes the parentheses open at the start of `text` (`depth` of them already
    open before it), or -1 where they never close."""
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _split_shape(rest: str) -> Tuple[str, str]:
    """Split ``<shape> <opcode>(...`` into (shape, remainder); tuple shapes may nest."""
    rest = rest.lstrip()
    if rest.startswith("("):
        end = closing_paren(rest)
        return (rest[: end + 1], rest[end + 1 :]) if end >= 0 else (rest, "")
    # a plain shape: up to the first whitespace that is not inside {...} (layouts)
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch.isspace() and depth == 0:
            return rest[:i], rest[i:]
    return rest, ""


def parse_instruction(line: str) -> Optional[Tuple[str, str, str, str]]:
    """(name, shape, opcode, operands-and-attributes) of one HLO instruction line, or None."""
    m = _NAME_RE.match(line)
    if not m:
        return None
    shape, rest = _split_shape(line[m.end() :])
    om = _OPCODE_RE.match(rest)
    if not om:
        return None
    return m.group(1), shape, om.group(1), rest[om.end() :]


_HEADER_RE = re.compile(r"^\s*(ENTRY\s+)?%?([A-Za-z0-9_.\-]+)\s+\(.*\)\s*->\s*.*\{\s*$")


def instructions(text: str) -> Iterator[Tuple[str, bool, Tuple[str, str, str, str], str]]:
    """Every instruction of an HLO module's text, in order: (its computation's name, whether that is the
    ENTRY, parse_instruction's (name, shape, opcode, rest), the operand list: `rest` up to the parenthesis
    that closes it, without the attributes)."""
    current, entry = None, False
    for line in text.splitlines():
        header = _HEADER_RE.match(line)
        if header:
            current, entry = header.group(2), bool(header.group(1))
            continue
        parsed = parse_instruction(line) if current else None
        if parsed is not None:
            end = closing_paren(parsed[3], depth=1)
            yield current, entry, parsed, parsed[3][:end] if end >= 0 else parsed[3]


def collective_phase(opcode: str) -> Tuple[Optional[str], str]:
    """(kind, phase) with phase in {'sync', 'start', 'done'}; kind None when not a collective."""
    for suffix, phase in (("-start", "start"), ("-done", "done")):
        if opcode.endswith(suffix):
            base = opcode[: -len(suffix)]
            if base in COLLECTIVE_KINDS:
                return base, phase
            return None, phase
    if opcode in COLLECTIVE_KINDS:
        return opcode, "sync"
    return None, "sync"


def start_operand(rest: str, starts) -> Optional[str]:
    """The name, among `starts`, of the ``-start`` a ``-done`` (its text after the opcode) waits for. The
    operand is `start` or, typed (old style), `(f32[..], f32[..]) %start`."""
    return next((tok for tok in re.findall(r"[A-Za-z0-9_.\-]+", rest) if tok in starts), None)


def _start_fallback_bytes(kind: str, shape: str) -> int:
    """Output bytes of a ``-start`` whose ``-done`` is missing (truncated text)."""
    if not shape.startswith("("):
        return shape_bytes(shape)
    if kind == "all-reduce":
        return shape_bytes(shape)  # tuple of outputs
    sizes = [b for b in _array_bytes_list(shape) if b > 4]  # drop u32[] context scalars
    return max(sizes) if sizes else 0


def collective_instances(hlo_text: str) -> List[Tuple[str, str, int]]:
    """Every collective as (kind, instruction name, output bytes), in text order (by start)."""
    found: List[Tuple[str, str, int]] = []
    pending: Dict[str, Tuple[int, str, str]] = {}  # start name -> (index in found, kind, shape)
    for line in hlo_text.splitlines():
        inst = parse_instruction(line)
        if inst is None:
            continue
        name, shape, opcode, rest = inst
        kind, phase = collective_phase(opcode)
        if kind is None:
            continue
        if phase == "sync":
            found.append((kind, name, shape_bytes(shape)))
        elif phase == "start":
            pending[name] = (len(found), kind, shape)
            found.append((kind, name, _start_fallback_bytes(kind, shape)))
        else:  # done: operand is the start's name
            start = start_operand(rest, pending)
            if start in pending:
                idx, _, _ = pending.pop(start)
                found[idx] = (kind, found[idx][1], shape_bytes(shape))
            else:  # a done without its start: count it here
                found.append((kind, name, shape_bytes(shape)))
    return found


def count_collectives(hlo_text: str) -> Dict[str, Dict[str, int]]:
    """``{kind: {"count": n, "bytes": b}}`` for all of `COLLECTIVE_KINDS` (zeros included)."""
    out: Dict[str, Dict[str, int]] = {k: {"count": 0, "bytes": 0} for k in COLLECTIVE_KINDS}
    for kind, _, nbytes in collective_instances(hlo_text):
        out[kind]["count"] += 1
        out[kind]["bytes"] += nbytes
    return out


def merge_counts(*counts: Dict[str, Dict[str, int]]) -> Dict[str, Dict[str, int]]:
    """Sum several `count_collectives` results."""
    out: Dict[str, Dict[str, int]] = {k: {"count": 0, "bytes": 0} for k in COLLECTIVE_KINDS}
    for c in counts:
        for kind, v in c.items():
            slot = out.setdefault(kind, {"count": 0, "bytes": 0})
            slot["count"] += int(v.get("count", 0))
            slot["bytes"] += int(v.get("bytes", 0))
    return out
