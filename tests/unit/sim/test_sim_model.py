"""Tests for deadpool/sim: the closed forms against exact special cases, the Monte Carlo against the closed forms."""

import argparse
import json
import math
from dataclasses import replace

import pytest

from deadpool.coordinator.policy import initial_plan, plan_after_failures
from deadpool.sim import cli, scale
from deadpool.sim.model import (
    ClusterParams,
    analytic_goodput,
    checkpoint_restart_goodput,
    erlang_b,
    hot_swap_goodput,
    paid_goodput,
    replica_drop_goodput,
    simulate,
    spare_load,
    spares_needed,
    spares_worth,
    stalls_per_day,
)

SWEEP = (1024, 4096, 16384, 65536, 100000)


def within(estimate, expected: float) -> bool:
    """Within 4 standard errors of 20 runs: some ten comparisons here would, at 3, fail about one seed in
    twenty by chance (t with 19 degrees of freedom); at 4, about one in a few hundred."""
    return abs(estimate.mean - expected) <= 4 * estimate.stderr


# ---- exact special cases -----------------------------------------------------------------------------------

def test_without_failures_goodput_is_one_minus_checkpoint_overhead_exactly():
    p = ClusterParams(gpus=1024, mttf_hours_at_1024=math.inf, ckpt_interval_s=570.0, ckpt_cost_s=30.0)
    assert analytic_goodput(p) == {"checkpoint_restart": pytest.approx(0.95, abs=1e-15), "replica_drop": 1.0,
                                   "hot_swap": 1.0}
    mc = simulate(p, days=30, runs=2)  # 30 days are exactly 4,320 cycles of 570 s work + 30 s checkpoint
    assert mc.failures == 0
    assert mc.goodput["checkpoint_restart"].mean == pytest.approx(0.95, abs=1e-12)
    assert mc.goodput["replica_drop"].mean == mc.goodput["hot_swap"].mean == 1.0


def test_checkpoint_restart_without_costs_is_the_exponential_renewal_formula():
    p = ClusterParams(gpus=16384, ckpt_interval_s=600.0, ckpt_cost_s=0.0, restart_s=0.0)
    x = p.failure_rate * 600.0
    assert checkpoint_restart_goodput(p) == pytest.approx(x / math.expm1(x), rel=1e-12)


def test_checkpoint_restart_matches_first_order_when_failures_are_rare():
    p = ClusterParams(gpus=1024, mttf_hours_at_1024=7900.0, ckpt_interval_s=1800.0, ckpt_cost_s=30.0,
                      restart_s=300.0)
    first_order = 1 - 30 / 1830 - p.failure_rate * (1830 / 2 + 300)
    assert checkpoint_restart_goodput(p) == pytest.approx(first_order, abs=1e-6)


def test_checkpoint_restart_stays_a_fraction_where_first_order_goes_negative():
    p = ClusterParams(gpus=100000, ckpt_interval_s=1800.0)
    assert 1 - p.failure_rate * (1800 / 2 + p.restart_s) < 0
    assert 0 < checkpoint_restart_goodput(p) < 0.01


def test_hot_swap_limits_are_checkpoint_restart_and_pure_swap_cost():
    p = ClusterParams(gpus=65536, ckpt_interval_s=600.0)
    assert hot_swap_goodput(replace(p, spares=0)) == pytest.approx(
        checkpoint_restart_goodput(replace(p, ckpt_cost_s=0.0)), rel=1e-12)
    assert hot_swap_goodput(replace(p, spares=200)) == pytest.approx(math.exp(-p.failure_rate * p.swap_s), rel=1e-12)


def test_swap_cost_is_the_measured_phases_plus_half_a_step():
    assert ClusterParams(gpus=1024, step_s=2.0).swap_s == pytest.approx(0.07 + 0.001 + 0.08 + 0.12 + 0.02 + 1.0)
    assert ClusterParams(gpus=1024, step_s=2.0, transfer_s=1.5).swap_s == pytest.approx(0.291 + 1.5 + 1.0)


def test_a_given_swap_cost_replaces_the_phases():
    assert ClusterParams(gpus=1024, swap_cost_s=42.0).swap_s == 42.0
    assert ClusterParams(gpus=1024, swap_cost_s=0.0).swap_s == 0.0


@pytest.mark.parametrize("gpus", SWEEP)
def test_goodput_falls_and_spares_worth_never_rise_as_a_swap_costs_more(gpus):
    p = ClusterParams(gpus=gpus, spares=spares_needed(ClusterParams(gpus=gpus)))
    priced = [replace(p, swap_cost_s=cost) for cost in cli.DEFAULT_COSTS]
    goodput = [hot_swap_goodput(q) for q in priced]
    worth = [spares_worth(q) for q in priced]
    assert all(a > b for a, b in zip(goodput, goodput[1:])), goodput
    assert all(a >= b for a, b in zip(worth, worth[1:])), worth
    assert {spares_needed(q) for q in priced} == {p.spares}  # the stall target ignores the swap's cost


def test_goodput_of_a_given_swap_cost_with_spares_never_short_is_exp_minus_rate_times_cost():
    p = ClusterParams(gpus=100000, spares=200, swap_cost_s=30.0)
    assert hot_swap_goodput(p) == pytest.approx(math.exp(-100000 / (1024 * 7.9 * 3600) * 30.0), rel=1e-12)


def test_failure_rate_scales_inversely_from_7_9_hours_at_1024_gpus():
    assert ClusterParams(gpus=1024).mttf_s == pytest.approx(7.9 * 3600)
    assert ClusterParams(gpus=65536).mttf_s == pytest.approx(7.9 * 3600 / 64)


def test_young_daly_interval_by_default_but_never_below_a_step():
    p = ClusterParams(gpus=1024, ckpt_cost_s=30.0)
    assert p.interval_s == pytest.approx(math.sqrt(2 * 30.0 * p.mttf_s))
    assert replace(p, ckpt_cost_s=0.0).interval_s == p.step_s
    assert replace(p, ckpt_interval_s=900.0).interval_s == 900.0


# ---- Monte Carlo against the closed forms ------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    ClusterParams(gpus=16384, ckpt_interval_s=600.0, restart_s=120.0),
    ClusterParams(gpus=100000),  # goodput ~0.2: far outside the first-order regime
], ids=["16k", "100k"])
def test_monte_carlo_checkpoint_restart_matches_closed_form(params):
    mc = simulate(params, days=30, runs=20, seed=1)
    assert within(mc.goodput["checkpoint_restart"], checkpoint_restart_goodput(params))


@pytest.mark.parametrize("spares, cost", [(0, None), (60, None), (60, 120.0)],
                         ids=["no-spares", "never-short", "never-short-120s"])
def test_monte_carlo_hot_swap_matches_closed_form_where_it_is_exact(spares, cost):
    p = ClusterParams(gpus=65536, ckpt_interval_s=600.0, spares=spares, swap_cost_s=cost)
    mc = simulate(p, days=30, runs=20, seed=2)
    assert within(mc.goodput["hot_swap"], hot_swap_goodput(p))


def test_monte_carlo_replica_drop_matches_closed_form():
    p = ClusterParams(gpus=16384, mttf_hours_at_1024=1.0, replica_group_nodes=16)
    assert replica_drop_goodput(p) < 0.9  # a fifth of groups out at times: the check has teeth
    mc = simulate(p, days=30, runs=20, seed=3)
    assert within(mc.goodput["replica_drop"], replica_drop_goodput(p))


def test_monte_carlo_is_deterministic_given_its_seed():
    p = ClusterParams(gpus=4096)
    assert simulate(p, days=2, runs=2, seed=7) == simulate(p, days=2, runs=2, seed=7)
    assert simulate(p, days=2, runs=2, seed=7) != simulate(p, days=2, runs=2, seed=8)


# ---- spares: Erlang B, its Monte Carlo, the fewest spares ---------------------------------------------------

@pytest.mark.parametrize("servers, load", [(0, 3.0), (1, 0.5), (4, 2.0), (10, 5.0), (30, 12.4)])
def test_erlang_b_recursion_equals_the_direct_formula(servers, load):
    terms = [load ** k / math.factorial(k) for k in range(servers + 1)]
    assert erlang_b(servers, load) == pytest.approx(terms[-1] / sum(terms), rel=1e-12)


@pytest.mark.parametrize("spares", [2, 4])
def test_monte_carlo_stalls_match_erlang_b(spares):
    p = ClusterParams(gpus=16384, spares=spares, spare_replenish_s=3554.0)  # load ~2 Erlangs
    blocked = erlang_b(spares, spare_load(p))
    assert 0.05 < blocked < 0.5
    mc = simulate(p, days=30, runs=20, seed=4)
    assert within(mc.blocked, blocked)
    assert within(mc.stalls_per_day, stalls_per_day(p))


@pytest.mark.parametrize("gpus", SWEEP)
def test_spares_needed_is_the_fewest_under_the_target(gpus):
    p = ClusterParams(gpus=gpus)
    need = spares_needed(p, per_day=1e-3)
    assert stalls_per_day(replace(p, spares=need)) < 1e-3 <= stalls_per_day(replace(p, spares=need - 1))


def test_spares_needed_cross_checked_by_monte_carlo_at_a_measurable_target():
    p = ClusterParams(gpus=65536)
    need = spares_needed(p, per_day=0.5)
    enough, short = (simulate(replace(p, spares=s), days=30, runs=20, seed=5) for s in (need, need - 1))
    assert within(enough.stalls_per_day, stalls_per_day(replace(p, spares=need)))
    assert within(short.stalls_per_day, stalls_per_day(replace(p, spares=need - 1)))
    assert enough.stall_days.mean <= enough.stalls_per_day.mean  # P(a stall in a day) <= stalls per day
    assert short.stalls_per_day.mean > enough.stalls_per_day.mean


def test_spares_needed_at_one_erlang_worked_by_hand():
    """One failure an hour, each spare gone an hour: a = 1 Erlang, 24 failures a day. B(k) = B(k-1) / (k + B(k-1)):
    1/2, 1/5, 1/16, 1/65, 1/326, 1/1957, 1/13700, 1/109601, so 24 B(k) first falls under 0.1 at 5 spares
    (0.0736; 0.369 at 4) and under 0.001 at 8 (0.00022; 0.0018 at 7)."""
    p = ClusterParams(gpus=1024, mttf_hours_at_1024=1.0, spare_replenish_s=3600.0)
    assert spare_load(p) == pytest.approx(1.0)
    assert erlang_b(8, 1.0) == pytest.approx(1 / 109601, rel=1e-12)
    assert spares_needed(p, per_day=0.1) == 5
    assert spares_needed(p, per_day=1e-3) == 8


def test_no_failures_need_no_spares():
    assert spares_needed(ClusterParams(gpus=1024, mttf_hours_at_1024=math.inf)) == 0
    assert spares_worth(ClusterParams(gpus=1024, mttf_hours_at_1024=math.inf)) == 0


def test_paid_goodput_counts_idle_spare_gpus():
    p = ClusterParams(gpus=1024, mttf_hours_at_1024=math.inf, spares=2)
    assert paid_goodput(p) == 1024 / (1024 + 2 * 8)


@pytest.mark.parametrize("gpus, cost", [(4096, 5.0), (65536, 1.0), (100000, 120.0), (100000, 290.0)])
def test_spares_worth_is_the_argmax_of_paid_goodput(gpus, cost):
    p = ClusterParams(gpus=gpus, swap_cost_s=cost)
    paid = [paid_goodput(replace(p, spares=s)) for s in range(200)]
    assert spares_worth(p) == paid.index(max(paid))


def test_a_swap_dearer_than_a_restart_is_worth_no_spare():
    assert spares_worth(ClusterParams(gpus=100000, swap_cost_s=10000.0)) == 0


def test_pool_rule_is_the_coordinator_policy():
    """The simulator swaps whenever a spare is idle: plan_after_failures agrees, as replicas are re-placed on
    the remaining spares after every swap."""
    plan = initial_plan(6, ("s0", "s1", "s2"))
    for rank in range(5):
        decision = plan_after_failures(plan, plan.generation, frozenset({plan.ranks[rank]}))
        assert decision.ok == bool(plan.spares), decision.reason
        plan = decision.value if decision.ok else plan


# ---- input validation --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, message", [
    ({"gpus": 0}, "gpus"),
    ({"gpus": True}, "gpus"),
    ({"gpus": 1000, "gpus_per_node": 16}, "multiple of gpus_per_node"),
    ({"gpus": 1024, "replica_group_nodes": 3}, "replica groups"),
    ({"gpus": 1024, "spares": -1}, "spares"),
    ({"gpus": 1024, "spares": 1.5}, "spares"),
    ({"gpus": 1024, "mttf_hours_at_1024": 0.0}, "mttf_hours_at_1024"),
    ({"gpus": 1024, "mttf_hours_at_1024": math.nan}, "mttf_hours_at_1024"),
    ({"gpus": 1024, "step_s": math.inf}, "step_s"),
    ({"gpus": 1024, "ckpt_interval_s": 0.0}, "ckpt_interval_s"),
    ({"gpus": 1024, "ckpt_cost_s": -1.0}, "ckpt_cost_s"),
    ({"gpus": 1024, "restart_s": "300"}, "restart_s"),
    ({"gpus": 1024, "transfer_s": -0.5}, "transfer_s"),
    ({"gpus": 1024, "swap_cost_s": -1.0}, "swap_cost_s"),
    ({"gpus": 1024, "swap_cost_s": math.inf}, "swap_cost_s"),
])
def test_bad_params_raise_value_error_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        ClusterParams(**fields)


@pytest.mark.parametrize("days, runs, message", [(0.5, 4, "days"), (30, 1, "runs"), (30, True, "runs")])
def test_bad_simulation_settings_raise_value_error(days, runs, message):
    with pytest.raises(ValueError, match=message):
        simulate(ClusterParams(gpus=1024), days=days, runs=runs)


def test_bad_stall_target_raises_value_error():
    with pytest.raises(ValueError, match="per_day"):
        spares_needed(ClusterParams(gpus=1024), per_day=0.0)


# ---- the command -------------------------------------------------------------------------------------------

def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="deadpool")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["simulate", *argv])


def test_command_prints_tables_and_writes_json(tmp_path, capsys):
    assert cli.main(parse(["--gpus", "1024", "--gpus", "4096", "--days", "2", "--runs", "2", "--out",
                           str(tmp_path)])) == 0
    out = capsys.readouterr().out
    assert "checkpoint-restart" in out and "spares needed" in out
    sizes = json.loads((tmp_path / "simulate.json").read_text())["sizes"]
    assert [s["gpus"] for s in sizes] == [1024, 4096]
    assert sizes[1]["params"]["spares"] == sizes[1]["spares_needed"]
    assert sizes[0]["stalls_per_day_needed"] < 1e-3


def test_command_reports_bad_input_with_exit_code_2(capsys):
    assert cli.main(parse(["--gpus", "1000", "--gpus-per-node", "16"])) == 2
    assert "multiple of gpus_per_node" in capsys.readouterr().err


def write_summary(run_dir, recoveries: list[dict]) -> None:
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"recoveries": recoveries}))


def test_phases_from_runs_are_medians_over_all_their_recoveries_and_a_flag_beats_them(tmp_path):
    phases = [{"detect_s": d, "decide_s": 0.001, "report_s": r, "rebuild_s": 0.1, "restore_s": 0.02}
              for d, r in ((0.05, 0.3), (0.09, 0.5), (0.07, 0.4))]
    write_summary(tmp_path / "one", phases[:1])
    write_summary(tmp_path / "two", phases[1:])
    measured = cli.measured_phases([tmp_path / "one", tmp_path / "two"])
    args = parse(["--rebuild-s", "0.25"])
    assert cli.swap_phases(args, cli.coefficients(args), 100000, measured, 0.0) == {
        "detect_s": 0.07, "decide_s": 0.001, "report_s": 0.4, "rebuild_s": 0.25, "transfer_s": 0.0, "resend_s": 0.0,
        "restore_s": 0.02}


def test_phases_default_to_the_swap_model_at_each_size():
    shrink, gloo_model = scale.SWAP_MODELS["nccl-shrink"], scale.SWAP_MODELS["gloo-here"]
    for gpus in (1024, 100000):
        assert cli.swap_phases(parse([]), shrink, gpus, {}, 0.5) == scale.swap_phases(
            shrink, ranks=gpus, ranks_per_node=8, node_state_bytes=scale.DEFAULT_NODE_STATE_BYTES,
            step_s=5.0, hang_fraction=0.5)
    args = parse(["--swap-model", "gloo-here", "--node-state-gb", "2"])
    gloo = cli.swap_phases(args, cli.coefficients(args), 64, {}, 0.0)
    assert gloo["rebuild_s"] == scale.rebuild_s(gloo_model, 64)
    assert gloo["transfer_s"] == gloo_model.transfer_s + 2 * 2e9 / gloo_model.link_bytes_per_s


def test_command_prices_each_size_and_tabulates_the_costs_given(tmp_path, capsys):
    assert cli.main(parse(["--gpus", "1024", "100000", "--days", "2", "--runs", "2", "--hang-fraction", "0.1",
                           "--costs", "1", "120", "--out", str(tmp_path)])) == 0
    out = capsys.readouterr().out
    assert "Hot swap per failure, by phase" in out and "Sensitivity to the per-failure cost" in out
    small, large = json.loads((tmp_path / "simulate.json").read_text())["sizes"]
    assert small["swap_s"] < large["swap_s"]  # report and rebuild grow with the world
    for size in (small, large):
        p = size["params"]
        assert size["swap_s"] == pytest.approx(0.9 * size["swap_s_crash"] + 0.1 * size["swap_s_hang"])
        assert size["swap_s_hang"] - size["swap_s_crash"] == pytest.approx(
            40.0 - scale.SWAP_MODELS["nccl-shrink"].exit_notice_s)
        assert [s["swap_s"] for s in size["sensitivity"]] == [1.0, 120.0]
        assert size["sensitivity"][0]["goodput"] > size["sensitivity"][1]["goodput"]
        assert size["sensitivity"][1]["goodput"] == pytest.approx(
            hot_swap_goodput(ClusterParams(**p | {"swap_cost_s": 120.0})), rel=1e-12)


@pytest.mark.parametrize("flags, message", [(["--hang-fraction", "2"], "hang_fraction"),
                                            (["--node-state-gb", "-1"], "--node-state-gb"),
                                            (["--costs", "5", "inf"], "--costs")])
def test_command_reports_bad_model_input_with_exit_code_2(flags, message, capsys):
    assert cli.main(parse(["--gpus", "1024", *flags])) == 2
    assert message in capsys.readouterr().err


def test_phases_from_a_run_without_recoveries_is_a_clear_error(tmp_path, capsys):
    write_summary(tmp_path / "clean", [])
    assert cli.main(parse(["--gpus", "1024", "--phases-from", str(tmp_path / "clean")])) == 2
    assert "records no recovery" in capsys.readouterr().err
    assert cli.main(parse(["--gpus", "1024", "--phases-from", str(tmp_path / "missing")])) == 2
    assert "cannot read the recoveries" in capsys.readouterr().err
