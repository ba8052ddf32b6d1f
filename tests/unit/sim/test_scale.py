"""Tests for deadpool/sim/scale.py: each fit reproduces the figures it was fitted to, each coefficient lands in
its model with its mark, and each phase (sticky placement and placed anew) equals its formula worked by hand."""

import math
from dataclasses import replace

import pytest

from deadpool.sim.model import ClusterParams
from deadpool.sim.scale import (
    COEFFICIENTS,
    DEFAULT_NODE_STATE_BYTES,
    FIT_2026_12_02,
    SWAP_MODELS,
    detect_s,
    fabric_factor,
    rebuild_s,
    resend_s,
    swap_models,
    swap_phases,
)

SHRINK, INIT = SWAP_MODELS["nccl-shrink"], SWAP_MODELS["nccl-init"]
FIT = {"exit_notice_s": 0.03, "decide_s": 0.06, "report_s": 0.04, "report_per_rank_s": 0.002, "rebuild_s": 0.01,
       "rebuild_per_rank_s": 0.03, "transfer_s": 0.005, "link_bytes_per_s": 2e8, "restore_bytes_per_s": 6e8,
       "coordinator_per_rank_s": 3e-4}


def test_shrink_fit_reproduces_the_published_figures():
    assert rebuild_s(SHRINK, 32) == pytest.approx(1.5, abs=1e-12)
    assert rebuild_s(SHRINK, 1024) == pytest.approx(2.0, abs=1e-12)
    assert (SHRINK.rebuild_s, SHRINK.rebuild_per_doubling_s) == pytest.approx((1.0, 0.1), abs=1e-12)


def test_full_init_is_the_shrink_plus_a_linear_term_through_265_s_at_96k_gpus():
    assert rebuild_s(INIT, 96 * 1024) == pytest.approx(265.0, abs=1e-9)
    assert rebuild_s(INIT, 1024) == pytest.approx(2.0 + 1024 * (265.0 - 1.0 - 0.1 * math.log2(98304)) / 98304)


def test_a_fit_prices_our_terms_and_the_nccl_models_keep_the_published_and_assumed_ones():
    models = swap_models(FIT)
    shrink, gloo = models["nccl-shrink"], models["gloo-here"]
    assert (shrink.report_s, shrink.report_per_rank_s, shrink.transfer_s) == (0.04, 3e-4, 0.005)
    assert (shrink.link_bytes_per_s, shrink.restore_bytes_per_s) == (12.5e9, 25e9)
    assert {name: shrink.marks[name] for name in ("report_s", "report_per_rank_s", "rebuild_s", "transfer_s",
                                                   "link_bytes_per_s")} == {
        "report_s": "fitted", "report_per_rank_s": "measured", "rebuild_s": "published", "transfer_s": "fitted",
        "link_bytes_per_s": "assumed"}
    assert {name: getattr(gloo, name) for name in FIT if name != "coordinator_per_rank_s"} == \
        {name: value for name, value in FIT.items() if name != "coordinator_per_rank_s"}
    assert gloo.marks["link_bytes_per_s"] == gloo.marks["rebuild_per_rank_s"] == "fitted"
    assert models["nccl-init"].rebuild_per_rank_s == INIT.rebuild_per_rank_s  # published, whatever the fit
    assert SWAP_MODELS["gloo-here"].report_per_rank_s == FIT_2026_12_02["report_per_rank_s"]


@pytest.mark.parametrize("name", sorted(SWAP_MODELS))
def test_every_coefficient_of_every_model_is_marked(name):
    assert set(SWAP_MODELS[name].marks) == set(COEFFICIENTS)


def test_a_coefficient_without_a_valid_mark_raises_value_error():
    with pytest.raises(ValueError, match="exit_notice_s"):
        replace(SHRINK, marks={k: v for k, v in SHRINK.marks.items() if k != "exit_notice_s"})
    with pytest.raises(ValueError, match="decide_s"):
        replace(SHRINK, marks={**SHRINK.marks, "decide_s": "guessed"})


def test_each_phase_at_4096_gpus_and_16_gb_equals_the_formula_by_hand():
    c = swap_models(FIT)["nccl-shrink"]
    phases = swap_phases(c, ranks=4096, ranks_per_node=8, node_state_bytes=16e9, step_s=2.0, hang_fraction=0.25)
    assert phases == pytest.approx({
        "detect_s": 0.75 * 0.03 + 0.25 * 16.0,   # hang timeout: 8 steps of 2 s
        "decide_s": 0.06,
        "report_s": 0.04 + 3e-4 * 4096,
        "rebuild_s": 1.0 + 0.1 * 12,
        "transfer_s": 0.005 + 2 * 16e9 / 12.5e9,  # both slots of the lost node, holder -> taker
        "resend_s": 0.005 + 16e9 / 12.5e9,        # the lost node's orphans, one node's worth
        "restore_s": 16e9 / 8 / 25e9,
    }, rel=1e-12)
    p = ClusterParams(gpus=4096, step_s=2.0, **phases)
    assert p.swap_s == pytest.approx(sum(phases.values()) + 1.0, rel=1e-12)


@pytest.mark.parametrize("ranks, fabric", [(1024, 1.0), (3072, 1.0), (4096, 7 * 0.25), (100000, 7 * (1 - 0.03072))])
def test_placing_anew_resends_through_the_oversubscribed_pods_and_sticky_through_one_link(ranks, fabric):
    assert fabric_factor(SHRINK, ranks) == pytest.approx(fabric, rel=1e-12)
    one_link = SHRINK.transfer_s + 14e9 / 12.5e9
    assert resend_s(SHRINK, 14e9, ranks, sticky=True) == pytest.approx(one_link, rel=1e-12)
    assert resend_s(SHRINK, 14e9, ranks, sticky=False) == pytest.approx(SHRINK.transfer_s + 14e9 / 12.5e9 * fabric,
                                                                        rel=1e-12)


@pytest.mark.parametrize("step_s, timeout", [(0.2, 3.0), (5.0, 40.0)])
def test_hang_detection_is_the_coordinators_hang_timeout(step_s, timeout):
    assert detect_s(SHRINK, step_s, hang_fraction=1.0) == timeout
    assert detect_s(SHRINK, step_s, hang_fraction=0.0) == SHRINK.exit_notice_s


@pytest.mark.parametrize("name", sorted(SWAP_MODELS))
@pytest.mark.parametrize("sticky", [True, False])
def test_no_phase_gets_cheaper_with_more_ranks_or_more_state(name, sticky):
    c = SWAP_MODELS[name]
    costs = [swap_phases(c, ranks=n, ranks_per_node=8, node_state_bytes=s, step_s=5.0, sticky=sticky)
             for n, s in ((1024, 1e9), (16384, 1e9), (16384, 50e9), (100000, 50e9))]
    for before, after in zip(costs, costs[1:]):
        assert all(after[phase] >= before[phase] for phase in before), (before, after)


def test_full_init_at_the_papers_scale_stays_under_its_40_s():
    """Not a fit, a consistency check: the paper's swap of a 65B model on 512 GPUs took < 40 s."""
    phases = swap_phases(INIT, ranks=512, ranks_per_node=8, node_state_bytes=DEFAULT_NODE_STATE_BYTES, step_s=5.0)
    assert 4 < sum(phases.values()) < 40


@pytest.mark.parametrize("field, value", [("decide_s", -0.1), ("rebuild_per_rank_s", math.nan),
                                          ("link_bytes_per_s", 0.0), ("restore_bytes_per_s", math.inf),
                                          ("transfer_s", -1.0), ("pod_oversubscription", 0.0)])
def test_bad_coefficients_raise_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        replace(SHRINK, **{field: value})


@pytest.mark.parametrize("state, fraction, message", [(-1.0, 0.0, "node_state_bytes"), (1e9, 1.5, "hang_fraction"),
                                                      (1e9, math.nan, "hang_fraction")])
def test_bad_inputs_raise_value_error(state, fraction, message):
    with pytest.raises(ValueError, match=message):
        swap_phases(SHRINK, ranks=1024, ranks_per_node=8, node_state_bytes=state, step_s=5.0,
                    hang_fraction=fraction)
