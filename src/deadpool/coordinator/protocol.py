"""Control-plane messages: the store keys and the JSON plan every process reads (no pickle anywhere).

Recovery, as the store sees it (generation g fails, g+1 replaces it):

    coordinator                      survivors / activated spare
    -----------                      ---------------------------
    sees rank f's process exit
    set plan/{g+1}, gen=g+1,
    set abort/{g}          ------>   collective fails or abort/{g} seen; drop old group
                                     stop snapshot engine
                           <------   g{g+1}/ready/{rank} = intact snapshot steps
    choose restore step C
    set committed, g{g+1}/target -->  restore C, join group g{g+1}, agree on (C, checksum)
                           <------   g{g+1}/resumed/{rank}
    log swap with its phases
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Plan:
    """Who is which rank in one generation, and who holds whose replica."""

    generation: int
    ranks: tuple[str, ...]                 # rank -> process name
    holders: tuple[tuple[str, ...], ...]   # rank -> processes holding its replica
    spares: tuple[str, ...]                # idle spares, in pool order
    reason: str = "job start"
    replicate: bool = True                 # False when snapshots are off: spares then hold nothing

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def rank_of(self, proc: str) -> int | None:
        return self.ranks.index(proc) if proc in self.ranks else None

    def held_by(self, proc: str) -> list[int]:
        """The ranks whose snapshots `proc` must hold in this generation."""
        return [rank for rank, holders in enumerate(self.holders) if proc in holders]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "Plan":
        raw = json.loads(text)
        return cls(generation=raw["generation"], ranks=tuple(raw["ranks"]),
                   holders=tuple(tuple(h) for h in raw["holders"]), spares=tuple(raw["spares"]),
                   reason=raw["reason"], replicate=raw["replicate"])


class Keys:
    """Every store key of a job, under a prefix that carries the job's secret token."""

    def __init__(self, token: str) -> None:
        self.prefix = f"deadpool/{token}/"

    def _k(self, name: str) -> str:
        return self.prefix + name

    # membership
    def generation(self) -> str:
        return self._k("gen")

    def plan(self, gen: int) -> str:
        return self._k(f"plan/{gen}")

    def abort(self, gen: int) -> str:
        return self._k(f"abort/{gen}")

    def shutdown(self) -> str:
        return self._k("shutdown")

    # data planes get their own prefixes, one per generation, so stale peers never meet new ones
    def group_prefix(self, gen: int) -> str:
        return self._k(f"g{gen}/pg/")

    def pair_prefix(self, gen: int, rank: int, holder: str) -> str:
        return self._k(f"g{gen}/rep/{rank}/{holder}/")

    # commit tracking
    def durable(self, gen: int, step: int) -> str:
        return self._k(f"g{gen}/durable/{step}")

    def commit_marker(self, gen: int, step: int) -> str:
        return self._k(f"g{gen}/commit/{step}")

    def committed(self) -> str:
        return self._k("committed")

    # recovery
    def ready(self, gen: int, rank: int) -> str:
        return self._k(f"g{gen}/ready/{rank}")

    def target(self, gen: int) -> str:
        return self._k(f"g{gen}/target")

    def resumed(self, gen: int, rank: int) -> str:
        return self._k(f"g{gen}/resumed/{rank}")

    # faults fire once per job, whoever runs the rank
    def fault_fired(self, index: int) -> str:
        return self._k(f"fault/{index}")


def encode(obj: object) -> str:
    return json.dumps(obj)


def decode(raw: bytes | str) -> object:
    return json.loads(raw)
