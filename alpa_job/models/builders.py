"""A `--model` as a builder function: found (a built-in, an installed entry point, or
PACKAGE.MODULE:FUNCTION), imported, its settings read from its own declaration, and called.

A builder declares its settings as a dataclass annotating its first parameter, or as typed keyword
parameters (alpa_job/api.py shows both); a built-in lists its `Setting`s in `<name>_settings.py` (with
their help and choices, readable without jax) and receives them as a namespace. Every model's settings
travel in the job config's `model_args`, typed by its declaration. Every mistake here is a one-line `KitError` naming the fix: the
driver resolves the model before Ray starts, so a typo never reaches a cluster.

Importing this module imports no jax; importing a user's builder module may.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import os
import re
import sys
import types
import typing
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from alpa_job import api
from alpa_job.choices import did_you_mean
from alpa_job.errors import KitError
from alpa_job.setting import SCALARS, ModelArgs, Setting, coerce, plain_type

# PACKAGE.MODULE:FUNCTION (the module path may be a single name; the function may be an attribute path).
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")

# How a builder takes its settings: a namespace of the `Setting`s it lists (the built-ins), its dataclass,
# or keyword arguments.
LISTED, DATACLASS, KEYWORDS = "listed", "dataclass", "keywords"
FIX_DECLARATION = (
    "declare its settings as a dataclass on its first parameter (def build(args: Args, dtype)) "
    "or as typed keywords (def build(*, dtype, num_layers: int = 2))"
)


def is_import_path(name: str) -> bool:
    return bool(IMPORT_PATH.match(name))


@dataclasses.dataclass(frozen=True)
class Declaration:
    """A builder's settings: those a flag or YAML scalar can set, and the rest (kept at their default)."""

    style: str  # LISTED | DATACLASS | KEYWORDS
    settings: Tuple[Setting, ...]
    required: Tuple[str, ...] = ()  # declared without a default: --model-arg must give them
    fixed: Dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> a type hint no flag carries
    args_class: Optional[type] = None  # DATACLASS: the declaration

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(s.name for s in self.settings)


@dataclasses.dataclass(frozen=True)
class Builder:
    model: str  # what --model said
    target: str  # MODULE:FUNCTION
    function: Callable
    declaration: Declaration


# ----------------------------------------------------------------------------- import
def import_builder(model: str, target: str) -> Callable:
    """The function `target` (MODULE:FUNCTION) names, or a one-line error saying what failed and why."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        missing = getattr(err, "name", None) or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise KitError(
                f"--model {model}: cannot import {module_name} ({err}); install its package or put the "
                "folder that holds it on PYTHONPATH (ray job submit: --working-dir)"
            ) from None
        raise KitError(f"--model {model}: importing {module_name} failed: {err}; install what it imports") from None
    except Exception as err:  # noqa: BLE001 - the user's module raised while importing: say where
        raise KitError(
            f"--model {model}: importing {module_name} raised {type(err).__name__}: {err}{_where(err)}; fix the module"
        ) from None
    found: Any = module
    for part in attr.split("."):
        if not hasattr(found, part):
            functions = _functions_of(module)
            listing = f"; its functions: {', '.join(functions)}" if functions else "; it defines no function"
            raise KitError(f"--model {model}: {module_name} has no {attr}{did_you_mean(attr, functions)}{listing}")
        found = getattr(found, part)
    if not callable(found) or isinstance(found, types.ModuleType):
        raise KitError(
            f"--model {model}: {target} is a {type(found).__name__}, not a function; name the "
            "builder function that returns an alpa_job.api.Model"
        )
    return found


def _where(err: BaseException) -> str:
    frames = [f for f in _traceback_frames(err) if "importlib" not in f[0]]
    return f" ({frames[-1][0]}:{frames[-1][1]})" if frames else ""


def _traceback_frames(err: BaseException):
    tb = err.__traceback__
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename, tb.tb_lineno
        tb = tb.tb_next


def _functions_of(module) -> Tuple[str, ...]:
    return tuple(
        sorted(
            name
            for name, value in vars(module).items()
            if inspect.isfunction(value) and value.__module__ == module.__name__ and not name.startswith("_")
        )
    )


# ----------------------------------------------------------------------------- the declaration
def declaration_of(model: str, function: Callable) -> Declaration:
    """The settings `function` declares: a dataclass on its first parameter, or typed keywords."""
    name = getattr(function, "__qualname__", repr(function))
    try:
        signature = inspect.signature(function)
        hints = typing.get_type_hints(function)
    except Exception as err:  # noqa: BLE001 - an unresolvable annotation, a builtin without a signature
        raise KitError(f"--model {model}: cannot read {name}'s parameters ({type(err).__name__}: {err}); {FIX_DECLARATION}") from None
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    first_hint = hints.get(positional[0].name) if positional else None
    if isinstance(first_hint, type) and dataclasses.is_dataclass(first_hint):
        if len(positional) < 2 and "dtype" not in signature.parameters:
            raise KitError(
                f"--model {model}: {name} takes no dtype; define it as def {function.__name__}(args: {first_hint.__name__}, dtype)"
            )
        return _dataclass_declaration(model, first_hint)
    if "dtype" not in signature.parameters:
        raise KitError(f"--model {model}: {name} takes no dtype parameter; {FIX_DECLARATION}")
    settings, required, fixed = [], [], {}
    for p in params:
        if p.name == "dtype" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        hint = hints.get(p.name)
        default = p.default if p.default is not p.empty else _REQUIRED
        if hint is None and default is not _REQUIRED and type(default) in SCALARS:
            hint = type(default)
        if hint is None or p.kind == p.POSITIONAL_ONLY:
            raise KitError(f"--model {model}: {name}'s parameter {p.name!r} has no type hint or default; {FIX_DECLARATION}")
        _declare(model, p.name, hint, default, {}, settings, required, fixed)
    return Declaration(KEYWORDS, tuple(settings), tuple(required), fixed)


_REQUIRED = object()


def _dataclass_declaration(model: str, cls: type) -> Declaration:
    try:
        hints = typing.get_type_hints(cls)
    except Exception as err:  # noqa: BLE001
        raise KitError(
            f"--model {model}: cannot read the fields of {cls.__name__} ({type(err).__name__}: {err}); "
            "use types Python can resolve (int, float, str, bool)"
        ) from None
    settings, required, fixed = [], [], {}
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        default = field.default
        if default is dataclasses.MISSING:
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else _REQUIRED
        _declare(model, field.name, hints.get(field.name, Any), default, field.metadata, settings, required, fixed)
    return Declaration(DATACLASS, tuple(settings), tuple(required), fixed, cls)


def _declare(
    model: str, name: str, hint: Any, default: Any, metadata: Mapping[str, Any], settings: list, required: list, fixed: dict
) -> None:
    if plain_type(hint) not in SCALARS:
        if default is _REQUIRED:
            raise KitError(
                f"--model {model}: setting {name!r} has type {_type_name(hint)}, which --model-arg cannot "
                "give, and no default; give it a default or make it int, float, str or bool"
            )
        fixed[name] = hint
        return
    try:
        settings.append(
            Setting(
                name,
                hint,
                None if default is _REQUIRED else default,
                str(metadata.get("help", "")),
                check=metadata.get("check"),
                cli_flag=f"--model-arg {name}",
            )
        )
    except ValueError as err:
        raise KitError(f"--model {model}: setting {name!r}: {err}; use one of api.POSITIVE, api.NON_NEGATIVE, api.ABOVE_ZERO") from None
    if default is _REQUIRED:
        required.append(name)


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is None and isinstance(hint, type):
        return hint.__name__
    return str(hint).replace("typing.", "")  # Tuple[int, int], not Tuple


# ----------------------------------------------------------------------------- values and the call
def typed_args(builder: Builder, given: Mapping[str, Any]) -> ModelArgs:
    """Every declared setting's value: `given` (--model-arg, model_args:) coerced to its declared type,
    the declaration's default for the rest."""
    declaration = builder.declaration
    known = {s.name: s for s in declaration.settings}
    values: Dict[str, Any] = {}
    for key, value in given.items():
        if key in declaration.fixed:
            raise KitError(
                f"--model-arg {key}: --model {builder.model} declares it as "
                f"{_type_name(declaration.fixed[key])}, which --model-arg cannot give; drop it (its "
                "default is used) or declare it as int, float, str or bool"
            )
        values[key] = model_arg(builder.model, known, key, value)
        problem = known[key].problem(values[key])
        if problem:
            raise KitError(problem)
    missing = [n for n in declaration.required if n not in values]
    if missing:
        needs = " ".join(f"--model-arg {n}=<{_type_name(plain_type(known[n].type))}>" for n in missing)
        raise KitError(f"--model {builder.model} needs {needs} (declared without a default)")
    full = {s.name: s.default for s in declaration.settings if s.name not in declaration.required}
    full.update(values)
    return ModelArgs(full)


def model_arg(model: str, known: Mapping[str, Setting], key: str, value: Any) -> Any:
    """One `--model-arg KEY=VALUE` of `--model model`, typed to its setting in `known`; a key the model
    does not declare is a one-line error with the nearest name."""
    if key not in known:
        names = ", ".join(known) or "none"
        raise KitError(f"--model-arg {key}: --model {model} has no setting {key!r}{did_you_mean(key, known)}; its settings: {names}")
    return coerce(key, value, known[key].type, label=f"--model-arg {key}")


def args_object(builder: Builder, values: Mapping[str, Any]) -> Any:
    """What the builder (and its `synthetic`) receives: its dataclass, or a namespace of its keywords."""
    if builder.declaration.style == DATACLASS:
        return builder.declaration.args_class(**values)
    return types.SimpleNamespace(**values)


def call(builder: Builder, args: Any, values: Mapping[str, Any], dtype: Any) -> api.Model:
    """Call the builder and check that it returned an `api.Model` whose parts the kit can use."""
    if builder.declaration.style == KEYWORDS:
        result = builder.function(dtype=dtype, **values)
    else:
        result = builder.function(args, dtype)
    check_model(builder, result)
    return result


def check_model(builder: Builder, result: Any) -> None:
    where = f"--model {builder.model}" + ("" if builder.model == builder.target else f" ({builder.target})")
    if not isinstance(result, api.Model):
        fix = (
            "wrap it: return api.Model(module=<it>, input_field=..., loss=...)"
            if _is_module(result)
            else "return api.Model(module=..., input_field=..., loss=...)"
        )
        raise KitError(f"{where} returned {_describe(result)}, not an alpa_job.api.Model; {fix}")
    if not _is_module(result.module):
        raise KitError(
            f"{where}: its Model's module is {_describe(result.module)}, not a flax module "
            "(nothing with init/apply); pass the flax.linen.Module"
        )
    if not isinstance(result.input_field, str) or not result.input_field:
        raise KitError(
            f"{where}: its Model's input_field is {_describe(result.input_field)}; name the batch "
            'field the module reads, e.g. input_field="tokens"'
        )
    if result.depth_setting is not None:
        ints = [s.name for s in builder.declaration.settings if plain_type(s.type) is int]
        if result.depth_setting not in ints:
            raise KitError(
                f"{where}: its Model's depth_setting {result.depth_setting!r} is not one of its int "
                f"settings ({', '.join(ints) or 'none'}); name the setting that counts its repeated "
                "layers, or drop depth_setting"
            )
    for part in ("loss", "synthetic", "repeated_blocks"):
        value = getattr(result, part)
        if (value is not None or part == "loss") and not callable(value):
            raise KitError(
                f"{where}: its Model's {part} is {_describe(value)}, not a function; pass one (alpa_job/api.py says what {part} receives)"
            )


def _is_module(value: Any) -> bool:
    return hasattr(value, "init") and hasattr(value, "apply") and not isinstance(value, type)


def _describe(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, type):
        return f"the class {value.__name__}"
    if _is_module(value):
        return f"the flax module {type(value).__name__}"
    text = repr(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(value).__name__} {text}"


# ----------------------------------------------------------------------------- the source a step depends on
def source_digest(function: Callable) -> Optional[str]:
    """A hash of the source of the package the builder lives in (its top-level package's .py files,
    or its one module): a compiled step stored for one version of the model never loads for another."""
    module = sys.modules.get(getattr(function, "__module__", "") or "")
    if module is None:
        return None
    top = sys.modules.get(module.__name__.split(".")[0], module)
    paths = list(getattr(top, "__path__", []) or [])
    digest = hashlib.sha256()
    if not paths:
        path = getattr(top, "__file__", None)
        if not path or not os.path.isfile(path):
            return None
        with open(path, "rb") as f:
            digest.update(f.read())
        return digest.hexdigest()
    for folder in sorted(paths):
        for root, dirs, files in os.walk(folder):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(root, name)
                digest.update(os.path.relpath(path, folder).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()
