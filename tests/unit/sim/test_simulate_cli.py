"""Tests for deadpool/sim/cli.py's marks, its --fit file, and its sticky-against-anew comparison (the other
command tests are in test_sim_model.py)."""

import argparse
import json

import pytest

from deadpool.sim import cli, scale
from deadpool.sim.model import ClusterParams, hot_swap_goodput

FIT = {"exit_notice_s": 0.03, "decide_s": 0.06, "report_s": 0.04, "report_per_rank_s": 0.002, "rebuild_s": 0.01,
       "rebuild_per_rank_s": 0.03, "transfer_s": 0.005, "link_bytes_per_s": 2e8, "restore_bytes_per_s": 6e8,
       "coordinator_per_rank_s": 1e-3}
QUICK = ["--days", "2", "--runs", "2"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="deadpool")
    cli.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["simulate", *argv])


def test_each_phase_is_marked_by_its_coefficients_a_flag_or_a_run():
    args = parse(["--rebuild-s", "0.5"])
    assert cli.phase_marks(args, scale.SWAP_MODELS["nccl-shrink"], {"detect": 0.1}) == {
        "detect": "run", "decide": "m", "report": "f+m", "rebuild": "flag", "transfer": "f+a",
        "resend": "f+a+p", "restore": "a"}
    gloo = cli.phase_marks(parse([]), scale.SWAP_MODELS["gloo-here"], {})
    assert (gloo["report"], gloo["rebuild"], gloo["transfer"], gloo["restore"]) == ("f", "f+a", "f", "f")


def test_a_fit_file_prices_the_swap_and_its_coefficients_are_printed_with_their_marks(tmp_path, capsys):
    path = tmp_path / "sim_fit.json"
    path.write_text(json.dumps({"coefficients": FIT}))
    assert cli.main(parse(["--gpus", "1024", "--fit", str(path), "--out", str(tmp_path), *QUICK])) == 0
    out = capsys.readouterr().out
    assert f"the fit in {path}" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("  ")}
    assert rows["report_per_rank_s"] == ["0.001", "s/rank", "measured"]  # the coordinator's, from the store bench
    assert rows["report_s"] == ["0.04", "s", "fitted"]
    assert rows["link_bytes_per_s"] == ["1.25e+10", "B/s", "assumed"]
    written = json.loads((tmp_path / "simulate.json").read_text())
    assert written["sizes"][0]["params"]["report_s"] == pytest.approx(0.04 + 1e-3 * 1024, rel=1e-12)
    assert written["swap_model"]["marks"]["report_s"] == "fitted"
    assert written["swap_model"]["phase_marks"]["report"] == "f+m"


def test_a_bad_fit_file_is_exit_code_2(tmp_path, capsys):
    path = tmp_path / "sim_fit.json"
    path.write_text(json.dumps({"coefficients": {"report_s": 0.1}}))
    assert cli.main(parse(["--gpus", "1024", "--fit", str(path), *QUICK])) == 2
    assert "lacks a number for" in capsys.readouterr().err


def test_sticky_and_anew_differ_only_in_the_resend_and_only_beyond_one_pod(tmp_path, capsys):
    assert cli.main(parse(["--gpus", "1024", "100000", "--out", str(tmp_path), *QUICK])) == 0
    assert "Sticky placement against placing anew" in capsys.readouterr().out
    small, large = json.loads((tmp_path / "simulate.json").read_text())["sizes"]
    assert small["placed_anew"]["swap_s"] == pytest.approx(small["swap_s"], rel=1e-12)  # one pod: no contention
    c, p = scale.SWAP_MODELS["nccl-shrink"], large["params"]
    extra = scale.DEFAULT_NODE_STATE_BYTES / c.link_bytes_per_s * (scale.fabric_factor(c, 100000) - 1)
    assert large["placed_anew"]["resend_s"] - p["resend_s"] == pytest.approx(extra, rel=1e-9)
    assert large["placed_anew"]["swap_s"] - large["swap_s"] == pytest.approx(extra, rel=1e-9)
    anew = ClusterParams(**p | {"resend_s": large["placed_anew"]["resend_s"]})
    assert large["placed_anew"]["hot_swap"] == pytest.approx(hot_swap_goodput(anew), rel=1e-12)
    assert large["placed_anew"]["hot_swap"] < large["analytic"]["hot_swap"]
