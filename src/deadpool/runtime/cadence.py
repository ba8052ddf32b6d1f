"""`--snapshot-every auto`: how often to snapshot, priced by what a snapshot takes from the steps.

A snapshot's work (copy and hash, the send to its holders, their receive and check) runs beside training,
so its cost is not how long that work takes but how much longer the steps get: nearly all of its CPU time
on a machine whose cores are busy training, almost nothing on one with idle cores. Neither the engine's
busy time (mostly waiting for the holder's acknowledgment) nor a thread's CPU time says which, so `auto`
measures the loss itself, as an A/B test inside the run:

    steps 1..WARM_STEPS                    a snapshot after every step (slots and holders' buffers fill)
    steps WARM_STEPS+1..CALIBRATION_STEPS  a snapshot after every even step only: each odd step runs
                                           beside a snapshot's work ("loaded"), each even one without

Each loaded step is compared with the mean of its two free neighbours, so slow drifts of the machine
cancel; the median over those pairs is the cost. The interval is the densest whose cost per step stays
within the budget (a fraction of a free step).

Nine pairs price a snapshot only roughly (a step's own jitter is of the order of the cost), so the pricing
goes on: with an interval of 2 or more, the step after each snapshot is loaded and its neighbours are free,
and every REPRICE_STEPS the ranks agree again on the interval from the pairs of the last PRICED_STEPS. The
estimate tightens as a run goes on and follows a machine whose load changes. With an interval of 1 no step
is free, and the interval stays (it is within the budget already). Pure functions: the step loop records
when steps end and which were snapshotted, and agree.py makes every rank take the same interval.

Under a fixed interval, `behind` says when training waits for the snapshot engine long enough that the
user must be told, and which interval the engine would keep up with (an H200 with 0.68 GB of state and
149 ms steps waited 334 ms a step at every step: docs/benchmarks.md "GPU: one H200").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

WARM_STEPS = 4          # even, so that the loaded steps are the odd ones
CALIBRATION_STEPS = 24  # the interval is agreed at the end of this step: 9 loaded steps, each between free ones
REPRICE_STEPS = 50      # then agreed again every this many steps
PRICED_STEPS = 500      # from the pairs among the last this many steps (a machine's load drifts)


def snapshots_after(step: int) -> bool:
    """While calibrating: whether a snapshot is taken after `step`."""
    return step <= WARM_STEPS or step % 2 == 0


def agrees_after(step: int) -> bool:
    """Whether the ranks agree on the interval at the end of `step`: the calibration's end, then every
    REPRICE_STEPS (a step number, so that every rank, a spare that took a rank over included, agrees at the
    same step)."""
    return step >= CALIBRATION_STEPS and (step - CALIBRATION_STEPS) % REPRICE_STEPS == 0


@dataclass(frozen=True)
class Price:
    """What `auto` measured: a snapshot's cost in step time, a free step, and how many pairs say so."""

    cost_s: float   # the median over the pairs of (loaded step - mean of its free neighbours), at least 0
    step_s: float   # the median free step
    pairs: int

    def interval(self, budget: float) -> int:
        """The densest interval whose cost per step stays within `budget` of a free step."""
        return max(1, math.ceil(self.cost_s / (budget * self.step_s))) if self.step_s > 0 else 1


def price(durations: dict[int, float], snapshotted: set[int]) -> Price | None:
    """The cost measured from one rank's timed steps (step -> wall duration) and the steps after which it
    took a snapshot; None without a pair (too few steps timed since the start or a recovery, or an interval
    of 1). A step is free if no snapshot was taken after the step before it; a pair is a loaded step
    (a snapshot was taken just before it) between two free ones."""
    free = {s: d for s, d in durations.items() if s - 1 not in snapshotted}
    pairs = [durations[s] - (free[s - 1] + free[s + 1]) / 2 for s in durations
             if s - 1 in snapshotted and s - 1 in free and s + 1 in free]
    if not pairs:
        return None
    return Price(cost_s=max(0.0, statistics.median(pairs)), step_s=statistics.median(free.values()),
                 pairs=len(pairs))


BEHIND_STEPS = 10    # the shortest window over which training's wait for snapshots is judged (else the interval)
BEHIND_SHARE = 0.10  # waiting this share of the window's time is worth telling the user


def behind_window(every: int) -> int:
    """How many recent steps the wait is judged over: at least one whole interval, whose first step waits
    for the last snapshot's copy to land however fast the engine is."""
    return max(BEHIND_STEPS, every)


@dataclass(frozen=True)
class Behind:
    """Training waits for the snapshot engine: a snapshot takes longer than the steps between two."""

    waited_share: float  # of the window's wall time
    engine_s: float      # the engine's busy time per snapshot (copy, hash, send, acks)
    step_s: float        # a step without the wait
    every: int           # the interval snapshots were taken at
    advice_every: int    # the densest interval the engine would keep up with: engine_s / step_s, rounded up

    def message(self) -> str:
        return (f"snapshots are slowing training: it waited {self.waited_share:.0%} of its last "
                f"{behind_window(self.every)} steps for the snapshot engine (a snapshot takes it "
                f"{self.engine_s * 1e3:.0f} ms, against {self.every * self.step_s * 1e3:.0f} ms of training "
                f"between two snapshots). Snapshot every {self.advice_every} steps or more (--snapshot-every "
                f"{self.advice_every}), or let DeadPool price the interval (--snapshot-every auto)")


def behind(waits: list[float], durations: list[float], engine_s: list[float], every: int) -> Behind | None:
    """Whether, over the last behind_window(every) steps (`waits`: each's wait for the last snapshot's copy,
    which waits for the engine to finish the one before and for a free slot; `durations`: each's whole
    time), training waited more than BEHIND_SHARE of its time for the snapshot engine; None if it did not
    (or too few steps or snapshots are known yet). `engine_s`: the engine's recent busy times per snapshot.
    The caller leaves out the first two intervals, whose snapshots fill the slots and holders for the first
    time."""
    window = behind_window(every)
    if len(waits) < window or len(durations) < window or not engine_s or every < 1:
        return None
    waited, took = sum(waits[-window:]), sum(durations[-window:])
    if took <= 0 or waited <= BEHIND_SHARE * took:
        return None
    step_s = max((took - waited) / window, 1e-6)
    engine = statistics.median(engine_s)
    return Behind(waited_share=waited / took, engine_s=engine, step_s=step_s, every=every,
                  advice_every=max(every + 1, math.ceil(engine / step_s)))
