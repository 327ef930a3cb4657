"""Models by name: `--model` is a built-in, an installed model, or your own builder; `get_model(config)`
builds it as the engines' `ModelSpec`.

Every model is a builder returning `alpa_job.api.Model` (the public API, api.py), found by:
- a built-in name (BUILT_IN): `<name>.py` defines `build(args, dtype)`, and `<name>_settings.py`
  lists the settings it reads (`SETTINGS`, `Setting`s, and where they must agree `check(args)`)
  without flax, so `--help` and every check before Ray read them without jax; `--num-layers 4` (and a
  YAML `num_layers: 4`) is another spelling of `--model-arg num_layers=4`;
- an entry point of an installed package (group `alpa_job.models`, models/installed.py);
- `PACKAGE.MODULE:FUNCTION`: the user's builder, whose settings come from its own declaration
  (models/builders.py) and reach it from `--model-arg KEY=VALUE` / YAML `model_args:`.
Every model's settings travel in the job config's `model_args`; `model_values(config)` types them by the
model's declaration (the settings package knows no model). A built-in's module is imported when it is
first built: the runner emulates CPU devices only while jax is not yet imported. A user's builder is
imported and called once in the driver before Ray starts (`resolve`), so a wrong one is a one-line
error there.

A model only names logical axes (api.py); which mesh axis splits them is the engine's business.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple

from alpa_job import api
from alpa_job.choices import did_you_mean
from alpa_job.errors import KitError
from alpa_job.models import builders
from alpa_job.models.installed import installed_models
from alpa_job.setting import ModelArgs, Setting, flag_of

# The kit's own models, in the order `--model` lists them; each is the module named like it.
BUILT_IN = ("mlp", "wide_resnet", "gpt")
# The built-ins whose dense layers take api.dot_general: what --precision fp8 runs in fp8.
FP8_READY = ("gpt",)

# The public API's pieces under their old names here, for the kit's own modules.
RepeatedBlocks = api.RepeatedBlocks
mse = api.mse
cross_entropy = api.cross_entropy


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A built model as the engines use it (made from the builder's `api.Model`)."""

    name: str
    module: Any  # a flax.linen.Module
    input_key: str  # the batch field the module reads
    has_batch_stats: bool  # BatchNorm running statistics live beside params
    loss: Callable  # loss(outputs, batch) -> per-example loss, shape [batch]
    # repeated_blocks(batch_field: ShapeDtypeStruct) -> RepeatedBlocks, for models made of identical
    # layers; None: the state is initialised whole.
    repeated_blocks: Optional[Callable] = None
    synthetic: Optional[Callable] = None  # synthetic(rng, n) -> {field: n rows}, the builder's args bound
    decode: Optional[Callable] = None  # decode(record bytes) -> {field: array}, for --dataset array_record
    dataset: Optional[Callable] = None  # dataset(path, split) -> grain.MapDataset, the builder's args bound
    layer_count: Optional[int] = None  # the repeated layers (Alpa's pipeline boundaries count them)
    layer_class: Optional[type] = None  # the flax class whose calls are those layers
    depth_setting: Optional[str] = None  # the builder setting that counts those layers (api.Model)
    hf: Optional[Any] = None  # api.HfWeights: the parameters as a Hugging Face checkpoint's tensors
    causal_attention: bool = False  # api.Model: MFU counts causal attention at half (engines/flops.py)

    def apply_train(self, variables: Dict[str, Any], batch: Dict[str, Any]):
        """Forward pass in training mode; returns (outputs, new batch_stats or None)."""
        if self.has_batch_stats:
            out, updates = self.module.apply(variables, batch[self.input_key], train=True, mutable=["batch_stats"])
            return out, updates["batch_stats"]
        return self.module.apply(variables, batch[self.input_key]), None

    def masked_loss(self, params, batch_stats, batch: Dict[str, Any]):
        """Mean loss over the real rows of a fixed-shape batch; returns (loss, new batch_stats).

        Padded rows (mask 0) carry no weight, so a padded last batch trains like a short one.
        Both engines differentiate this same function.
        """
        import jax.numpy as jnp

        variables = {"params": params}
        if self.has_batch_stats:
            variables["batch_stats"] = batch_stats
        outputs, new_stats = self.apply_train(variables, batch)
        per_example = self.loss(outputs, batch).astype(jnp.float32)
        mask = batch["mask"]
        return (per_example * mask).sum() / jnp.maximum(mask.sum(), 1.0), new_stats

    def eval_sums(self, params, batch_stats, batch: Dict[str, Any]):
        """(sum of the per-example loss over real rows, real rows) in inference mode: sums, so eval
        batches and processes add up to one exact mean."""
        import jax.numpy as jnp

        variables = {"params": params}
        if self.has_batch_stats:
            variables["batch_stats"] = batch_stats
            outputs = self.module.apply(variables, batch[self.input_key], train=False)
        else:
            outputs = self.module.apply(variables, batch[self.input_key])
        per_example = self.loss(outputs, batch).astype(jnp.float32)
        return (per_example * batch["mask"]).sum(), batch["mask"].sum()


# ----------------------------------------------------------------------------- names and declarations (no jax)
def is_built_in(name: str) -> bool:
    return name in BUILT_IN


def model_names() -> Tuple[str, ...]:
    """The `--model` names: the built-ins, then the installed models (no model is imported)."""
    return BUILT_IN + tuple(n for n in installed_models() if n not in BUILT_IN)


def check_model_name(name: str) -> None:
    """A built-in, an installed model or PACKAGE.MODULE:FUNCTION; else one line with the nearest name."""
    if is_built_in(name) or builders.is_import_path(name):
        return
    names = model_names()
    if name in names:
        return
    raise KitError(
        f"--model {name!r} is not known; use one of: {', '.join(names)}, or your own builder as "
        f"PACKAGE.MODULE:FUNCTION{did_you_mean(name, names)}"
    )


def model_settings(name: str) -> Tuple[Setting, ...]:
    """The settings built-in model `name` lists (`Setting`s), from its declaration module `<name>_settings`,
    which imports no flax: `--help` and every check before Ray read them without jax."""
    return _declaration(name).SETTINGS


def size_settings() -> Tuple[Setting, ...]:
    """Every built-in's settings, each marked with its model, in `--model` order: the size flags
    (`--num-layers 4` is `--model-arg num_layers=4`) and the top-level YAML keys that mean the same."""
    return tuple(dataclasses.replace(setting, model=name) for name in BUILT_IN for setting in model_settings(name))


def size_names() -> FrozenSet[str]:
    """The names of every built-in's settings: what a flag or a file's top level may give outside model_args."""
    return frozenset(s.name for s in size_settings())


def model_input_field(name: str) -> str:
    """The batch field built-in model `name` reads (from its declaration: no jax)."""
    return _declaration(name).INPUT_FIELD


def _declaration(name: str):
    if not is_built_in(name):
        raise KitError(f"--model {name!r} is not built in; use one of: {', '.join(BUILT_IN)}")
    return importlib.import_module(f"{__name__}.{name}_settings")


def declaration_of(name: str) -> builders.Declaration:
    """The settings `--model name` declares: a built-in's from its declaration module (no jax), a
    brought model's from its builder (imported)."""
    if is_built_in(name):
        return builders.Declaration(builders.LISTED, model_settings(name))
    return builder_of(name).declaration


def model_values(config) -> ModelArgs:
    """Every setting of `config`'s model, typed: its `model_args` coerced by the model's declaration, the
    declaration's defaults for the rest, and the model's own rule on them (a built-in's `check`). One
    line naming the fix for a key the model does not declare."""
    return _model_values(config.model, config.model_args)


@functools.lru_cache(maxsize=64)
def _model_values(name: str, given: ModelArgs) -> ModelArgs:
    check_model_name(name)
    declaration = declaration_of(name)
    for key in given:
        owner = _built_in_owning(key)
        if key not in declaration.names and owner is not None and owner != name:
            # A size no rule of its own model allows is wrong even before it is found to do nothing here.
            _model_values(owner, ModelArgs({key: given[key]}))
            reads = (
                f"reads {', '.join(flag_of(n) for n in declaration.names)}"
                if is_built_in(name)
                else "takes its settings as --model-arg KEY=VALUE"
            )
            raise KitError(
                f"{flag_of(key)} does nothing here: it sizes --model {owner}, and --model {name} {reads}; drop it or use --model {owner}"
            )
    values = builders.typed_args(builders.Builder(name, name, None, declaration), given)
    check = getattr(_declaration(name), "check", None) if is_built_in(name) else None
    if check is not None:
        check(types.SimpleNamespace(**values))
    return values


def _built_in_owning(key: str) -> Optional[str]:
    return next((name for name in BUILT_IN if any(s.name == key for s in model_settings(name))), None)


# ----------------------------------------------------------------------------- builders (may import jax)
@functools.lru_cache(maxsize=None)
def builder_of(name: str) -> builders.Builder:
    """The builder `--model name` means, imported, with its declaration read (once per process)."""
    check_model_name(name)
    if is_built_in(name):
        target = f"{__name__}.{name}:build"
        return builders.Builder(name, target, builders.import_builder(name, target), declaration_of(name))
    target = name if builders.is_import_path(name) else installed_models()[name]
    if not builders.is_import_path(target):
        raise KitError(
            f"--model {name}: the installed entry point names {target!r}, not MODULE:FUNCTION; fix the "
            "package's alpa_job.models entry point"
        )
    function = builders.import_builder(name, target)
    return builders.Builder(name, target, function, builders.declaration_of(name, function))


def resolve(config):
    """In the driver, before Ray (and once in each process that reads a config from elsewhere): type the
    model's settings (`model_args` becomes every declared setting's value) and check them against the
    dataset; a brought model's builder is imported and called once, so every mistake is a one-line
    error now. A built-in is checked from its declaration, without jax."""
    config = config.replace(model_args=model_values(config))
    if is_built_in(config.model):  # matched against the dataset with the data checks (data/checks.py)
        return config
    builder = builder_of(config.model)
    model = builders.call(builder, builders.args_object(builder, config.model_args), config.model_args, _dtype(config))
    check_data_fits(config, model)
    return config


def check_synthetic(config, model) -> None:
    """`model` (an api.Model or the ModelSpec built from it) can make --dataset synthetic's data."""
    if model.synthetic is None:
        raise KitError(
            f"--model {config.model} gives no synthetic data (its api.Model has synthetic=None); add a "
            "synthetic(args, rng, n) function to it or train on --dataset cifar10"
        )


def check_data_fits(config, model) -> None:
    """The dataset gives the batch field the model (an api.Model, or a built-in's name) reads."""
    field = model.input_field if not isinstance(model, str) else model_input_field(model)
    if config.dataset == "cifar10" and isinstance(model, str) and field != "image":
        raise KitError(f"--dataset cifar10 feeds images; use --model wide_resnet (got --model {config.model})")
    if config.dataset == "synthetic" and not isinstance(model, str):
        check_synthetic(config, model)
    gives = {"cifar10": ("image", "label"), "tokens": ("tokens",)}.get(config.dataset)
    if gives and field not in gives:
        raise KitError(
            f"--dataset {config.dataset} gives the batch field(s) {', '.join(gives)}, and --model "
            f"{config.model} reads {field!r}; use a model whose input_field is {gives[0]!r} "
            "or another --dataset"
        )
    if config.dataset == "model" and not isinstance(model, str) and model.dataset is None:
        raise KitError(
            f"--dataset model: --model {config.model} provides no dataset (its api.Model has "
            "dataset=None); add dataset(args, path, split) to it or use --dataset tokens|array_record|npz"
        )
    if config.dataset == "model" and isinstance(model, str):
        raise KitError(
            f"--dataset model: the built-in --model {model} provides no dataset of its own; use --dataset tokens|array_record|npz"
        )


def build_model(config) -> Tuple[api.Model, Any]:
    """(the builder's api.Model, the args it was built with) for `config`."""
    builder = builder_of(config.model)
    values = model_values(config)
    args = builders.args_object(builder, values)
    return builders.call(builder, args, values, _dtype(config)), args


def get_model(config) -> ModelSpec:
    model, args = build_model(config)
    repeated = model.repeated_blocks
    synthetic, dataset = model.synthetic, model.dataset
    return ModelSpec(
        config.model,
        model.module,
        model.input_field,
        bool(model.batch_stats),
        model.loss,
        repeated_blocks=repeated,
        synthetic=(lambda rng, n: synthetic(args, rng, n)) if synthetic is not None else None,
        decode=model.decode,
        dataset=(lambda path, split: dataset(args, path, split)) if dataset is not None else None,
        layer_count=model.layer_count,
        layer_class=model.layer_class,
        depth_setting=model.depth_setting,
        hf=model.hf,
        causal_attention=bool(model.causal_attention),
    )


def stronger_remat(config) -> Tuple[str, ...]:
    """The model's `--remat` policies that keep less than the one `config` runs with (a `remat` setting with
    choices, listed from keeping the most to the least): ways out of a step that does not fit. () for a
    model without one."""
    setting = next((s for s in declaration_of(config.model).settings if s.name == "remat" and s.choices), None)
    current = model_values(config).get("remat")
    if setting is None or current not in setting.choices:
        return ()
    return setting.choices[setting.choices.index(current) + 1 :]


def depth_of(config, model: ModelSpec) -> Optional[int]:
    """How many repeated layers `config` gives the model (None: its builder declares no depth_setting)."""
    if model.depth_setting is None:
        return None
    value = model_values(config).get(model.depth_setting)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def at_depth(config, model: ModelSpec, depth: int) -> Tuple[Any, ModelSpec]:
    """(config, model) for a copy of `model` with `depth` repeated layers, everything else the same."""
    shallow = config.replace(model_args={**model_values(config), model.depth_setting: depth})
    return shallow, get_model(shallow)


def source_digest(config) -> Optional[str]:
    """The user's model source (None for a built-in, which is the kit's own source): part of the key a
    compiled step is stored under."""
    if is_built_in(config.model):
        return None
    return builders.source_digest(builder_of(config.model).function)


def _dtype(config):
    import jax.numpy as jnp

    return jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32


__all__ = [
    "BUILT_IN",
    "ModelSpec",
    "RepeatedBlocks",
    "mse",
    "cross_entropy",
    "is_built_in",
    "model_names",
    "check_model_name",
    "model_settings",
    "size_settings",
    "declaration_of",
    "model_values",
    "builder_of",
    "resolve",
    "build_model",
    "get_model",
    "depth_of",
    "at_depth",
    "source_digest",
]
