"""`auto`'s price of a snapshot: steps beside a snapshot's work against their free neighbours."""

import pytest

from deadpool.runtime.cadence import CALIBRATION_STEPS, WARM_STEPS, Price, price, snapshots_after


def calibration(free, loaded_extra, drift=0.0):
    """Durations of steps 1..CALIBRATION_STEPS: odd steps after the warm-up run beside a snapshot."""
    return {s: free + drift * s + (loaded_extra if s > WARM_STEPS and s % 2 else 0.0)
            for s in range(1, CALIBRATION_STEPS + 1)}


def test_warm_up_snapshots_every_step_then_every_other():
    assert [s for s in range(1, 13) if snapshots_after(s)] == [1, 2, 3, 4, 6, 8, 10, 12]
    assert snapshots_after(CALIBRATION_STEPS)  # the agreed interval starts from a snapshot


def test_cost_is_the_loaded_steps_excess_and_a_steady_drift_cancels():
    measured = price(calibration(free=0.5, loaded_extra=0.02, drift=0.003))
    assert measured is not None and measured.pairs == 9
    assert measured.cost_s == pytest.approx(0.02)
    assert measured.step_s == pytest.approx(0.5 + 0.003 * 15)  # the median free step: 6, 8, .., 24
    assert measured.interval(budget=0.01) == 4  # 20 ms within 1 % of 545 ms: every 3.67 steps
    assert Price(cost_s=0.02, step_s=0.5, pairs=9).interval(0.01) == 4
    assert Price(cost_s=0.0, step_s=0.5, pairs=9).interval(0.01) == 1


def test_an_outlier_moves_the_median_not_the_price():
    durations = calibration(free=0.5, loaded_extra=0.015)
    durations[13] += 2.0  # a pause (GC, another job) in one loaded step
    durations[16] += 2.0  # and in one free step
    measured = price(durations)
    assert measured is not None and measured.cost_s == pytest.approx(0.015)
    assert measured.step_s == pytest.approx(0.5)


def test_noise_below_zero_prices_nothing_and_no_pair_gives_none():
    measured = price(calibration(free=0.5, loaded_extra=-0.01))
    assert measured is not None and measured.cost_s == 0.0 and measured.interval(0.01) == 1
    # a spare that took a rank over at step 20 timed steps 22..24 only: 23's neighbours are there
    assert price({s: 0.5 for s in (22, 23, 24)}).pairs == 1
    assert price({s: 0.5 for s in (23, 24)}) is None
    assert price({}) is None
