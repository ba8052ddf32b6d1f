"""`auto`'s price of a snapshot: steps beside a snapshot's work against their free neighbours; and when
snapshots slow training enough that the user must be told (`behind`)."""

import pytest

from deadpool.runtime import cadence
from deadpool.runtime.cadence import CALIBRATION_STEPS, WARM_STEPS, Price, agrees_after, behind, price, snapshots_after

CALIBRATED = {s for s in range(CALIBRATION_STEPS + 1) if snapshots_after(s)}  # step 0: the job's first commit


def calibration(free, loaded_extra, drift=0.0):
    """Durations of steps 1..CALIBRATION_STEPS: odd steps after the warm-up run beside a snapshot."""
    return {s: free + drift * s + (loaded_extra if s > WARM_STEPS and s % 2 else 0.0)
            for s in range(1, CALIBRATION_STEPS + 1)}


def test_warm_up_snapshots_every_step_then_every_other():
    assert [s for s in range(1, 13) if snapshots_after(s)] == [1, 2, 3, 4, 6, 8, 10, 12]
    assert snapshots_after(CALIBRATION_STEPS)  # the agreed interval starts from a snapshot


def test_the_ranks_agree_at_the_calibrations_end_then_every_reprice_steps():
    every = cadence.REPRICE_STEPS
    agreed = [s for s in range(1, CALIBRATION_STEPS + 2 * every + 1) if agrees_after(s)]
    assert agreed == [CALIBRATION_STEPS, CALIBRATION_STEPS + every, CALIBRATION_STEPS + 2 * every]


def test_cost_is_the_loaded_steps_excess_and_a_steady_drift_cancels():
    measured = price(calibration(free=0.5, loaded_extra=0.02, drift=0.003), CALIBRATED)
    assert measured is not None and measured.pairs == 9  # loaded steps 7, 9, .., 23 (5 follows a loaded step)
    assert measured.cost_s == pytest.approx(0.02)
    assert measured.step_s == pytest.approx(0.5 + 0.003 * 15)  # the median free step: 6, 8, .., 24
    assert measured.interval(budget=0.01) == 4  # 20 ms within 1 % of 545 ms: every 3.67 steps
    assert Price(cost_s=0.02, step_s=0.5, pairs=9).interval(0.01) == 4
    assert Price(cost_s=0.0, step_s=0.5, pairs=9).interval(0.01) == 1


def test_an_outlier_moves_the_median_not_the_price():
    durations = calibration(free=0.5, loaded_extra=0.015)
    durations[13] += 2.0  # a pause (GC, another job) in one loaded step
    durations[16] += 2.0  # and in one free step
    measured = price(durations, CALIBRATED)
    assert measured is not None and measured.cost_s == pytest.approx(0.015)
    assert measured.step_s == pytest.approx(0.5)


def test_noise_below_zero_prices_nothing_and_no_pair_gives_none():
    measured = price(calibration(free=0.5, loaded_extra=-0.01), CALIBRATED)
    assert measured is not None and measured.cost_s == 0.0 and measured.interval(0.01) == 1
    # a spare that took a rank over at step 20 timed steps 22..24 only: 23's neighbours are there
    assert price({s: 0.5 for s in (22, 23, 24)}, CALIBRATED).pairs == 1
    assert price({s: 0.5 for s in (23, 24)}, CALIBRATED) is None
    assert price({}, CALIBRATED) is None


def test_a_recoverys_extra_snapshot_loads_the_step_after_it():
    """After a restore at 20 the next step is snapshotted whatever the interval (its replicas are compared):
    step 22 runs beside that snapshot, so it is no free neighbour for 23."""
    assert price({s: 0.5 for s in (22, 23, 24)}, CALIBRATED | {21}) is None


def test_after_the_calibration_every_snapshot_prices_the_step_after_it():
    """Every 4 steps from 24: 25 is loaded between free 24 and 26 (and so are 29, 33, ..); with the
    calibration's pairs, the cost is the median of all of them."""
    snapshotted = CALIBRATED | {s for s in range(CALIBRATION_STEPS, 101) if s % 4 == 0}
    durations = calibration(free=0.5, loaded_extra=0.039)  # the calibration saw twice today's cost
    assert price(durations, CALIBRATED).interval(budget=0.01) == 8
    durations |= {s: 0.5 + (0.018 if s % 4 == 1 else 0.0) for s in range(CALIBRATION_STEPS + 1, 101)}
    measured = price(durations, snapshotted)
    assert measured is not None and measured.pairs == 9 + 19  # 25, 29, .., 97 (101 has no later neighbour)
    assert measured.cost_s == pytest.approx(0.018)
    assert measured.interval(budget=0.01) == 4


def test_every_step_leaves_no_free_step_to_price():
    snapshotted = set(range(CALIBRATION_STEPS, 101))
    assert price({s: 0.5 for s in range(CALIBRATION_STEPS + 2, 101)}, snapshotted) is None


def test_training_that_waits_a_tenth_of_its_time_for_snapshots_is_behind_and_told_how_often_to_snapshot():
    # 10 steps of 149 ms compute, each waiting 334 ms for a free slot; the engine takes 485 ms a snapshot
    found = behind([0.334] * 10, [0.483] * 10, [0.485, 0.480, 0.490], every=1)
    assert found is not None
    assert found.waited_share == pytest.approx(0.334 / 0.483)
    assert found.step_s == pytest.approx(0.149)
    assert found.engine_s == 0.485
    assert found.advice_every == 4  # 485 / 149 = 3.26, rounded up
    assert "every 4 steps or more (--snapshot-every 4)" in found.message()


def test_a_small_wait_too_few_steps_or_no_snapshot_yet_is_not_behind():
    assert behind([0.009] * 10, [0.1] * 10, [0.05], every=1) is None    # 9 %: within the share
    assert behind([0.05] * 9, [0.1] * 9, [0.2], every=1) is None        # not a whole window yet
    assert behind([0.05] * 10, [0.1] * 10, [], every=1) is None         # no snapshot finished yet
    assert behind([0.0] * 20 + [0.05] * 10, [0.1] * 30, [0.2], every=1) is not None  # only the last window


def test_a_sparse_interval_is_judged_over_a_whole_interval():
    # every 50 steps of 2 ms, the first step of each interval waiting 8 ms for the copy to land: 7 %
    waits = [0.008] + [0.0] * 49
    assert behind([0.02] + [0.0] * 9, [0.022] + [0.002] * 9, [0.03], every=50) is None  # not a whole interval yet
    assert behind(waits, [0.010] + [0.002] * 49, [0.03], every=50) is None
    assert behind([0.02] + [0.0] * 49, [0.022] + [0.002] * 49, [0.03], every=50) is not None  # 18 %


def test_the_advice_is_always_a_sparser_interval():
    # an engine faster than a step still leaves training waiting (a slow commit, say): at least every + 1
    found = behind([0.02] * 10, [0.1] * 10, [0.01], every=3)
    assert found is not None and found.advice_every == 4
