"""The job config: one frozen dataclass, validated once, with a field per setting of the catalogue
(settings/catalog.py: name, type, default, help and check of each).

Override order (later wins): the defaults -> `--preset NAME` (alpa_job/settings/presets/NAME.yaml) ->
`--config FILE` -> command-line flags. A preset is an ordinary config file: a YAML mapping of field
names, which may start from another preset or file with `base_config:` (MaxText's base config +
overrides; resolved recursively, the base first). Every problem is a `KitError` that names the field
and the allowed values.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Collection, Dict, List, Optional, Tuple

from alpa_job.choices import did_you_mean, not_known
from alpa_job.errors import KitError
from alpa_job.settings import catalog
from alpa_job.settings.catalog import ALPA_STRATEGIES, STRATEGIES
from alpa_job.setting import ModelArgs, coerce, coerce_setting, flag_of


def _fields_from_the_catalogue(cls):
    """Make `cls` a frozen dataclass with one field per catalogue setting, in catalogue order."""
    taken = [s.name for s in catalog.SETTINGS if hasattr(cls, s.name)]
    if taken:  # a programming error: a setting would hide a method
        raise ValueError(f"settings named like JobConfig's methods: {', '.join(taken)}")
    cls.__annotations__ = {s.name: s.type for s in catalog.SETTINGS}
    for s in catalog.SETTINGS:
        # A mapping's default is made per instance (Python 3.9's dataclasses refuse a dict as a default).
        setattr(cls, s.name, dataclasses.field(default_factory=ModelArgs) if s.type is ModelArgs else s.default)
    return dataclasses.dataclass(frozen=True)(cls)


@_fields_from_the_catalogue
class JobConfig:
    """Every setting of a job (the catalogue's, in its order); `JobConfig()` is the defaults."""

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "JobConfig":
        return dataclasses.replace(self, **changes).validated()

    def validated(self) -> "JobConfig":
        """The job's own settings checked; the model's (`model_args`) are its declaration's business
        (models.model_values, where the model is resolved)."""
        if not isinstance(self.model_args, ModelArgs):
            object.__setattr__(self, "model_args", coerce("model_args", self.model_args, ModelArgs))
        for s in catalog.SETTINGS:  # names first, each error with the nearest allowed one
            if s.choices is not None and getattr(self, s.name) not in s.choices:
                raise KitError(not_known(s.flag, getattr(self, s.name), s.choices))
        check_engine_strategy(self.engine, self.strategy)
        for s in catalog.SETTINGS:
            if s.words and getattr(self, s.name) not in (True, False) + s.words:
                raise KitError(f"{s.flag} takes no value or one of: {', '.join(s.words)} (got {getattr(self, s.name)!r})")
            problem = s.problem(getattr(self, s.name))
            if problem:
                raise KitError(problem)
        if self.dataset == "cifar10" and not self.data_dir:
            raise KitError(
                "--dataset cifar10 needs --data-dir DIR with the CIFAR-10 python batches "
                "(data_batch_1..5, test_batch); the kit never downloads at run time"
            )
        if self.resume and not self.checkpoint_every:
            # Resuming without saving again would silently lose the resumed progress.
            raise KitError("--resume needs --checkpoint-every N so the resumed run keeps saving")
        if self.resume and self.overwrite:
            raise KitError("--resume continues the run in --out and --overwrite replaces it; pass one of them")
        if self.straggler_every and self.straggler_window < self.straggler_every:
            raise KitError(
                f"--straggler-window {self.straggler_window} is shorter than --straggler-every {self.straggler_every}: "
                "a window holds at least one round; pass a window of at least that many steps"
            )
        return self


def check_engine_strategy(engine: str, strategy: str) -> None:
    """Refuse a JAX strategy on the Alpa engine and an Alpa method on the JAX engine (`auto` engines
    are checked again once resolved)."""
    if engine == "jax" and strategy not in STRATEGIES:
        raise KitError(f"--strategy {strategy} is an Alpa method; use --engine alpa, or with --engine jax one of: {', '.join(STRATEGIES)}")
    if engine == "alpa" and strategy not in ALPA_STRATEGIES:
        raise KitError(f"--strategy {strategy} is a JAX-engine strategy; with --engine alpa use one of: {', '.join(ALPA_STRATEGIES)}")


FIELD_NAMES = catalog.FIELD_NAMES


PRESETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")
BASE_KEY = "base_config"  # a file's parent: a preset name or a path relative to the file


def preset_names(presets_dir: str = PRESETS_DIR) -> List[str]:
    return sorted(n[: -len(".yaml")] for n in os.listdir(presets_dir) if n.endswith(".yaml"))


def load_preset(name: str, presets_dir: str = PRESETS_DIR, model_keys: Collection[str] = ()) -> Dict[str, Any]:
    """The settings of `--preset NAME`, its base_config chain resolved (the base first). `model_keys`: model
    settings a file may also give at the top level (`num_layers: 4` for `model_args: {num_layers: 4}`)."""
    path = os.path.join(presets_dir, f"{name}.yaml")
    if "/" in name or not os.path.isfile(path):
        raise KitError(not_known("--preset", name, preset_names(presets_dir)))
    return _load_chain(path, f"preset {name}", presets_dir, (), model_keys)


def load_yaml_overrides(path: str, presets_dir: str = PRESETS_DIR, model_keys: Collection[str] = ()) -> Dict[str, Any]:
    """Read a `--config FILE`: a YAML mapping of JobConfig field names (dashes or underscores),
    with an optional `base_config:` (a preset name or another file) under it."""
    if not os.path.isfile(path):
        raise KitError(f"--config {path}: no such file; pass a YAML file of job settings")
    return _load_chain(path, f"--config {path}", presets_dir, (), model_keys)


def load_layers(
    preset: Optional[str], config_path: Optional[str], presets_dir: str = PRESETS_DIR, model_keys: Collection[str] = ()
) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """The two file layers, each read once: the preset's (and its bases'), the --config file's (and its bases')."""
    return (
        load_preset(preset, presets_dir, model_keys) if preset else {},
        load_yaml_overrides(config_path, presets_dir, model_keys) if config_path else {},
    )


def merge_layers(layers: Tuple[Dict[str, Any], Dict[str, Any]]) -> Dict[str, Any]:
    """The file layers (`load_layers`) in override order: the preset (and its bases), then the --config file."""
    preset_values, file_values = layers
    return _merged(preset_values, file_values)


def _merged(base: Dict[str, Any], over: Dict[str, Any]) -> Dict[str, Any]:
    """`over` on top of `base`; a mapping setting (model_args) merges key by key, so a flag's
    --model-arg changes one of the file's model settings, not all of them."""
    out = dict(base)
    for name, value in over.items():
        if name in MAPPINGS and name in out and value is not None and out[name] is not None:
            value = {**coerce(name, out[name], ModelArgs), **coerce(name, value, ModelArgs)}
        out[name] = value
    return out


MAPPINGS = tuple(s.name for s in catalog.SETTINGS if s.type is ModelArgs)


def load_settings(
    preset: Optional[str], config_path: Optional[str], presets_dir: str = PRESETS_DIR, model_keys: Collection[str] = ()
) -> Dict[str, Any]:
    return merge_layers(load_layers(preset, config_path, presets_dir, model_keys))


def _load_chain(path: str, label: str, presets_dir: str, seen: Tuple[str, ...], model_keys: Collection[str]) -> Dict[str, Any]:
    real = os.path.realpath(path)
    if real in seen:
        chain = " -> ".join(os.path.basename(p) for p in seen + (real,))
        raise KitError(f"{label}: base_config loops ({chain}); remove one base_config")
    data = _read_mapping(path, label)
    base = data.pop(BASE_KEY, data.pop(BASE_KEY.replace("_", "-"), None))
    values: Dict[str, Any] = {}
    if base is not None:
        base_path, base_label = _resolve_base(str(base), path, label, presets_dir)
        values = _load_chain(base_path, base_label, presets_dir, seen + (real,), model_keys)
    # Merged like the other layers: a file's model_args change its base's one by one, not all of them.
    return _merged(values, _settings(data, label, model_keys))


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


def _settings(data: Dict[Any, Any], label: str, model_keys: Collection[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    spelled: Dict[str, Any] = {}  # model settings given at the top level
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in model_keys and name not in FIELD_NAMES:
            spelled[name] = value
            continue
        if name not in FIELD_NAMES:
            known = FIELD_NAMES + tuple(model_keys)
            raise KitError(
                f"{label}: unknown setting {key!r}{did_you_mean(name, known)}; "
                f"known: {', '.join(FIELD_NAMES)}, and the model's own settings under model_args:"
            )
        out[name] = value
    if spelled:
        out["model_args"] = _with_spellings(
            coerce("model_args", out.get("model_args") or {}, ModelArgs),
            spelled,
            lambda name: f"{label}: {name}:",
            lambda name: f"model_args: {name}:",
        )
    return out


def _with_spellings(
    model_args: ModelArgs, spelled: Dict[str, Any], label: Callable[[str], str], args_label: Callable[[str], str]
) -> ModelArgs:
    """`model_args` plus model settings spelled as settings of their own (`--num-layers 4`, YAML
    `num_layers: 4`); the same setting given both ways with two values is an error, not a silent choice."""
    out = dict(model_args)
    for name, value in spelled.items():
        if name in out and coerce(name, out[name], type(value), label=label(name)) != value:
            raise KitError(f"{label(name)} {value} and {args_label(name)}{out[name]} disagree; give one of them")
        out[name] = value
    return ModelArgs(out)


def build_config(file_values: Dict[str, Any], cli_values: Dict[str, Any], model_flags: Optional[Dict[str, Any]] = None) -> JobConfig:
    """Defaults <- files (`merge_layers`) <- CLI (only flags the user actually gave), then validate once.
    `model_flags`: model settings given as flags of their own (a built-in's `--num-layers 4`), typed."""
    given = {k: v for k, v in cli_values.items() if v is not None}
    merged = _merged(file_values, given)
    for name, value in list(merged.items()):
        merged[name] = coerce_setting(catalog.BY_NAME[name], value)
    flags = {k: v for k, v in (model_flags or {}).items() if v is not None}
    if flags:
        # A flag disagrees only with a --model-arg of the command line; it overrides what the files say.
        cli_args = coerce("model_args", given.get("model_args") or {}, ModelArgs)
        _with_spellings(cli_args, flags, flag_of, lambda name: f"--model-arg {name}=")
        merged["model_args"] = ModelArgs({**(merged.get("model_args") or {}), **flags})
    return JobConfig(**merged).validated()
