"""`--snapshot-every auto`: how often to snapshot, priced by what a snapshot takes from the steps.

A snapshot's work (copy and hash, the send to its holders, their receive and check) runs beside training,
so its cost is not how long that work takes but how much longer the steps get: nearly all of its CPU time
on a machine whose cores are busy training, almost nothing on one with idle cores. Neither the engine's
busy time (mostly waiting for the holder's acknowledgment) nor a thread's CPU time says which, so `auto`
measures the loss itself, as an A/B test inside the run, in blocks of BLOCK steps:

    steps 1..5                  a snapshot after every step (slots and holders' buffers fill; not priced)
    steps 6..35                 blocks without a snapshot and blocks with one after every step, in turn

A snapshot's cost does not stay in the step it runs beside: its collections, the coordinator's commit and
its memory traffic land in the steps after it. Comparing single steps with their neighbours saw about a
third of the cost (docs/benchmarks.md); whole blocks see it all but what crosses a block's edge. The
price is the slope of a block's mean step over its density (the share of its steps that follow a
snapshot): the median over pairs of neighbouring blocks of different density, weighted by how far apart
their densities are, so a pause in one block moves it little. The interval is the densest whose steady cost
(snapshots per step, probes included, times that price) stays within the budget of a free step.

The pricing goes on: every REPRICE_STEPS the ranks agree again from the blocks of the last PRICED_STEPS.
At an interval of BLOCK or less every block would have the same density, so the last two blocks before
each agreement are a probe: one without a snapshot, then one with a snapshot after every step. A failure
during the probe replays up to `longest_gap` steps; the interval's price counts the probe's snapshots.
Pure functions: the step loop records when steps end and which were snapshotted, and agree.py makes every
rank take the same interval.

Under a fixed interval, `behind` says when training waits for the snapshot engine long enough that the
user must be told, and which interval the engine would keep up with (an H200 with 0.68 GB of state and
149 ms steps waited 334 ms a step at every step: docs/benchmarks.md "GPU: one H200").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

BLOCK = 5               # steps priced together
CALIBRATION_STEPS = 35  # the interval is agreed at the end of this step: 3 blocks without snapshots, 3 with
REPRICE_STEPS = 50      # then agreed again every this many steps (a multiple of BLOCK, as CALIBRATION_STEPS)
PRICED_STEPS = 500      # from the blocks among the last this many steps (a machine's load drifts)
PROBE_FROM = REPRICE_STEPS - 2 * BLOCK  # steps since the last agreement where an interval <= BLOCK probes
CALIBRATION_GAP = BLOCK + 1  # the most steps between two snapshots while calibrating


def snapshots_after(step: int, every: int | None) -> bool:
    """Whether a snapshot is taken after `step` under `auto`: `every` is the agreed interval, None while
    calibrating (whose end is snapshotted, so that the agreed interval starts from a snapshot)."""
    if every is None:
        return (step // BLOCK) % 2 == 0 or agrees_after(step)
    if every > BLOCK:
        return step % every == 0
    since = (step - CALIBRATION_STEPS) % REPRICE_STEPS
    if since >= PROBE_FROM:
        return since >= PROBE_FROM + BLOCK
    return since % every == 0


def agrees_after(step: int) -> bool:
    """Whether the ranks agree on the interval at the end of `step`: the calibration's end, then every
    REPRICE_STEPS (a step number, so that every rank, a spare that took a rank over included, agrees at the
    same step)."""
    return step >= CALIBRATION_STEPS and (step - CALIBRATION_STEPS) % REPRICE_STEPS == 0


def _steady(every: int) -> list[int]:
    """The steps snapshotted under `every` over two whole cycles after an agreement (the pattern repeats)."""
    span = 2 * math.lcm(REPRICE_STEPS, every)
    return [s for s in range(CALIBRATION_STEPS, CALIBRATION_STEPS + span + 1) if snapshots_after(s, every)]


def per_step(every: int) -> float:
    """Snapshots per step under `every` in the steady state, the probes' included."""
    taken = _steady(every)
    return (len(taken) - 1) / (taken[-1] - taken[0])


def longest_gap(every: int) -> int:
    """The most steps between two snapshots under `every`: what a failure may have to replay."""
    taken = _steady(every)
    return max(b - a for a, b in zip(taken, taken[1:]))


@dataclass(frozen=True)
class Price:
    """What `auto` measured: a snapshot's cost in step time, a free step, and how many pairs of blocks say so."""

    cost_s: float   # the slope of a block's mean step over its density, at least 0
    step_s: float   # a step without snapshots (the fit at density 0)
    blocks: int     # pairs of neighbouring blocks of different density

    def interval(self, budget: float) -> int:
        """The densest interval whose steady cost per step stays within `budget` of a free step."""
        if self.step_s <= 0 or self.cost_s <= 0:
            return 1
        ratio = self.cost_s / (budget * self.step_s)  # within the budget at 1 / ratio snapshots a step or fewer
        for every in range(1, BLOCK + 1):
            if per_step(every) * ratio <= 1:
                return every
        every = max(BLOCK + 1, math.floor(ratio))  # beyond BLOCK: 1 / every snapshots a step
        while per_step(every) * ratio > 1:
            every += 1
        return every


def price(durations: dict[int, float], snapshotted: set[int]) -> Price | None:
    """The cost measured from one rank's timed steps (step -> wall duration) and the steps after which it
    took a snapshot; None without two neighbouring blocks of different density (too few steps timed since
    the start or a recovery). A block is steps BLOCK*j+1 .. BLOCK*j+BLOCK, all timed, j >= 1 (the first
    fills the slots); its density is the share of its steps whose step before was snapshotted. Each block
    is compared with the next: a slow drift of the machine moves each pair by a block's drift at most,
    and a pause moves only the two pairs of its block."""
    blocks: dict[int, tuple[float, float]] = {}
    for j in {(s - 1) // BLOCK for s in durations if s > BLOCK}:
        steps = range(BLOCK * j + 1, BLOCK * j + BLOCK + 1)
        if all(s in durations for s in steps):
            density = sum(s - 1 in snapshotted for s in steps) / BLOCK
            blocks[j] = (density, statistics.fmean(durations[s] for s in steps))
    slopes = [((blocks[j + 1][1] - y) / (blocks[j + 1][0] - x), abs(blocks[j + 1][0] - x))
              for j, (x, y) in blocks.items() if j + 1 in blocks and blocks[j + 1][0] != x]
    if not slopes:
        return None
    slope = _weighted_median(slopes)
    step_s = statistics.median(y - slope * x for x, y in blocks.values())
    return Price(cost_s=max(0.0, slope), step_s=step_s, blocks=len(slopes))


def _weighted_median(values: list[tuple[float, float]]) -> float:
    """The value at which the (value, weight) pairs' cumulative weight reaches half of their total."""
    ordered = sorted(values)
    half, seen = sum(w for _, w in ordered) / 2, 0.0
    for value, weight in ordered:
        seen += weight
        if seen >= half:
            return value
    return ordered[-1][0]


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
