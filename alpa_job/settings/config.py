"""The job config: one frozen dataclass, validated once.

Override order (later wins): the defaults below -> `--preset NAME` (alpa_job/settings/presets/NAME.yaml) ->
`--config FILE` -> command-line flags. A preset is an ordinary config file: a YAML mapping of field
names, which may start from another preset or file with `base_config:` (MaxText's base config +
overrides; resolved recursively, the base first). Every problem is a `KitError` that names the field
and the allowed values.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict, List, Optional, Tuple

from alpa_job.choices import did_you_mean, not_known
from alpa_job.errors import KitError
from alpa_job.models import check_model_name

DATASETS = ("synthetic", "cifar10")
ENGINES = ("auto", "jax", "alpa")
STRATEGIES = ("data", "fsdp", "tensor", "auto")  # --engine jax
ALPA_STRATEGIES = ("data", "shard", "pipeshard-manual", "pipeshard-auto")  # --engine alpa
DTYPES = ("float32", "bfloat16")
REMAINDER_POLICIES = ("drop", "pad")


@dataclasses.dataclass(frozen=True)
class JobConfig:
    # What to train.
    model: str = "mlp"
    dataset: str = "synthetic"
    data_dir: Optional[str] = None  # cifar10: folder holding data_batch_1..5 (python format)
    num_samples: int = 2000  # synthetic only; 2000 / 256 leaves a ragged last batch on purpose
    batch_size: int = 256  # global batch, split over the data-parallel axis
    epochs: int = 3
    steps: Optional[int] = None  # stop after this many steps (None: run all epochs)
    remainder: str = "drop"  # ragged last batch: "drop" it or "pad" it and mask the loss
    learning_rate: float = 1e-3
    dtype: str = "float32"
    seed: int = 0

    # Model sizes (each model reads its own).
    hidden_dim: int = 256  # mlp: the tutorial's `dim` (layers 4h -> h -> 4h -> h)
    depth: int = 10  # wide_resnet: 6n+4 (10 = one block per stage)
    width: int = 2  # wide_resnet: widening factor k
    num_layers: int = 2  # gpt
    d_model: int = 128  # gpt
    num_heads: int = 4  # gpt
    seq_len: int = 64  # gpt
    vocab_size: int = 256  # gpt

    # How to run it.
    engine: str = "auto"
    strategy: str = "data"
    model_parallel: int = 0  # size of the mesh's model axis for `tensor` (0: the largest that divides)
    devices: int = 8  # CPU devices to emulate per process when there is no accelerator
    address: Optional[str] = None  # None: RAY_ADDRESS if set (ray job submit), else "local"
    processes: int = 0  # JAX processes, one per node (0: one per alive node)
    auto_trial_steps: int = 3  # `auto`: timed steps per candidate
    memory_limit_gb: Optional[float] = None  # `auto`: per-device budget (None: the device's own)
    cluster_spec: Optional[str] = None  # path to a cluster spec YAML (default: the package's)
    compile_cache: Optional[str] = None  # jax: persistent compile cache folder (None: ~/.cache/alpa_job/jax; "none": off)
    # Alpa engine only.
    micro_batches: int = 1  # Alpa num_micro_batches (gradient accumulation / pipeline)
    pipeline_stages: int = 0  # pipeshard-manual: stages (0: one per node, at least 2)
    pipeline_layers: int = 0  # pipeshard-auto: AutoLayerOption(layer_num) (0: the model's layer count)
    plan_cache: Optional[str] = None  # pipeshard-auto: folder that keeps/reuses the auto search result

    # Output and checkpoints.
    out: Optional[str] = None  # None: runs/<time>-<model>-<strategy> with runs/latest -> it (alpa_job/train/rundir.py)
    checkpoint_every: int = 0  # 0: no checkpoints
    resume: bool = False
    max_restarts: int = 0  # JAX engine on Ray: restarts on the surviving nodes after a lost process (0: fail fast)
    restart_wait: float = 0.0  # seconds a restart waits for a replacement node to join (0: go on with the survivors)
    overwrite: bool = False  # an --out holding another run's checkpoints: replace them (else refused)

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "JobConfig":
        return dataclasses.replace(self, **changes).validated()

    def validated(self) -> "JobConfig":
        check_model_name(self.model)
        _one_of("dataset", self.dataset, DATASETS)
        _one_of("engine", self.engine, ENGINES)
        _one_of("strategy", self.strategy, tuple(dict.fromkeys(STRATEGIES + ALPA_STRATEGIES)))
        check_engine_strategy(self.engine, self.strategy)
        _one_of("dtype", self.dtype, DTYPES)
        _one_of("remainder", self.remainder, REMAINDER_POLICIES)
        for name in ("batch_size", "epochs", "num_samples", "devices", "hidden_dim", "d_model",
                     "num_heads", "seq_len", "vocab_size", "num_layers", "width", "auto_trial_steps",
                     "micro_batches"):
            _positive(name, getattr(self, name))
        for name in ("checkpoint_every", "processes", "model_parallel", "pipeline_stages", "pipeline_layers",
                     "max_restarts", "restart_wait"):
            if getattr(self, name) < 0:
                raise KitError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.steps is not None:
            _positive("steps", self.steps)
        if self.learning_rate <= 0:
            raise KitError(f"--learning-rate must be > 0, got {self.learning_rate}")
        if (self.depth - 4) % 6 != 0 or self.depth < 10:
            raise KitError(f"--depth {self.depth} is not a WideResNet depth; use 6n+4 with n >= 1 (10, 16, 22, 28)")
        if self.d_model % self.num_heads != 0:
            raise KitError(f"--d-model {self.d_model} is not divisible by --num-heads {self.num_heads}; "
                           f"use a multiple of {self.num_heads}")
        if self.dataset == "cifar10" and self.model != "wide_resnet":
            raise KitError(f"--dataset cifar10 feeds images; use --model wide_resnet (got --model {self.model})")
        if self.dataset == "cifar10" and not self.data_dir:
            raise KitError("--dataset cifar10 needs --data-dir DIR with the CIFAR-10 python batches "
                           "(data_batch_1..5, test_batch); the kit never downloads at run time")
        if self.resume and not self.checkpoint_every:
            # Resuming without saving again would silently lose the resumed progress.
            raise KitError("--resume needs --checkpoint-every N so the resumed run keeps saving")
        if self.resume and self.overwrite:
            raise KitError("--resume continues the run in --out and --overwrite replaces it; pass one of them")
        return self


def check_engine_strategy(engine: str, strategy: str) -> None:
    """Refuse a JAX strategy on the Alpa engine and an Alpa method on the JAX engine (`auto` engines
    are checked again once resolved)."""
    if engine == "jax" and strategy not in STRATEGIES:
        raise KitError(f"--strategy {strategy} is an Alpa method; use --engine alpa, or with --engine jax one of: "
                       f"{', '.join(STRATEGIES)}")
    if engine == "alpa" and strategy not in ALPA_STRATEGIES:
        raise KitError(f"--strategy {strategy} is a JAX-engine strategy; with --engine alpa use one of: "
                       f"{', '.join(ALPA_STRATEGIES)}")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _one_of(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise KitError(not_known(f"--{_flag(name)}", value, allowed))


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise KitError(f"--{_flag(name)} must be a positive integer, got {value!r}")


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(JobConfig))


PRESETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")
BASE_KEY = "base_config"  # a file's parent: a preset name or a path relative to the file


def preset_names(presets_dir: str = PRESETS_DIR) -> List[str]:
    return sorted(n[: -len(".yaml")] for n in os.listdir(presets_dir) if n.endswith(".yaml"))


def load_preset(name: str, presets_dir: str = PRESETS_DIR) -> Dict[str, Any]:
    """The settings of `--preset NAME`, its base_config chain resolved (the base first)."""
    path = os.path.join(presets_dir, f"{name}.yaml")
    if "/" in name or not os.path.isfile(path):
        raise KitError(not_known("--preset", name, preset_names(presets_dir)))
    return _load_chain(path, f"preset {name}", presets_dir, ())


def load_yaml_overrides(path: str, presets_dir: str = PRESETS_DIR) -> Dict[str, Any]:
    """Read a `--config FILE`: a YAML mapping of JobConfig field names (dashes or underscores),
    with an optional `base_config:` (a preset name or another file) under it."""
    if not os.path.isfile(path):
        raise KitError(f"--config {path}: no such file; pass a YAML file of job settings")
    return _load_chain(path, f"--config {path}", presets_dir, ())


def load_layers(preset: Optional[str], config_path: Optional[str],
                presets_dir: str = PRESETS_DIR) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The two file layers, each read once: the preset's (and its bases'), the --config file's (and its bases')."""
    return (load_preset(preset, presets_dir) if preset else {},
            load_yaml_overrides(config_path, presets_dir) if config_path else {})


def merge_layers(layers: Tuple[Dict[str, Any], Dict[str, Any]]) -> Dict[str, Any]:
    """The file layers (`load_layers`) in override order: the preset (and its bases), then the --config file."""
    preset_values, file_values = layers
    return {**preset_values, **file_values}


def load_settings(preset: Optional[str], config_path: Optional[str],
                  presets_dir: str = PRESETS_DIR) -> Dict[str, Any]:
    return merge_layers(load_layers(preset, config_path, presets_dir))


def _load_chain(path: str, label: str, presets_dir: str, seen: Tuple[str, ...]) -> Dict[str, Any]:
    real = os.path.realpath(path)
    if real in seen:
        chain = " -> ".join(os.path.basename(p) for p in seen + (real,))
        raise KitError(f"{label}: base_config loops ({chain}); remove one base_config")
    data = _read_mapping(path, label)
    base = data.pop(BASE_KEY, data.pop(BASE_KEY.replace("_", "-"), None))
    values: Dict[str, Any] = {}
    if base is not None:
        base_path, base_label = _resolve_base(str(base), path, label, presets_dir)
        values.update(_load_chain(base_path, base_label, presets_dir, seen + (real,)))
    values.update(_settings(data, label))
    return values


def _resolve_base(base: str, from_path: str, label: str, presets_dir: str) -> Tuple[str, str]:
    """A base_config is a file (has a slash or a .yaml/.yml suffix; relative to the file naming it)
    or else a preset name."""
    if "/" in base or base.endswith((".yaml", ".yml")):
        path = os.path.join(os.path.dirname(os.path.abspath(from_path)), base)
        if not os.path.isfile(path):
            raise KitError(f"{label}: base_config {base}: no such file ({path}); fix the path")
        return path, f"base_config {base}"
    path = os.path.join(presets_dir, f"{base}.yaml")
    if not os.path.isfile(path):
        raise KitError(f"{label}: " + not_known("base_config", base, preset_names(presets_dir)))
    return path, f"preset {base}"


def _read_mapping(path: str, label: str) -> Dict[Any, Any]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        at = f" at line {where.line + 1}" if where else ""
        raise KitError(f"{label}: not valid YAML{at}; fix the file") from None
    if not isinstance(data, dict):
        raise KitError(f"{label}: expected a mapping of settings, got {type(data).__name__}")
    return data


def _settings(data: Dict[Any, Any], label: str) -> Dict[str, Any]:
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in FIELD_NAMES:
            raise KitError(f"{label}: unknown setting {key!r}{did_you_mean(name, FIELD_NAMES)}; "
                           f"known: {', '.join(FIELD_NAMES)}")
        out[name] = value
    return out


def build_config(file_values: Dict[str, Any], cli_values: Dict[str, Any]) -> JobConfig:
    """Defaults <- files (`merge_layers`) <- CLI (only flags the user actually gave), then validate once."""
    merged: Dict[str, Any] = {}
    merged.update(file_values)
    merged.update({k: v for k, v in cli_values.items() if v is not None})
    types = {f.name: f.type for f in dataclasses.fields(JobConfig)}
    for name, value in list(merged.items()):
        merged[name] = _coerce(name, value, types[name])
    return JobConfig(**merged).validated()


def _coerce(name: str, value: Any, type_name: Any) -> Any:
    text = str(type_name)
    try:
        if value is None:
            return None
        if "bool" in text:
            if isinstance(value, str):
                return value.strip().lower() in ("1", "true", "yes", "on")
            return bool(value)
        if "int" in text:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if "float" in text:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise KitError(f"setting {name}: {value!r} is not a valid {text.replace('Optional[', '').rstrip(']')}") from None
