"""A model's parameters as a Hugging Face checkpoint's tensors (the model's `api.HfWeights`): which tensor is
which parameter, how a parameter's slice is read from its tensor, how a parameter is written back, and the
checks that a checkpoint fits the model (architecture, the settings' config entries, every tensor there with
its shape and a readable dtype), one line each, in the driver before Ray."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from alpa_job.errors import KitError
from alpa_job.hf.checkpoint import READABLE, HfCheckpoint

Index = Tuple[slice, ...]


def weights_of(model: Any, name: str, flag: str = "--init-from") -> Any:
    """The model's api.HfWeights, or one line saying it has none."""
    weights = getattr(model, "hf", None)
    if weights is None:
        raise KitError(
            f"{flag}: --model {name} declares no Hugging Face layout (its api.Model has hf=None); use "
            "--model llama, or give your model's builder an api.HfWeights"
        )
    return weights


def check_init_from(config) -> None:
    """--init-from hf:DIR, in the driver before Ray: the checkpoint is the model's (built once more for its
    layout; the kit's own models have none)."""
    from alpa_job.hf.checkpoint import parse_source
    from alpa_job.models import build_model, is_built_in

    source = parse_source(config.init_from)
    if is_built_in(config.model):
        weights_of(None, config.model)
    model, _ = build_model(config)
    check_fits(HfCheckpoint(source), weights_of(model, config.model), config.model)


def check_fits(checkpoint: HfCheckpoint, weights: Any, model_name: str) -> None:
    """The checkpoint is this model's: its architecture, its config's entries the settings imply, and every
    tensor with the shape the settings give and a dtype the kit reads."""
    where = f"{checkpoint.flag} hf:{checkpoint.directory}"
    named = checkpoint.config.get("architectures") or [checkpoint.config.get("model_type", "?")]
    if not set(named) & set(weights.architectures):
        raise KitError(
            f"{where}: its config.json names {', '.join(map(str, named))}, and --model {model_name} reads "
            f"{', '.join(weights.architectures)}; use a checkpoint of that architecture"
        )
    wrong = [(key, config_entry(checkpoint.config, key), config_entry(weights.config, key)) for key in weights.settings]
    wrong = [(key, theirs, ours) for key, theirs, ours in wrong if not _same(theirs, ours)]
    if wrong:
        said = ", ".join(f"{key} {theirs!r} (the model: {ours!r})" for key, theirs, ours in wrong)
        fix = " ".join(f"--model-arg {weights.settings[key]}={_arg(theirs)}" for key, theirs, _ in wrong)
        raise KitError(
            f"{where}: its config.json disagrees with --model {model_name}'s settings: {said}; set {fix} (or a --preset of that shape)"
        )
    missing = [t.name for t in weights.tensors if t.name not in checkpoint.files_of]
    if missing:
        raise KitError(
            f"{where}: {len(missing)} tensor(s) the model needs are not in the checkpoint, e.g. "
            f"{', '.join(missing[:3])}; is a shard missing or is it another model's checkpoint?"
        )
    for t in weights.tensors:
        shape, dtype = checkpoint.info(t.name)
        if shape != tuple(t.shape):
            raise KitError(
                f"{where}: {t.name} is {list(shape)} in the checkpoint and {list(t.shape)} in --model "
                f"{model_name}; the settings give another shape (check its config.json against the "
                "model's settings)"
            )
        if dtype not in READABLE:
            raise KitError(
                f"{where}: {t.name} is stored as {dtype}; the kit reads {', '.join(READABLE)} checkpoints (convert it, e.g. to bfloat16)"
            )


def config_entry(config: Dict[str, Any], dotted: str) -> Any:
    """A config entry by its dotted path ("rope_scaling.factor"); None where any part is absent."""
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _same(theirs: Any, ours: Any) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        try:
            return math.isclose(float(theirs), float(ours), rel_tol=1e-6)
        except (TypeError, ValueError):
            return False
    return theirs == ours


def _arg(value: Any) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


# ----- one parameter <-> one tensor -----------------------------------------------------------------
def _split(param_shape: Sequence[int], columns: int) -> int:
    """The number of leading parameter dimensions that are the transposed tensor's columns."""
    for k in range(len(param_shape) + 1):
        if math.prod(param_shape[:k]) == columns:
            return k
    raise KitError(
        f"a parameter of shape {list(param_shape)} is not the transpose of a tensor with {columns} "
        "columns; fix the model's api.HfTensor shape"
    )


def _flat(shape: Sequence[int], index: Index) -> np.ndarray:
    """The C-order flat positions, within `shape`, of the elements `index` picks."""
    ranges = [np.arange(n)[s] for n, s in zip(shape, index)]
    if not ranges:
        return np.zeros(1, np.int64)
    grids = np.meshgrid(*ranges, indexing="ij")
    return np.ravel_multi_index([g.ravel() for g in grids], tuple(shape))


def read_slice(checkpoint: HfCheckpoint, tensor: Any, param_shape: Tuple[int, ...], index: Optional[Index] = None) -> np.ndarray:
    """The parameter's slice `index` (the whole parameter when None), read from its tensor: only the rows and
    columns that hold the slice come off the file."""
    index = tuple(index) if index is not None else tuple(slice(None) for _ in param_shape)
    index = tuple(s if isinstance(s, slice) else slice(s, s + 1) for s in index)
    index += tuple(slice(None) for _ in range(len(param_shape) - len(index)))
    sizes = [len(range(*s.indices(n))) for s, n in zip(index, param_shape)]
    if not tensor.transposed:
        if tuple(tensor.shape) != tuple(param_shape):
            raise KitError(
                f"{tensor.name}: a tensor of shape {list(tensor.shape)} read as a parameter of "
                f"{list(param_shape)} needs transposed=True (or the same shape); fix the model's api.HfTensor"
            )
        return checkpoint.read(tensor.name, index)
    rows, columns = tensor.shape
    k = _split(param_shape, columns)
    want_columns = _flat(param_shape[:k], index[:k])
    want_rows = _flat(param_shape[k:], index[k:])
    low_r, high_r = int(want_rows.min()), int(want_rows.max()) + 1
    low_c, high_c = int(want_columns.min()), int(want_columns.max()) + 1
    block = checkpoint.read(tensor.name, (slice(low_r, high_r), slice(low_c, high_c)))
    picked = block[np.ix_(want_rows - low_r, want_columns - low_c)]
    return np.ascontiguousarray(picked.T).reshape(sizes)


def to_tensor(tensor: Any, param: np.ndarray) -> np.ndarray:
    """The checkpoint's tensor from the whole parameter (export)."""
    if tensor.transposed:
        return np.ascontiguousarray(param.reshape(tuple(tensor.shape)[::-1]).T)
    return param.reshape(tensor.shape)


def by_path(weights: Any) -> Dict[Tuple[str, ...], Any]:
    return {tuple(t.path): t for t in weights.tensors}


def check_covers(weights: Any, param_paths: List[Tuple[str, ...]], model_name: str) -> None:
    """Every parameter has its tensor, and every declared tensor a parameter (a model's declaration, checked)."""
    declared = by_path(weights)
    missing = [p for p in param_paths if p not in declared]
    extra = [p for p in declared if p not in set(param_paths)]
    if missing or extra:
        what = ([f"parameters without a tensor: {', '.join('/'.join(p) for p in missing[:3])}"] if missing else []) + (
            [f"tensors for no parameter: {', '.join('/'.join(p) for p in extra[:3])}"] if extra else []
        )
        raise KitError(
            f"--model {model_name}'s api.HfWeights does not match its parameters ({'; '.join(what)}); fix the model's hf declaration"
        )
