"""The plan of one generation: the record every process reads to learn who it is and whom it serves."""

from __future__ import annotations

from dataclasses import dataclass, field

from deadpool.protocol.record import Record


@dataclass(frozen=True)
class Plan(Record):
    """Who is which rank in one generation, who holds whose replica, and where takers get their state.
    Key plan/{g}. Writer: the coordinator, once per generation. Readers: every process of the job."""

    generation: int
    ranks: tuple[str, ...]                 # rank -> process name
    holders: tuple[tuple[str, ...], ...]   # rank -> processes holding its replica (for this generation's snapshots)
    spares: tuple[str, ...]                # idle spares, in pool order
    reason: str = "job start"
    replicate: bool = True                 # False when snapshots are off: spares then hold nothing
    sources: tuple[str | None, ...] = ()   # rank -> process that streams its replica to the new owner, or None
    replicas: int = 1                      # holders wanted per rank (--replicas)
    nodes: dict[str, int] = field(default_factory=dict)  # process -> its node; none: each is its own machine
    fresh: tuple[tuple[str, ...], ...] = ()  # rank -> its holders placed anew: they get the restored snapshot

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def rank_of(self, proc: str) -> int | None:
        return self.ranks.index(proc) if proc in self.ranks else None

    def held_by(self, proc: str) -> list[int]:
        """The ranks whose snapshots `proc` must hold in this generation."""
        return [rank for rank, holders in enumerate(self.holders) if proc in holders]

    def source_of(self, rank: int) -> str | None:
        return self.sources[rank] if rank < len(self.sources) else None

    def fresh_for(self, rank: int) -> tuple[str, ...]:
        """Holders of `rank` that do not hold its restored snapshot yet: the rank sends it to them before
        this generation runs, or a failure right after the recovery would find no copy of it."""
        return self.fresh[rank] if rank < len(self.fresh) else ()

    def sends_from(self, proc: str) -> list[int]:
        """The ranks whose replicas `proc` must stream to their new owners while this generation recovers."""
        return [rank for rank, source in enumerate(self.sources) if source == proc]
