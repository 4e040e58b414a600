"""How a typed message travels: JSON text in the store, a checked frozen dataclass in memory.

`Message` is the base of every structured value DeadPool puts in the store (`messages.py`):
`encode()` writes its fields as a JSON object, `decode(key, raw)` reads one back and checks
every field against its type hint - an integer is an integer (not a bool, not text), a number
is finite, a rank map's keys are ranks, a nested message is read as one - and then the
message's own `validate()` checks ranges and relations (only what is read is checked: a message
the code builds is trusted, and a registration of 16,384 slots is not checked twice). Anything that does not fit raises
`ProtocolError`, which names the key, the message and the value: nothing read from the store is
used before it is checked. The readers are built once per message class from its type hints.

Supported field types: `int`, `float`, `str`, `bool`, `X | None`, `tuple[int, ...]`,
`dict[K, V]` with `K` `int` (JSON keys "0", "1", ...) or `str` and `V` any supported type or
`Any` (kept as read), an `Enum` of text values, and nested messages. Scalar values (a counter,
an iteration, a wall time, a digest) are read by `read_int`, `read_float` and `read_text`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any, ClassVar, Self

from ...errors import DeadpoolRuntimeError


class ProtocolError(DeadpoolRuntimeError):
    """A store value that is not the message its key holds (the message names key and value)."""


Reader = Callable[[Any], Any]
"""value read from JSON -> the field's value; raises `ValueError` (or `TypeError`) saying what
is wrong."""


class Message:
    """Base of the typed messages: a frozen dataclass with one `encode` and one `decode`."""

    _readers: ClassVar[dict[str, tuple[Reader, bool]]]

    def validate(self) -> None:
        """Ranges and relations of the fields, checked on every decode (`require`)."""

    def to_dict(self) -> dict[str, Any]:
        """The message as plain JSON data (also what event logs and summaries show)."""
        return _plain(self)

    def encode(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def decode(cls, key: str, raw: str | bytes) -> Self:
        """The message `raw` holds, read from store key `key`."""
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _error(key, raw, cls, f"not JSON ({exc})") from None
        return cls.from_data(key, raw, data)

    @classmethod
    def from_data(cls, key: str, raw: str | bytes, data: Any) -> Self:
        """The message from already parsed JSON `data` (`raw`: its text, for the error)."""
        try:
            return _build(cls, data)
        except (ValueError, TypeError) as exc:
            raise _error(key, raw, cls, str(exc)) from None


def _error(key: str, raw: str | bytes, cls: type, why: str) -> ProtocolError:
    shown = read_text(raw)
    shown = shown if len(shown) <= 200 else shown[:200] + "..."
    return ProtocolError(f"store key {key}: cannot read {cls.__name__} from {shown!r}: {why}")


# ---------------------------------------------------------------------- writing
def _plain(value: Any) -> Any:
    if isinstance(value, Message):
        fields = dataclasses.fields(value)  # type: ignore[arg-type]
        return {f.name: _plain(getattr(value, f.name)) for f in fields}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


# ---------------------------------------------------------------------- reading
def _build(cls: type[Any], data: Any) -> Any:
    message = cls(**_fields(cls, data))
    message.validate()
    return message


def _fields(cls: type[Message], data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, got {type(data).__name__}")
    readers = cls.__dict__.get("_readers") or _build_readers(cls)
    out = {}
    for name, (read, required) in readers.items():
        if name in data:
            try:
                out[name] = read(data[name])
            except (ValueError, TypeError) as exc:
                raise ValueError(f"field {name!r}: {exc}") from None
        elif required:
            raise ValueError(f"field {name!r} missing")
    return out


def _build_readers(cls: type[Message]) -> dict[str, tuple[Reader, bool]]:
    hints = typing.get_type_hints(cls)
    readers = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        readers[f.name] = (_reader(hints[f.name]), required)
    cls._readers = readers
    return readers


def _reader(hint: Any) -> Reader:
    """The reader of one field type (see the module docstring for what is supported)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return lambda v: v
    if hint is int:
        return _int
    if hint is float:
        return _float
    if hint is str:
        return lambda v: _typed(v, str, "text")
    if hint is bool:
        return lambda v: _typed(v, bool, "true or false")
    if isinstance(hint, type) and issubclass(hint, Enum):
        return lambda v: _enum(hint, v)
    if isinstance(hint, type) and issubclass(hint, Message):
        return lambda v: _build(hint, v)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = _reader(next(a for a in args if a is not type(None)))
        return lambda v: None if v is None else inner(v)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _reader(args[0])
        return lambda v: tuple(item(x) for x in _typed(v, list, "a list"))
    if origin is dict:
        key = _rank if args[0] is int else (lambda k: k)
        value = _reader(args[1])
        return lambda v: {key(k): value(x) for k, x in _typed(v, dict, "an object").items()}
    raise TypeError(f"no reader for field type {hint!r}")


def _typed(value: Any, kind: type, what: str) -> Any:
    if not isinstance(value, kind):
        raise TypeError(f"expected {what}, got {value!r}")
    return value


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{value} is not finite")
    return float(value)


def _rank(key: str) -> int:
    if not key.isdigit():
        raise ValueError(f"{key!r} is not a rank")
    return int(key)


def _enum(kind: type[Enum], value: Any) -> Enum:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{value!r} is not one of {[e.value for e in kind]}") from None


# ---------------------------------------------------------------------- scalars
def read_int(key: str, raw: str | bytes, *, minimum: int | None = None) -> int:
    """A scalar integer value (an iteration, a generation, a counter's text)."""
    try:
        value = int(read_text(raw).strip())
    except ValueError:
        raise ProtocolError(
            f"store key {key}: {read_text(raw)[:200]!r} is not an integer"
        ) from None
    if minimum is not None and value < minimum:
        raise ProtocolError(f"store key {key}: {value} is below {minimum}")
    return value


def read_float(key: str, raw: str | bytes) -> float:
    """A scalar number (a wall time, seconds), finite."""
    try:
        value = float(read_text(raw))
    except ValueError:
        raise ProtocolError(f"store key {key}: {read_text(raw)[:200]!r} is not a number") from None
    if not math.isfinite(value):
        raise ProtocolError(f"store key {key}: {value} is not finite")
    return value


def read_text(raw: str | bytes) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else raw


def require(condition: bool, what: str) -> None:
    """A message's own check (`Message.validate`): `ValueError` saying `what` is wrong."""
    if not condition:
        raise ValueError(what)
