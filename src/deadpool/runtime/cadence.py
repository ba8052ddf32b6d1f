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
within the budget (a fraction of a free step). Pure functions: the step loop records the durations and
agree.py makes every rank take the same interval.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

WARM_STEPS = 4          # even, so that the loaded steps are the odd ones
CALIBRATION_STEPS = 24  # the interval is agreed at the end of this step: 9 loaded steps, each between free ones


def snapshots_after(step: int) -> bool:
    """While calibrating: whether a snapshot is taken after `step`."""
    return step <= WARM_STEPS or step % 2 == 0


@dataclass(frozen=True)
class Price:
    """What `auto` measured: a snapshot's cost in step time, a free step, and how many pairs say so."""

    cost_s: float   # the median over the pairs of (loaded step - mean of its free neighbours), at least 0
    step_s: float   # the median free step
    pairs: int

    def interval(self, budget: float) -> int:
        """The densest interval whose cost per step stays within `budget` of a free step."""
        return max(1, math.ceil(self.cost_s / (budget * self.step_s))) if self.step_s > 0 else 1


def price(durations: dict[int, float]) -> Price | None:
    """The cost measured from one rank's calibration steps (step -> wall duration); None without a pair
    (a recovery restarted the measurement too late for one)."""
    loaded = range(WARM_STEPS + 3, CALIBRATION_STEPS, 2)  # the step before WARM_STEPS + 1 is still loaded
    pairs = [durations[s] - (durations[s - 1] + durations[s + 1]) / 2 for s in loaded
             if s - 1 in durations and s in durations and s + 1 in durations]
    free = [d for s, d in durations.items() if s > WARM_STEPS + 1 and s % 2 == 0]
    if not pairs or not free:
        return None
    return Price(cost_s=max(0.0, statistics.median(pairs)), step_s=statistics.median(free), pairs=len(pairs))
