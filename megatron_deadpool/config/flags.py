"""Config dataclasses -> command-line flags and YAML sections, in one place.

`add_flags` turns a `kw_only` dataclass into argparse arguments (the field's docstring is
the help, as Megatron-LM's `argument_utils` does), `from_namespace` reads them back, and
`from_mapping` builds a dataclass from a YAML section, rejecting unknown keys and wrong types
with a `ConfigError` that names the key and the expected type. A field that `FLAG_NAMES`
renames has the same name as its YAML key (`--deadpool-spare-ranks`, `spare_ranks:`); the
field's own name is still read there, with a one-line warning naming the new key
(`yaml_keys`, `to_mapping`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import logging
import textwrap
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, get_args, get_origin

from ..errors import ConfigError

T = TypeVar("T")

log = logging.getLogger(__name__)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings written under each field of dataclass `cls` (its flag help)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in itertools.pairwise(body):
            if (
                isinstance(stmt, ast.AnnAssign)
                and isinstance(stmt.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def flag_name(prefix: str, name: str) -> str:
    """`--{prefix}-{name}` with underscores as dashes; the field `enabled` is `--{prefix}`."""
    if name == "enabled":
        return f"--{prefix}"
    stem = name.replace("_", "-")
    return f"--{prefix}-{stem}" if prefix else f"--{stem}"


def primary_flag(cls: type, prefix: str, name: str) -> str:
    """The flag `add_flags` shows first for field `name` of `cls` (its `FLAG_NAMES` entry,
    else `flag_name`): the spelling documentation uses."""
    renamed: Mapping[str, str] = getattr(cls, "FLAG_NAMES", {})
    return flag_name(prefix, renamed.get(name, name))


def _resolved_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(get_args(tp)) == 2:
            return args[0], True
    return tp, False


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    prefix: str,
    aliases: Mapping[str, list[str]] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> None:
    """Add one flag per field of `cls`; dest is `{prefix}_{field}` (or the field for no prefix).
    A field that `cls.FLAG_NAMES` names otherwise gets that flag first, its own name after it
    (accepted, as an older spelling)."""
    docs = field_docs(cls)
    hints = _resolved_hints(cls)
    renamed: Mapping[str, str] = getattr(cls, "FLAG_NAMES", {})
    for f in dataclasses.fields(cls):
        names = [flag_name(prefix, f.name), *(aliases or {}).get(f.name, [])]
        if f.name in renamed:  # the flag's name, the field's own kept as an older spelling
            names.insert(0, flag_name(prefix, renamed[f.name]))
        dest = dest_name(prefix, f.name)
        default = (defaults or {}).get(f.name, _default_of(f))
        kwargs: dict[str, Any] = {"dest": dest, "default": default, "help": docs.get(f.name, "")}
        tp, _optional = _unwrap_optional(hints[f.name])
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif get_origin(tp) is list:
            kwargs.update(action="append", type=get_args(tp)[0], default=None)
        elif get_origin(tp) is Literal:
            kwargs.update(choices=list(get_args(tp)), type=str)
        elif tp in (int, float, str):
            kwargs.update(type=tp, metavar=f.name.upper())
        else:  # pragma: no cover - a new field type needs a rule here
            raise TypeError(f"no flag rule for field {cls.__name__}.{f.name}: {tp}")
        parser.add_argument(*names, **kwargs)


def dest_name(prefix: str, name: str) -> str:
    """The argparse dest of field `name` under `prefix`."""
    return f"{prefix.replace('-', '_')}_{name}" if prefix else name


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def from_namespace(cls: type[T], args: argparse.Namespace, *, prefix: str) -> T:
    """Build `cls` from the flags `add_flags` added (validation runs in `__post_init__`)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(args, dest_name(prefix, f.name))
        if value is None and f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        values[f.name] = value
    return cls(**values)


def yaml_keys(cls: type) -> dict[str, str]:
    """Field name -> its YAML key: the name of its flag (`FLAG_NAMES`) with underscores, else
    the field's own name (`spares` -> `spare_ranks`, as `--deadpool-spare-ranks`)."""
    renamed: Mapping[str, str] = getattr(cls, "FLAG_NAMES", {})
    return {f.name: renamed.get(f.name, f.name).replace("-", "_") for f in dataclasses.fields(cls)}


def to_mapping(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` (field -> value, `dataclasses.asdict` of a `cls`) under their YAML keys, as
    `from_mapping` reads them back."""
    keys = yaml_keys(cls)
    return {keys.get(name, name): value for name, value in values.items()}


def _field_values(cls: type, data: dict[str, Any], where: str) -> dict[str, tuple[str, Any]]:
    """A YAML section's keys as `cls`'s field names (field -> (the key given, its value)): a
    renamed field's YAML key, or (with a one-line warning naming the new key) its older
    spelling, the field's own name."""
    keys = yaml_keys(cls)
    names = set(keys.values())
    fields: dict[str, tuple[str, Any]] = {}
    for key, value in data.items():
        field = next((f for f, k in keys.items() if k == key), None)
        if field is None and key in keys and key not in names:  # the older spelling
            new = keys[key]
            if new in data:
                raise ConfigError(
                    f"{where}.{key}: {key!r} is the older spelling of {new!r}; give only {new!r}"
                )
            log.warning("%s.%s: the key %r is deprecated; name it %r", where, key, key, new)
            field = key
        if field is None:
            known = ", ".join(sorted(names))
            raise ConfigError(f"{where}.{key}: unknown key; known keys are: {known}")
        fields[field] = (key, value)
    return fields


def from_mapping(cls: type[T], data: Mapping[str, Any] | None, *, where: str) -> T:
    """Build `cls` from a YAML section (its keys `yaml_keys`); unknown keys and wrong types
    raise `ConfigError`."""
    data = dict(data or {})
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of keys to values")
    hints = _resolved_hints(cls)
    values = {
        name: _coerce(value, hints[name], f"{where}.{key}")
        for name, (key, value) in _field_values(cls, data, where).items()
    }
    return cls(**values)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{where}: must not be empty")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif get_origin(tp) is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(str, get_args(tp)))}")
    elif get_origin(tp) is list:
        if isinstance(value, list):
            return [_coerce(v, get_args(tp)[0], f"{where}[{i}]") for i, v in enumerate(value)]
    else:  # pragma: no cover
        raise TypeError(f"no YAML rule for {where}: {tp}")
    name = getattr(tp, "__name__", str(tp))
    raise ConfigError(f"{where}: expected {name}, got {type(value).__name__} {value!r}")
