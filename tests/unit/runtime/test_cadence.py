"""`auto`'s price of a snapshot: blocks of steps after snapshots against blocks without; the schedule that
makes both; and when snapshots slow training enough that the user must be told (`behind`)."""

import pytest

from deadpool.runtime.cadence import (
    BLOCK,
    CALIBRATION_STEPS,
    REPRICE_STEPS,
    Price,
    agrees_after,
    behind,
    longest_gap,
    per_step,
    price,
    snapshots_after,
)

CALIBRATED = {s for s in range(CALIBRATION_STEPS + 1) if snapshots_after(s, None)}  # 0: the job's first commit


def timed(snapshotted, steps, free, cost, drift=0.0):
    """Durations of `steps`: `free`, plus `cost` where the step before was snapshotted, plus a drift."""
    return {s: free + drift * s + (cost if s - 1 in snapshotted else 0.0) for s in steps}


def test_the_calibration_alternates_blocks_without_and_with_snapshots():
    assert sorted(CALIBRATED) == [0, 1, 2, 3, 4, 10, 11, 12, 13, 14, 20, 21, 22, 23, 24, 30, 31, 32, 33, 34, 35]
    assert CALIBRATION_STEPS in CALIBRATED  # the agreed interval starts from a snapshot


def test_the_ranks_agree_at_the_calibrations_end_then_every_reprice_steps():
    agreed = [s for s in range(1, CALIBRATION_STEPS + 2 * REPRICE_STEPS + 1) if agrees_after(s)]
    assert agreed == [CALIBRATION_STEPS, CALIBRATION_STEPS + REPRICE_STEPS, CALIBRATION_STEPS + 2 * REPRICE_STEPS]


def test_a_dense_interval_probes_before_each_agreement_and_counts_the_probe():
    """Every 4 steps from the agreement at 35, except the probe's two blocks before the next at 85: none
    after 75..79, one after each of 80..84."""
    taken = [s for s in range(CALIBRATION_STEPS, CALIBRATION_STEPS + REPRICE_STEPS + 1) if snapshots_after(s, 4)]
    assert taken == [35, 39, 43, 47, 51, 55, 59, 63, 67, 71, 80, 81, 82, 83, 84, 85]
    assert per_step(4) == pytest.approx(15 / 50) and longest_gap(4) == 9  # 71 -> 80
    assert per_step(1) == pytest.approx(45 / 50) and longest_gap(1) == BLOCK + 1
    # beyond BLOCK, blocks differ in density by themselves: no probe
    assert [s for s in range(100, 120) if snapshots_after(s, 7)] == [105, 112, 119]
    assert per_step(7) == pytest.approx(1 / 7) and longest_gap(7) == 7


def test_the_price_is_the_blocks_slope_and_a_steady_drift_moves_it_by_a_blocks_drift():
    durations = timed(CALIBRATED, range(1, CALIBRATION_STEPS + 1), free=0.5, cost=0.02, drift=0.0003)
    measured = price(durations, CALIBRATED)
    # steps 6..35 in six blocks (1..5 fill the slots), without snapshots and with in turn: five pairs, each
    # off by one block's drift (1.5 ms), up or down
    assert measured is not None and measured.blocks == 5
    assert measured.cost_s == pytest.approx(0.02, abs=0.0015 + 1e-9)
    assert measured.step_s == pytest.approx(0.5 + 0.0003 * 20.5, abs=0.002)
    assert price(timed(CALIBRATED, range(1, CALIBRATION_STEPS + 1), free=0.5, cost=0.02), CALIBRATED).cost_s \
        == pytest.approx(0.02)


def test_a_cost_that_lands_in_the_step_after_the_loaded_one_is_still_seen():
    """Pairs of single steps missed the cost a snapshot leaves to later steps (collections, the commit):
    blocks count it, but for what crosses a block's edge."""
    durations = {s: 0.5 + (0.01 if s - 1 in CALIBRATED else 0.0) + (0.01 if s - 2 in CALIBRATED else 0.0)
                 for s in range(1, CALIBRATION_STEPS + 1)}
    measured = price(durations, CALIBRATED)
    assert measured is not None and measured.cost_s == pytest.approx(0.02 * 4 / 5)


def test_the_interval_is_the_densest_within_the_budget_probes_included():
    assert Price(cost_s=0.0, step_s=0.5, blocks=6).interval(0.01) == 1
    assert Price(cost_s=0.004, step_s=0.5, blocks=6).interval(0.01) == 1   # 0.9 x 0.8 % a step
    assert Price(cost_s=0.010, step_s=0.5, blocks=6).interval(0.01) == 2   # 0.5 x 2 %
    assert Price(cost_s=0.015, step_s=0.5, blocks=6).interval(0.01) == 4   # 0.38 x 3 % is over: 0.3 x 3 %
    assert Price(cost_s=0.025, step_s=0.5, blocks=6).interval(0.01) == 6   # 0.26 x 5 % is over: 1/6 x 5 %
    assert Price(cost_s=0.5, step_s=0.5, blocks=6).interval(0.01) == 100
    for cost in (0.001, 0.003, 0.007, 0.012, 0.02, 0.041, 0.21):
        every = Price(cost_s=cost, step_s=0.5, blocks=6).interval(0.01)
        assert cost * per_step(every) <= 0.01 * 0.5
        assert every == 1 or all(cost * per_step(denser) > 0.01 * 0.5 for denser in range(1, every))


def test_a_pause_in_one_block_moves_the_price_little():
    durations = timed(CALIBRATED, range(1, CALIBRATION_STEPS + 1), free=0.5, cost=0.015)
    durations[13] += 2.0  # a pause (another job) in a block with snapshots
    durations[17] += 2.0  # and in the next, without
    measured = price(durations, CALIBRATED)
    assert measured is not None and measured.cost_s == pytest.approx(0.015)


def test_noise_below_zero_prices_nothing_and_blocks_of_one_density_give_none():
    measured = price(timed(CALIBRATED, range(1, CALIBRATION_STEPS + 1), free=0.5, cost=-0.01), CALIBRATED)
    assert measured is not None and measured.cost_s == 0.0 and measured.interval(0.01) == 1
    # a spare that took a rank over at step 28 timed 30..35: one whole block (31..35)
    assert price({s: 0.5 for s in range(30, 36)}, CALIBRATED) is None
    assert price({s: 0.5 for s in range(1, 6)}, CALIBRATED) is None  # the first block is never priced
    assert price({}, CALIBRATED) is None


def test_after_the_calibration_the_steady_blocks_and_probes_price_a_changed_cost():
    """The calibration saw nearly three times today's cost; 150 steps at every 9, then 150 at every 4 (with
    probes), each price today's from their own blocks alone."""
    durations = timed(CALIBRATED, range(1, CALIBRATION_STEPS + 1), free=0.5, cost=0.042)
    assert price(durations, CALIBRATED).interval(budget=0.01) == 9  # 8.4 % of a step
    sparse = CALIBRATED | {s for s in range(36, 186) if snapshots_after(s, 9)}
    measured = price(timed(sparse, range(36, 186), free=0.5, cost=0.015), sparse)
    assert measured is not None and measured.cost_s == pytest.approx(0.015)
    assert measured.interval(budget=0.01) == 4
    dense = sparse | {s for s in range(186, 336) if snapshots_after(s, 4)}
    measured = price(timed(dense, range(186, 336), free=0.5, cost=0.015), dense)
    # neighbouring blocks of different density: 0.4 and 0.2 by turns, the probe's 0 and 1
    assert measured is not None and measured.blocks == 16
    assert measured.cost_s == pytest.approx(0.015)


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
