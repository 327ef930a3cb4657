"""Models by name: each model registers itself; `get_model(config)` -> `ModelSpec`.

A model is two modules named after it:
- `<name>_settings.py` declares the settings its builder reads (`SETTINGS`, a tuple of
  `alpa_job.settings.setting.Setting`) and, where sizes must agree, `check(config)`. It imports no
  flax, so the settings catalogue, `--help` and every check before Ray read it without jax.
- `<name>.py` (flax) decorates its builder with `@register_model(...)`, naming the model, the batch
  field it reads, its loss, and its layer structure (what the Alpa engine counts pipeline stages in).
  It is imported when its entry is first asked for: the runner emulates CPU devices only while jax
  is not yet imported.
Adding a model = those two modules + its name in MODEL_MODULES.

A model module only names logical axes (models/axes.py); which mesh axis splits them is the
engine's business.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Dict, Optional, Tuple

from alpa_job.choices import not_known
from alpa_job.errors import KitError
from alpa_job.settings.setting import Setting

# The modules that register a model, in the order `--model` lists them; each registers the model
# named like the module.
MODEL_MODULES = ("mlp", "wide_resnet", "gpt")


@dataclasses.dataclass(frozen=True)
class RepeatedBlocks:
    """A model's parameters as a shell plus identically shaped blocks, so the state's initialiser
    compiles one block once instead of every layer (engines/state_init.py says why).

    `shell.init(rng, <the batch field>)["params"]` gives every parameter outside the blocks, named
    as in the whole model; `block.init(rng, <block_input>)["params"]` gives one block's; the whole
    model's parameters are the shell's plus one block under each of `names`.
    """

    shell: Any  # a flax module (or wrapper with .init) over the model's batch field
    block: Any  # the repeated flax module
    block_input: Any  # jax.ShapeDtypeStruct: what one block is called on
    names: Tuple[str, ...]  # the blocks' names in the whole model's params, in order


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    module: Any  # a flax.linen.Module
    input_key: str  # the batch field the module reads
    has_batch_stats: bool  # BatchNorm running statistics live beside params
    loss: Callable  # loss(outputs, batch) -> per-example loss, shape [batch]
    # repeated_blocks(module, batch_field: ShapeDtypeStruct) -> RepeatedBlocks, for models made of
    # identical layers; None: the state is initialised whole.
    repeated_blocks: Optional[Callable] = None

    def apply_train(self, variables: Dict[str, Any], batch: Dict[str, Any]):
        """Forward pass in training mode; returns (outputs, new batch_stats or None)."""
        if self.has_batch_stats:
            out, updates = self.module.apply(variables, batch[self.input_key], train=True,
                                             mutable=["batch_stats"])
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


def mse(outputs, batch):
    """Per-example mean squared error against batch["y"]."""
    return ((outputs - batch["y"]) ** 2).mean(axis=-1)


def cross_entropy(logits, labels):
    """Per-position cross entropy, computed in float32 whatever the logits' dtype.

    The fused form in models/losses.py: fp32 log-sum-exp over bf16 logits, gradient written in
    the logits' dtype, so no fp32 copy of the logits is kept for the backward pass.
    """
    from alpa_job.models.losses import cross_entropy as fused

    return fused(logits, labels)


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """What the kit knows about one model, registered by its module."""

    name: str
    build: Callable  # build(config, dtype) -> the flax module
    input_key: str  # the batch field the module reads
    loss: Callable  # loss(outputs, batch) -> per-example loss, shape [batch]
    layer_count: Callable  # layer_count(config) -> the model's repeated layers (pipeline boundaries count them)
    layer_class: Callable  # layer_class() -> the flax class whose calls are those layers
    synthetic: Callable  # synthetic(config, rng, n) -> {field: array of n rows}, learnable (data.synthetic)
    has_batch_stats: bool = False  # BatchNorm running statistics live beside params
    repeated_blocks: Optional[Callable] = None  # see ModelSpec.repeated_blocks

    @property
    def hyperparameters(self) -> Tuple[str, ...]:
        """The JobConfig fields the builder reads: the model's declared settings."""
        return tuple(s.name for s in model_settings(self.name))

    def defaults(self) -> Dict[str, Any]:
        """The model's hyperparameters with their default values (as declared: one place)."""
        return {s.name: s.default for s in model_settings(self.name)}


_REGISTRY: Dict[str, ModelEntry] = {}


def register_model(name: str, *, input_key: str, loss: Callable, layer_count: Callable, layer_class: Callable,
                   synthetic: Callable, has_batch_stats: bool = False, repeated_blocks: Optional[Callable] = None) -> Callable:
    """Decorator for a model module's builder: `@register_model("gpt", ...) def build(config, dtype)`."""

    def decorate(build: Callable) -> Callable:
        if name in _REGISTRY and _REGISTRY[name].build is not build:
            raise ValueError(f"model {name!r} is registered twice")  # a programming error, not a user's
        _REGISTRY[name] = ModelEntry(name, build, input_key, loss, layer_count, layer_class, synthetic,
                                     has_batch_stats, repeated_blocks)
        return build

    return decorate


def model_names() -> Tuple[str, ...]:
    """The `--model` names, without importing any model (so without importing jax)."""
    return MODEL_MODULES


def check_model_name(name: str) -> None:
    if name not in MODEL_MODULES:
        raise KitError(not_known("--model", name, MODEL_MODULES))


def model_settings(name: str) -> Tuple[Setting, ...]:
    """The settings model `name` reads (`Setting`s), from its declaration module `<name>_settings`,
    which imports no flax: the catalogue, `--help` and the checks before Ray read them without jax."""
    return _declaration(name).SETTINGS


def check_model_sizes(config) -> None:
    """Every model's own rule on its sizes (`check(config)` in its declaration, where it has one), whichever
    model runs: a size flag that no rule of its model allows is wrong even before it is found inert."""
    for name in MODEL_MODULES:
        check = getattr(_declaration(name), "check", None)
        if check is not None:
            check(config)


def _declaration(name: str):
    check_model_name(name)
    return importlib.import_module(f"{__name__}.{name}_settings")


def get_entry(name: str) -> ModelEntry:
    """The registered entry of model `name` (imports its module, hence flax, on first use)."""
    check_model_name(name)
    importlib.import_module(f"{__name__}.{name}")
    if name not in _REGISTRY:
        raise ValueError(f"module {__name__}.{name} registers no model {name!r}")  # a programming error
    return _REGISTRY[name]


def registered() -> Dict[str, ModelEntry]:
    """Every model's entry, in MODEL_MODULES order."""
    return {name: get_entry(name) for name in MODEL_MODULES}


def get_model(config) -> ModelSpec:
    import jax.numpy as jnp

    entry = get_entry(config.model)
    dtype = jnp.bfloat16 if config.dtype == "bfloat16" else jnp.float32
    return ModelSpec(entry.name, entry.build(config, dtype), entry.input_key, entry.has_batch_stats, entry.loss,
                     entry.repeated_blocks)
