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
