"""The shape of one job setting, as the catalogue lists it and a model declares its own.

A `Setting` is everything the kit derives from one name: the `JobConfig` field (name, type hint,
default), its flag (`--name-with-dashes`, its metavar, its line and group in `--help`), and the
check its value gets (allowed names, or a bound). Nothing here imports a model or an engine, so a
model module can declare its settings with it and `--help` never starts jax.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, Optional, Tuple

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

# The types a setting may have (each optionally Optional): what a flag and a YAML scalar can carry.
TYPES = (int, float, str, bool)


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

    def __post_init__(self) -> None:  # the errors here are programming errors, not a user's
        if plain_type(self.type) not in TYPES:
            raise ValueError(f"setting {self.name}: type {self.type!r} is not one of {TYPES} (or Optional of one)")
        if self.check is not None and self.check not in CHECKS:
            raise ValueError(f"setting {self.name}: check {self.check!r} is not one of {CHECKS}")
        if self.group not in GROUPS:
            raise ValueError(f"setting {self.name}: group {self.group!r} is not one of {GROUPS}")

    @property
    def flag(self) -> str:
        return flag_of(self.name)

    def problem(self, value: Any) -> Optional[str]:
        """What is wrong with `value` for this setting's bound (None: nothing); choices are the
        catalogue's business, which words the error with a did-you-mean."""
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
