"""Typed records that cross processes through the control plane: frozen, one writer each, JSON on the wire.

Each record parses what it reads strictly: a field missing or of the wrong type is a ProtocolError naming
the record and the field, never a KeyError deep in the reader.

    coordinator --PersistOrder (persist/order)-------------> every process (the writers it names)
    writer      --PersistReport (persist/{step}/{proc})---> coordinator (finalizes the checkpoint)
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from deadpool.errors import ProtocolError


def _parse(kind: str, text: str | bytes, fields: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """The JSON object of one record, with every field present and of its type."""
    try:
        raw = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise ProtocolError(f"malformed {kind} record: not JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ProtocolError(f"malformed {kind} record: expected an object, got {type(raw).__name__}")
    for name, types in fields.items():
        allowed = types if isinstance(types, tuple) else (types,)
        value = raw.get(name)
        is_bool_for_number = isinstance(value, bool) and bool not in allowed  # JSON true is no step number
        if name not in raw or not isinstance(value, allowed) or is_bool_for_number:
            raise ProtocolError(f"malformed {kind} record: field {name!r} is missing or not {types}")
    return {name: raw[name] for name in fields}


@dataclass(frozen=True)
class PersistOrder:
    """The coordinator's order to write committed step `step` to disk; writers[rank] is the process that
    writes that rank's snapshot (an idle holder of its replica, else the rank itself). Writer: coordinator."""

    step: int
    gen: int
    writers: tuple[str, ...]
    reason: str

    def ranks_of(self, proc: str) -> list[int]:
        return [rank for rank, writer in enumerate(self.writers) if writer == proc]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> PersistOrder:
        raw = _parse("PersistOrder", text, {"step": int, "gen": int, "writers": list, "reason": str})
        if not all(isinstance(w, str) for w in raw["writers"]):
            raise ProtocolError("malformed PersistOrder record: writers must be process names")
        return cls(raw["step"], raw["gen"], tuple(raw["writers"]), raw["reason"])


@dataclass(frozen=True)
class PersistReport:
    """A writer's answer to a PersistOrder: its part of checkpoint `step` is on disk (ok) or why not.
    Writer: the process `proc`, once per order."""

    step: int
    proc: str
    ranks: tuple[int, ...]
    ok: bool
    error: str = ""
    nbytes: int = 0
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> PersistReport:
        raw = _parse("PersistReport", text, {"step": int, "proc": str, "ranks": list, "ok": bool, "error": str,
                                             "nbytes": int, "seconds": (int, float)})
        return cls(raw["step"], raw["proc"], tuple(raw["ranks"]), raw["ok"], raw["error"], raw["nbytes"],
                   float(raw["seconds"]))
