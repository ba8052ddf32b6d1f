"""Tests for deadpool/chaos: the seeded draw of the scenarios (reproducible, within bounds), the jobs' arguments,
and the verdicts and the table, from synthetic summaries and events (times multiples of 1/8: exact)."""

from dataclasses import replace
from pathlib import Path

import pytest

from deadpool.chaos.report import DOCUMENTED, FAILED, SKIPPED, Seen, failed, markdown, row, skipped, timings, verdict
from deadpool.chaos.runner import job_argv
from deadpool.chaos.scenarios import CATALOG, NAMES, RECOVERED, STEP_PHASES, draw, scenario_seed, select
from deadpool.config import Fault
from deadpool.errors import ConfigError

STEPS = 12
REFERENCE = {"rank_state_sha256": ["a", "b", "c", "d"], "losses": {"0": [3.0, 2.5]}, "error": None}


def one(name: str, seed: int = 7):
    [drawn] = select(name, seed, STEPS)
    return drawn


# ---- the draw ----------------------------------------------------------------------------------------------------

def test_the_same_seed_draws_the_same_matrix_and_another_seed_another():
    assert select("all", 7, STEPS) == select("all", 7, STEPS)
    assert [(d.step, d.phase, d.rank) for d in select("all", 7, STEPS)] != \
           [(d.step, d.phase, d.rank) for d in select("all", 8, STEPS)]


def test_a_scenario_draws_the_same_alone_as_in_the_matrix_and_name_at_seed_replays_it():
    whole = {d.scenario.name: d for d in select("all", 7, STEPS)}
    assert one("hang") == whole["hang"]
    own = scenario_seed(7, "hang")
    assert whole["hang"].seed == own and one(f"hang@{own}", seed=999) == whole["hang"]


def test_the_matrix_has_at_least_15_distinct_scenarios_and_every_phase_of_a_step():
    assert len(NAMES) == len(set(NAMES)) >= 15
    assert {f"kill-{phase}" for phase in STEP_PHASES} <= set(NAMES)


@pytest.mark.parametrize("seed", range(40))
def test_draws_stay_within_their_bounds(seed):
    for drawn in select("all", seed, STEPS):
        s = drawn.scenario
        assert drawn.phase in s.phases and drawn.rank != drawn.other and {drawn.rank, drawn.other} <= {0, 1, 2, 3}
        low = 5 if s.persist_every else 3 if s.plan else 2
        assert low <= drawn.step <= (STEPS - 3 if s.plan else STEPS - 5)
        assert 0.1 <= drawn.delay <= 5.0
        assert all(1 <= f.step <= STEPS for f in drawn.faults())


def test_faults_of_the_composite_scenarios():
    two = one("kill-two")
    assert [(f.kind, f.rank, f.step, f.phase) for f in two.faults()] == [
        ("kill", two.rank, two.step, two.phase), ("kill", two.other, two.step, two.phase)]
    corrupt = one("corrupt-replica")
    assert [(f.kind, f.rank, f.step) for f in corrupt.faults()] == [
        ("corrupt_replica", corrupt.rank, corrupt.step - 1), ("kill", corrupt.rank, corrupt.step)]
    assert [f.rank for f in one("holder-mid-transfer").faults()] == [0, 3]  # both held by s0 of 3 spares
    assert [f.phase for f in one("hang-in-recovery").faults()][1] == "recovery"
    assert one("hung-holder").faults() == ()  # done by the runner, not injected


def test_what_and_expect_name_the_draw():
    error = one("script-error")
    assert error.expect == (f"error in the training script on rank {error.rank} (w{error.rank}) at step "
                            f"{error.step}: raised InjectedError")
    assert error.what == f"an exception in the script on rank {error.rank}, {error.phase} of step {error.step}"
    assert one("kill-backward").expect == ""


def test_unknown_names_and_bad_seeds_are_refused_with_the_names():
    for text in ("kill-everything", "hang@x"):
        with pytest.raises(ConfigError, match="kill-backward"):
            select(text, 7, STEPS)
    with pytest.raises(ConfigError, match="at least 10 steps"):
        draw(CATALOG[0], 7, 8)


# ---- the jobs' arguments ----------------------------------------------------------------------------------------

def test_job_arguments_of_the_reference_a_scenario_and_its_resume(tmp_path):
    reference = job_argv(None, tmp_path / "reference", STEPS)
    assert reference[:4] == ["--workers", "4", "--spares", "1"] and "--fault" not in " ".join(reference)
    drawn = one("sigterm-resume")
    first, second = job_argv(drawn, tmp_path / "run", STEPS), job_argv(drawn, tmp_path / "resumed", STEPS, True)
    assert ["--persist-dir", str(tmp_path / "ckpt"), "--persist-every", "3"] == first[4:8]
    assert "--resume" not in first and second[second.index("--resume") + 1] == "auto"
    assert [a for a in second if a not in ("--resume", "auto")] == [  # the same job, in a run directory of its own
        str(tmp_path / "resumed") if a == str(tmp_path / "run") else a for a in first]
    kill = one("kill-backward")
    assert f"--fault=kill:{kill.rank}:{kill.step}:backward" in job_argv(kill, tmp_path / "run", STEPS)
    assert job_argv(one("kill-node"), tmp_path / "run", STEPS)[:7] == [
        "--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1", "--netns"]
    slowed = job_argv(one("hung-holder"), tmp_path / "run", STEPS)
    assert Path(slowed[slowed.index("--out") + 2]).name == "slow.py" and slowed[slowed.index("--out") + 3] == "0.2"


# ---- verdicts ---------------------------------------------------------------------------------------------------

def done(**summary) -> dict:
    return {**REFERENCE, "steps_replayed": 1, "faults_not_fired": [], **summary}


def test_a_run_ending_on_the_reference_state_recovered_bit_for_bit():
    drawn = one("kill-backward")
    assert verdict(drawn, Seen(code=0, summary=done(), events=[]), REFERENCE) == (RECOVERED, "")
    other = done(rank_state_sha256=["a", "b", "c", "X"])
    assert verdict(drawn, Seen(code=0, summary=other, events=[]), REFERENCE)[0] == FAILED
    assert verdict(drawn, Seen(code=0, summary=done(losses={"0": [3.0, 2.0]}), events=[]), REFERENCE)[0] == FAILED
    lost = Seen(code=1, summary=done(error="no spare is left"), events=[])
    assert verdict(drawn, lost, REFERENCE) == (FAILED, "exit 1: no spare is left")


def test_a_runner_problem_or_an_unfired_fault_fails_but_an_unfired_corruption_is_only_noted():
    drawn = one("corrupt-replica")
    assert verdict(drawn, Seen(code=None, summary={}, events=[], problem="no end within 150 s"), REFERENCE) == \
        (FAILED, "no end within 150 s")
    corrupt = done(faults_not_fired=["fault corrupt_replica:1:4 never fired: no holder kept it"])
    assert verdict(drawn, Seen(code=0, summary=corrupt, events=[]), REFERENCE)[0] == RECOVERED
    kill = done(faults_not_fired=["fault kill:1:5:backward never fired: the run ended at step 4"])
    assert verdict(drawn, Seen(code=0, summary=kill, events=[]), REFERENCE) == (FAILED, kill["faults_not_fired"][0])


def test_the_documented_error_needs_exit_1_its_words_and_no_spare():
    drawn = one("script-error")
    said = done(error=f"{drawn.expect}: injected error. Not a node failure, so no spare was used.\nTraceback")
    first_sentence = f"{drawn.expect}: injected error"
    assert verdict(drawn, Seen(code=1, summary=said, events=[]), REFERENCE) == (DOCUMENTED, first_sentence)
    swapped = Seen(code=1, summary=said, events=[{"event": "spare_called", "t": 1.0}])
    assert verdict(drawn, swapped, REFERENCE)[1] == \
        "the script's error was treated as a node failure (a spare was used)"
    assert verdict(drawn, Seen(code=0, summary=done(), events=[]), REFERENCE)[0] == FAILED


def test_a_resume_must_start_from_a_checkpoint_skip_the_damaged_one_and_end_on_the_reference():
    drawn = one("corrupt-checkpoint-resume")
    resumed = done(resumed_from={"step": 6, "path": "ckpt/step-0000000006"})
    ok = Seen(code=143, summary=done(), events=[], resumed_code=0, resumed=resumed, corrupted_step=7)
    assert verdict(drawn, ok, REFERENCE) == (RECOVERED, "")
    assert verdict(drawn, replace(ok, corrupted_step=6), REFERENCE)[1] == \
        "resumed from step 6, the damaged checkpoint 6 was not skipped"
    assert verdict(drawn, replace(ok, resumed=done(resumed_from=None)), REFERENCE)[1] == \
        "the resumed job started at step 0: nothing committed was kept"
    assert verdict(drawn, replace(ok, code=1), REFERENCE)[1].startswith("the launcher's exit after SIGTERM was 1")
    killed = one("coordinator-death-resume")
    assert verdict(killed, replace(ok, code=-9, corrupted_step=None), REFERENCE) == (RECOVERED, "")


def test_timings_from_the_injected_fault_or_the_runners_action():
    events = [{"event": "step", "t": 9.5}, {"event": "fault_injected", "kind": "kill", "t": 10.0},
              {"event": "failure_detected", "t": 10.25}, {"event": "step", "t": 10.375},
              {"event": "swap_complete", "t": 11.0}, {"event": "step", "t": 11.5}]
    assert timings(Seen(code=0, summary={}, events=events)) == (0.25, 1.5)
    assert timings(Seen(code=0, summary={}, events=events, t_action=9.75)) == (0.5, 1.75)
    assert timings(Seen(code=0, summary={}, events=events[:1])) == (None, None)


def test_rows_and_the_table():
    drawn = one("kill-backward")
    events = [{"event": "fault_injected", "kind": "kill", "t": 1.0}, {"event": "failure_detected", "t": 1.125},
              {"event": "restore_decided", "target": 4, "from_disk": False, "t": 1.25},
              {"event": "swap_complete", "t": 1.5}, {"event": "step", "t": 2.0}]
    good = row(drawn, Seen(code=0, summary=done(), events=events, wall_s=30.04), REFERENCE)
    assert (good["outcome"], good["bit_for_bit"], good["detect_s"], good["fault_to_next_step_s"],
            good["steps_redone"], good["notes"], good["wall_s"]) == (RECOVERED, True, 0.125, 1.0, 1,
                                                                     ["restored step 4"], 30.0)
    bad = row(drawn, Seen(code=1, summary=done(error="a | b"), events=[]), REFERENCE)
    node = skipped(one("kill-node"), "needs network namespaces: network namespaces need root")
    assert failed([good, bad, node]) == ["kill-backward"] and node["outcome"] == SKIPPED
    table = markdown([good, bad, node]).splitlines()
    assert table[0].startswith("| scenario | seed | what was done | outcome |") and len(table) == 5
    assert f"| kill-backward | {drawn.seed} | SIGKILL rank {drawn.rank} in backward of step {drawn.step} | " \
           f"{RECOVERED} | 0.12 | 1.00 | 1 | yes | restored step 4 |" == table[2]
    assert "FAILED: exit 1: a \\| b" in table[3] and table[3].endswith("| — | — | 1 | no | — |")
    assert "skipped: needs network namespaces" in table[4]


def test_a_fault_spec_round_trips_through_the_cli_parser():
    from deadpool.launcher.options import parse_faults

    for drawn in select("all", 3, STEPS):
        argv = job_argv(drawn, Path("/tmp/x/run"), STEPS)
        specs = [a.split("=", 1)[1] for a in argv if a.startswith("--fault=")]
        assert [f for s in specs for f in parse_faults(s)] == [
            Fault(kind=f.kind, rank=f.rank, step=f.step, phase=f.phase) for f in drawn.faults()]
