"""The engine-neutral parallel plan: which leaf lives where, split how, labelled how.

Both engines (JAX, Alpa) and the offline Alpa dump parser produce a `ParallelPlan`; the renderers
(json / md / html) only read it. Nothing here imports an engine.

Strategy labels (shared by every producer, so reports compare across engines):
  DP          the leaf is not split, while the batch is split on that leaf's mesh
  ZeRO        split only over mesh axes that also split the batch
  MP          split only over mesh axes that do not split the batch
  MP+ZeRO     split over both kinds of axes
  replicated  not split, and the batch is not split on that mesh either
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from alpa_job.record import run_record as record

STRATEGY_LABELS = ("DP", "ZeRO", "MP", "MP+ZeRO", "replicated")


def label_strategy(split_axes: Iterable[str], batch_axes: Iterable[str]) -> str:
    """Label one leaf from the mesh axes that split it and the mesh axes that split the batch."""
    split, batch = set(split_axes), set(batch_axes)
    if not split:
        return "DP" if batch else "replicated"
    if split <= batch:
        return "ZeRO"
    if not (split & batch):
        return "MP"
    return "MP+ZeRO"


@dataclasses.dataclass(frozen=True)
class Mesh:
    """One device mesh. `batch_axes` are the axes that split any batch (input) leaf on it."""

    mesh_id: int
    shape: Tuple[int, ...]
    axes: Tuple[str, ...]
    batch_axes: Tuple[str, ...] = ()

    @property
    def num_devices(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def axis_size(self, name: str) -> int:
        return self.shape[self.axes.index(name)]


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One array of the train state (or the batch).

    `dim_axes` has one entry per array dimension: the mesh axes that split that dimension
    (empty tuple = not split). `spec` is the sharding as the producer prints it.
    """

    path: str  # '/'-joined; params/... for parameters, opt_state/... for optimizer state
    shape: Tuple[int, ...]
    dtype: str
    mesh_ids: Tuple[int, ...]
    dim_axes: Tuple[Tuple[str, ...], ...]
    spec: str
    itemsize: int

    @property
    def bytes(self) -> int:
        n = self.itemsize
        for s in self.shape:
            n *= s
        return n

    @property
    def split_axes(self) -> Tuple[str, ...]:
        return tuple(a for axes in self.dim_axes for a in axes)


@dataclasses.dataclass(frozen=True)
class ParallelPlan:
    meshes: Tuple[Mesh, ...]
    leaves: Tuple[Leaf, ...]  # parameters and optimizer state
    batch: Tuple[Leaf, ...] = ()  # the input batch leaves

    def mesh(self, mesh_id: int) -> Mesh:
        for m in self.meshes:
            if m.mesh_id == mesh_id:
                return m
        raise KeyError(f"no mesh {mesh_id} in plan (meshes: {[m.mesh_id for m in self.meshes]})")

    def strategy_of(self, leaf: Leaf) -> str:
        batch_axes: List[str] = []
        for mid in leaf.mesh_ids:
            batch_axes.extend(self.mesh(mid).batch_axes)
        return label_strategy(leaf.split_axes, batch_axes)

    def bytes_per_device(self, leaf: Leaf) -> int:
        """Bytes of this leaf held by one device of its (first) mesh."""
        if not leaf.mesh_ids:
            return leaf.bytes
        mesh = self.mesh(leaf.mesh_ids[0])
        ways = 1
        for axis in leaf.split_axes:
            ways *= mesh.axis_size(axis)
        return -(-leaf.bytes // ways)

    def leaf_records(self) -> List[record.Leaf]:
        """The report's per-leaf rows (the `params` of the run record)."""
        return [self._record(leaf) for leaf in self.leaves]

    def batch_records(self) -> List[record.Leaf]:
        """The batch's rows (the `batch_sharding` of the run record)."""
        return [self._record(leaf) for leaf in self.batch]

    def mesh_records(self) -> List[record.MeshRecord]:
        return [
            record.MeshRecord(id=m.mesh_id, shape=list(m.shape), axes=list(m.axes), batch_axes=list(m.batch_axes), devices=m.num_devices)
            for m in self.meshes
        ]

    # The same rows as report.json's plain data.
    def leaf_rows(self) -> List[Dict[str, object]]:
        return [dataclasses.asdict(r) for r in self.leaf_records()]

    def batch_rows(self) -> List[Dict[str, object]]:
        return [dataclasses.asdict(r) for r in self.batch_records()]

    def mesh_rows(self) -> List[Dict[str, object]]:
        return [dataclasses.asdict(r) for r in self.mesh_records()]

    def _record(self, leaf: Leaf) -> record.Leaf:
        return record.Leaf(
            path=leaf.path,
            shape=list(leaf.shape),
            dtype=leaf.dtype,
            bytes=leaf.bytes,
            bytes_per_device=self.bytes_per_device(leaf),
            spec=leaf.spec,
            mesh_ids=list(leaf.mesh_ids),
            split_axes=[list(a) for a in leaf.dim_axes],
            strategy=self.strategy_of(leaf),
        )

    def strategy_counts(self, prefix: Optional[str] = None) -> Dict[str, int]:
        counts: Dict[str, int] = {}
        for leaf in self.leaves:
            if prefix is None or leaf.path.startswith(prefix):
                label = self.strategy_of(leaf)
                counts[label] = counts.get(label, 0) + 1
        return counts


def batch_axes_from_leaves(batch_leaves: Sequence[Leaf], mesh_id: int) -> Tuple[str, ...]:
    """A mesh's batch axes: the axes that split any batch leaf placed on that mesh."""
    axes: List[str] = []
    for leaf in batch_leaves:
        if mesh_id in leaf.mesh_ids:
            for a in leaf.split_axes:
                if a not in axes:
                    axes.append(a)
    return tuple(axes)
