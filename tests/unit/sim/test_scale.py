"""Tests for deadpool/sim/scale.py: each fit reproduces the figures it was fitted to, and each phase equals its
formula worked by hand."""

import math
from dataclasses import replace

import pytest

from deadpool.sim.model import ClusterParams
from deadpool.sim.scale import (
    DEFAULT_NODE_STATE_BYTES,
    GLOO_HERE,
    NCCL_INIT,
    NCCL_SHRINK,
    SWAP_MODELS,
    detect_s,
    rebuild_s,
    swap_phases,
)


def test_shrink_fit_reproduces_the_published_figures():
    assert rebuild_s(NCCL_SHRINK, 32) == pytest.approx(1.5, abs=1e-12)
    assert rebuild_s(NCCL_SHRINK, 1024) == pytest.approx(2.0, abs=1e-12)
    assert (NCCL_SHRINK.rebuild_s, NCCL_SHRINK.rebuild_per_doubling_s) == pytest.approx((1.0, 0.1), abs=1e-12)


def test_full_init_is_the_shrink_plus_a_linear_term_through_265_s_at_96k_gpus():
    assert rebuild_s(NCCL_INIT, 96 * 1024) == pytest.approx(265.0, abs=1e-9)
    assert rebuild_s(NCCL_INIT, 1024) == pytest.approx(2.0 + 1024 * (265.0 - 1.0 - 0.1 * math.log2(98304)) / 98304)


def test_gloo_slope_is_the_least_squares_slope_of_the_rank_rows():
    # (2, 0.22), (4, 0.26), (8, 0.36): mean rank 14/3, Sxy = 0.44, Sxx = 56/3
    assert GLOO_HERE.rebuild_per_rank_s == pytest.approx(0.44 / (56 / 3), rel=1e-12)


def test_gloo_here_reproduces_the_measured_phases_at_4_ranks():
    """One rank per "node" and one 38.5 MB snapshot: the 4-rank medians, and 0.084 s to stream a replica (the
    extra report time of the two-kill runs)."""
    phases = swap_phases(GLOO_HERE, ranks=4, ranks_per_node=1, node_state_bytes=38.5e6, step_s=0.45)
    assert phases == pytest.approx({"detect_s": 0.054, "decide_s": 0.061, "report_s": 0.104, "rebuild_s": 0.110,
                                    "transfer_s": 0.084, "restore_s": 0.046}, abs=1e-12)


def test_each_phase_at_4096_gpus_and_16_gb_equals_the_formula_by_hand():
    phases = swap_phases(NCCL_SHRINK, ranks=4096, ranks_per_node=8, node_state_bytes=16e9, step_s=2.0,
                         hang_fraction=0.25)
    assert phases == pytest.approx({
        "detect_s": 0.75 * 0.054 + 0.25 * 16.0,   # hang timeout: 8 steps of 2 s
        "decide_s": 0.061,
        "report_s": 0.104 + 20e-6 * 4096,
        "rebuild_s": 1.0 + 0.1 * 12,
        "transfer_s": 16e9 / 12.5e9,
        "restore_s": 16e9 / 8 / 25e9,
    }, rel=1e-12)
    p = ClusterParams(gpus=4096, step_s=2.0, **phases)
    assert p.swap_s == pytest.approx(4.0405 + 0.061 + 0.18592 + 2.2 + 1.28 + 0.08 + 1.0, rel=1e-12)


@pytest.mark.parametrize("step_s, timeout", [(0.2, 3.0), (5.0, 40.0)])
def test_hang_detection_is_the_coordinators_hang_timeout(step_s, timeout):
    assert detect_s(NCCL_SHRINK, step_s, hang_fraction=1.0) == timeout
    assert detect_s(NCCL_SHRINK, step_s, hang_fraction=0.0) == NCCL_SHRINK.exit_notice_s


@pytest.mark.parametrize("name", sorted(SWAP_MODELS))
def test_no_phase_gets_cheaper_with_more_ranks_or_more_state(name):
    c = SWAP_MODELS[name]
    costs = [swap_phases(c, ranks=n, ranks_per_node=8, node_state_bytes=s, step_s=5.0)
             for n, s in ((1024, 1e9), (16384, 1e9), (16384, 50e9), (100000, 50e9))]
    for before, after in zip(costs, costs[1:]):
        assert all(after[phase] >= before[phase] for phase in before), (before, after)


def test_full_init_at_the_papers_scale_stays_under_its_40_s():
    """Not a fit, a consistency check: the paper's swap of a 65B model on 512 GPUs took < 40 s; our model with
    a full NCCL init prices that swap, less the replayed step, at about 4.7 s."""
    phases = swap_phases(NCCL_INIT, ranks=512, ranks_per_node=8, node_state_bytes=DEFAULT_NODE_STATE_BYTES,
                         step_s=5.0)
    assert 4 < sum(phases.values()) < 40


@pytest.mark.parametrize("field, value", [("decide_s", -0.1), ("rebuild_per_rank_s", math.nan),
                                          ("link_bytes_per_s", 0.0), ("restore_bytes_per_s", math.inf)])
def test_bad_coefficients_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        replace(NCCL_SHRINK, **{field: value})


@pytest.mark.parametrize("state, fraction, message", [(-1.0, 0.0, "node_state_bytes"), (1e9, 1.5, "hang_fraction"),
                                                      (1e9, math.nan, "hang_fraction")])
def test_bad_inputs_raise_value_error(state, fraction, message):
    with pytest.raises(ValueError, match=message):
        swap_phases(NCCL_SHRINK, ranks=1024, ranks_per_node=8, node_state_bytes=state, step_s=5.0,
                    hang_fraction=fraction)
