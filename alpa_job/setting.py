"""The shape of one job setting, as the catalogue lists it and a model declares its own.

A `Setting` is everything the kit derives from one name: the `JobConfig` field (name, type hint,
default), its flag (`--name-with-dashes`, its metavar, its line and group in `--help`), and the
check its value gets (allowed names, or a bound). Nothing here imports a model or an engine, so a
model module can declare its settings with it and `--help` never starts jax.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any, Optional, Tuple

from alpa_job.errors import KitError

# The `--help` groups of `python -m alpa_job train`, in the order they are shown.
MODEL_AND_DATA = "model and data"
PARALLELISM = "parallelism"
CLUSTER = "cluster"
OUTPUT = "output"
GROUPS = (MODEL_AND_DATA, PARALLELISM, CLUSTER, OUTPUT)

# Bounds a value may have to keep (checked when it is not None).
POSITIVE = "positive"  # an integer > 0
NON_NEGATIVE = "non-negative"  # >= 0
ABOVE_ZERO = "above zero"  # a number > 0
CHECKS = (POSITIVE, NON_NEGATIVE, ABOVE_ZERO)


class ModelArgs(dict):
    """A model's own settings, name -> value (`--model-arg KEY=VALUE`, YAML `model_args:`): read-only
    and hashable like the rest of the frozen config, picklable for Ray, and a plain mapping in JSON."""

    def _read_only(self, *_args: Any, **_kwargs: Any) -> None:
        raise TypeError("ModelArgs is read-only; build a new one")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _read_only  # type: ignore

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted((k, repr(v)) for k, v in self.items())))

    def __reduce__(self):
        return (ModelArgs, (dict(self),))

    def __repr__(self) -> str:
        return f"ModelArgs({dict.__repr__(self)})"


# The types a setting may have (each optionally Optional): what a flag and a YAML scalar can carry,
# and the one mapping, a model's own settings.
SCALARS = (int, float, str, bool)
TYPES = SCALARS + (ModelArgs,)


@dataclasses.dataclass(frozen=True)
class Switch:
    """A flag that sets its setting to one value (`--pad-remainder` sets remainder to "pad")."""

    flag: str
    value: Any
    help: str


@dataclasses.dataclass(frozen=True)
class Setting:
    """One job setting. `type` is a real type hint (int, float, str, bool, Optional[...]): the parser
    converts with it and a YAML value is coerced to it."""

    name: str
    type: Any
    default: Any
    help: str
    group: str = MODEL_AND_DATA
    choices: Optional[Tuple[str, ...]] = None  # the allowed values, shown as {a,b} in --help
    check: Optional[str] = None  # POSITIVE | NON_NEGATIVE | ABOVE_ZERO
    metavar: Optional[str] = None  # --help's placeholder (default: the name in capitals)
    default_help: Optional[str] = None  # --help's words for the default, where its value says little
    switches: Tuple[Switch, ...] = ()  # flags setting one value each, instead of --name VALUE
    model: Optional[str] = None  # the model that declared it (set by the catalogue)
    # False for what cannot change the compiled train step (where the run writes, when it stops, how
    # it restarts, what the data's values are): such a setting stays out of the stored step's key, so
    # changing it reuses the step instead of compiling again. True is the safe side for a new setting.
    decides_step: bool = True
    cli_flag: Optional[str] = None  # the flag, where it is not --name-with-dashes
    # A bool setting's other values, words (`--resume auto`): the flag alone still means True.
    words: Tuple[str, ...] = ()

    def __post_init__(self) -> None:  # the errors here are programming errors, not a user's
        if plain_type(self.type) not in TYPES:
            raise ValueError(f"setting {self.name}: type {self.type!r} is not one of {TYPES} (or Optional of one)")
        if self.check is not None and self.check not in CHECKS:
            raise ValueError(f"setting {self.name}: check {self.check!r} is not one of {CHECKS}")
        if self.group not in GROUPS:
            raise ValueError(f"setting {self.name}: group {self.group!r} is not one of {GROUPS}")

    @property
    def flag(self) -> str:
        return self.cli_flag or flag_of(self.name)

    def problem(self, value: Any) -> Optional[str]:
        """What is wrong with `value` for this setting's bound (None: nothing); choices are the
        catalogue's business, which words the error with a did-you-mean."""
        if isinstance(value, float) and not math.isfinite(value):
            # nan passes every comparison below and inf every bound: neither is ever a usable setting.
            return f"{self.flag} must be a finite number, got {value}"
        if value is None or self.check is None:
            return None
        if self.check == POSITIVE and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            return f"{self.flag} must be a positive integer, got {value!r}"
        if self.check == NON_NEGATIVE and value < 0:
            return f"{self.flag} must be >= 0, got {value}"
        if self.check == ABOVE_ZERO and value <= 0:
            return f"{self.flag} must be > 0, got {value}"
        return None


def plain_type(hint: Any) -> Any:
    """The type inside `Optional[...]` (`Optional[int]` -> int); any other hint as it is."""
    if typing.get_origin(hint) is typing.Union:
        inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        if len(inner) == 1:
            return inner[0]
    return hint


def flag_of(name: str) -> str:
    """A setting's flag: `batch_size` -> `--batch-size`."""
    return "--" + name.replace("_", "-")


def coerce(name: str, value: Any, hint: Any, label: Optional[str] = None) -> Any:
    """A value given as text or YAML as the setting's type (`hint`, Optional allowed): YAML gives `8`
    for a float, "true" or 1 for a bool, 16.0 for an int; a flag gives text. `label` names the
    setting in the error (default: "setting NAME")."""
    if value is None:
        return None
    kind = plain_type(hint)
    label = label or f"setting {name}"
    if kind is ModelArgs:
        return model_args(value, label)
    try:
        if kind is bool:
            if isinstance(value, str):
                word = value.strip().lower()
                if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                    raise ValueError(value)
                return word in ("1", "true", "yes", "on")
            return bool(value)
        if kind is int:
            if isinstance(value, bool) or isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if kind is str:
            return str(value)
    except (TypeError, ValueError):
        raise KitError(f"{label}: {value!r} is not a valid {kind.__name__}") from None
    raise TypeError(f"{label}: no coercion to {hint!r}")  # a programming error: TYPES has more


def coerce_setting(setting: "Setting", value: Any) -> Any:
    """`coerce` for one catalogue setting: one of its words (`auto`) stays that word."""
    if setting.words and isinstance(value, str) and value.strip().lower() in setting.words:
        return value.strip().lower()
    if setting.words and isinstance(value, str) and not _bool_word(value):
        raise KitError(f"{setting.flag} takes no value or one of: {', '.join(setting.words)} (got {value!r})")
    return coerce(setting.name, value, setting.type)


def _bool_word(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off")


def model_args(value: Any, label: str) -> ModelArgs:
    """A YAML mapping, or the `KEY=VALUE` texts of repeated --model-arg flags, as ModelArgs (values
    as given: the model's declaration types them)."""
    if isinstance(value, dict):
        return ModelArgs((str(k).replace("-", "_"), v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        pairs = []
        for item in value:
            if isinstance(item, (list, tuple)) and len(item) == 2:
                pairs.append((str(item[0]), item[1]))
                continue
            key, sep, text = str(item).partition("=")
            if not sep or not key.strip():
                raise KitError(f"--model-arg {item!r} is not KEY=VALUE; write e.g. --model-arg num_layers=4")
            pairs.append((key.strip().replace("-", "_"), text))
        return ModelArgs(pairs)
    raise KitError(f"{label}: expected a mapping of a model's settings (model_args: {{num_layers: 4}}), got {type(value).__name__}")
