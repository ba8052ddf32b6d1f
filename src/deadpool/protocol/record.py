"""How a record crosses processes: a frozen dataclass as one JSON object, parsed strictly by its field types.

A reader never gets half a record: a field missing, unknown or of the wrong type is a ProtocolError that
names the record and the field, never a KeyError deep in the reader. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
from collections.abc import Mapping
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from deadpool.errors import ProtocolError

R = TypeVar("R", bound="Record")


class Record:
    """Base of the control plane's records; each subclass is a frozen dataclass of JSON-able fields (int,
    float, str, bool, None, str enums, tuples, mappings, nested dataclasses)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))  # type: ignore[call-overload]

    @classmethod
    def from_json(cls: type[R], text: str | bytes) -> R:
        value: R = _convert(json_object(cls.__name__, text), cls, cls.__name__, "")
        return value


def json_object(kind: str, text: str | bytes) -> dict[str, Any]:
    """The JSON object a `kind` record is sent as, or a ProtocolError saying why the text is none."""
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise ProtocolError(f"malformed {kind} record: not JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"malformed {kind} record: expected an object, got {type(raw).__name__}")
    return raw


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _wrong(kind: str, where: str, hint: Any, value: Any) -> ProtocolError:
    return ProtocolError(f"malformed {kind} record: field {where!r} is not {hint}: {value!r}")


def _convert(value: Any, hint: Any, kind: str, where: str) -> Any:
    """`value` as read from JSON, checked against (and shaped into) the field type `hint`."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        for arg in args:
            try:
                return _convert(value, arg, kind, where)
            except ProtocolError:
                continue
        raise _wrong(kind, where, hint, value)
    if dataclasses.is_dataclass(hint):
        return _build(value, hint, kind, where)
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise _wrong(kind, where, hint.__name__, value) from None
    if origin is tuple:
        if not isinstance(value, list):
            raise _wrong(kind, where, "a list", value)
        return tuple(_convert(v, args[0], kind, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise _wrong(kind, where, "an object", value)
        return {_key(k, args[0], kind, where): _convert(v, args[1], kind, f"{where}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if hint is type(None) and value is None:
        return None
    if hint in (int, str, bool) and isinstance(value, hint) and (hint is bool or not isinstance(value, bool)):
        return value
    raise _wrong(kind, where, getattr(hint, "__name__", hint), value)


def _key(key: str, hint: Any, kind: str, where: str) -> Any:
    """A mapping's key: JSON writes every key as a string, so an int key is read back from its digits."""
    if hint is int:
        try:
            return int(key)
        except ValueError:
            raise _wrong(kind, f"{where} key", "an integer", key) from None
    return key


def _build(value: Any, cls: Any, kind: str, where: str) -> Any:
    """An instance of dataclass `cls` from a JSON object holding exactly its fields."""
    if not isinstance(value, dict):
        raise _wrong(kind, where, "an object", value)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ProtocolError(f"malformed {kind} record: unknown field(s) {', '.join(unknown)}")
    hints, out = _hints(cls), {}
    for name in names:
        path = f"{where}.{name}" if where else name
        if name not in value:
            raise ProtocolError(f"malformed {kind} record: field {path!r} is missing")
        out[name] = _convert(value[name], hints[name], kind, path)
    return cls(**out)
