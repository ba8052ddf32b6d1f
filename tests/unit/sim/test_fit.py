"""Tests for deadpool/sim/fit.py: the fit recovers the coefficients that generated exact synthetic points, and
a fit file is read back whole or refused naming what it lacks."""

import json

import pytest

from deadpool.sim.fit import FITTED, MEASURED, STORE, fit_points, read_fit

SMALL, LARGE = 1_000_000, 50_000_000


def point(ranks: int, state: int, *, detect: float = 0.03, resends: int = 1) -> dict:
    """One run priced by known coefficients: report 0.04 + 2 ms/rank, rebuild 0.01 + 30 ms/rank (at the small
    state; a large state adds to both, as checksums and resends do in real runs), resends sharing one 200 MB/s
    link after 5 ms of connecting, a restore 600 MB/s."""
    extra = 0.0 if state == SMALL else 0.5
    return {"ranks": ranks, "snapshot_bytes": state, "detect_s": detect, "decide_s": 0.06,
            "report_s": 0.04 + 0.002 * ranks + extra, "rebuild_s": 0.01 + 0.03 * ranks + extra,
            "restore_s": state / 6e8, "restore_bytes": state,
            "resends": [(state, 0.005 + state * resends / 2e8)] * resends}


def test_fit_recovers_the_generating_coefficients_exactly():
    points = [point(n, SMALL, detect=d, resends=n // 2) for n, d in ((2, 0.02), (4, 0.03), (8, 0.05), (16, 0.04))]
    points.append(point(4, LARGE))
    assert fit_points(points) == pytest.approx({
        "exit_notice_s": 0.03, "decide_s": 0.06,  # medians (0.02 0.03 0.03 0.04 0.05)
        "report_s": 0.04, "report_per_rank_s": 0.002, "rebuild_s": 0.01, "rebuild_per_rank_s": 0.03,
        "transfer_s": 0.005, "link_bytes_per_s": 2e8, "restore_bytes_per_s": 6e8}, rel=1e-9, abs=1e-12)


def test_report_and_rebuild_lines_use_only_the_smallest_state():
    """The large-state run lies 0.5 s off both lines; were it used, the slopes would change."""
    points = [point(n, SMALL) for n in (2, 4, 8)] + [point(8, LARGE)]
    fit = fit_points(points)
    assert (fit["report_per_rank_s"], fit["rebuild_per_rank_s"]) == pytest.approx((0.002, 0.03), rel=1e-9)


def test_a_falling_line_is_clamped_to_a_flat_one():
    points = [point(n, s) for n, s in ((2, SMALL), (4, SMALL), (4, LARGE))]
    points[1]["report_s"] = points[0]["report_s"] - 0.01  # the report got cheaper with more ranks
    fit = fit_points(points)
    assert fit["report_per_rank_s"] == 0.0
    assert fit["report_s"] == pytest.approx(points[0]["report_s"] + 0.01, rel=1e-9)  # intercept of the line


def test_a_fit_needs_two_world_sizes_and_resends_that_grow_with_bytes():
    with pytest.raises(ValueError, match="report phase"):
        fit_points([point(4, SMALL), point(4, SMALL), point(4, LARGE)])
    flat = [point(n, s) for n, s in ((2, SMALL), (4, SMALL), (4, LARGE))]
    for p in flat:
        p["resends"] = [(p["snapshot_bytes"], 0.01)]  # 1 MB and 50 MB in the same time
    with pytest.raises(ValueError, match="vary the state size"):
        fit_points(flat)


def test_a_fit_file_is_read_back_and_one_lacking_a_coefficient_is_refused(tmp_path):
    coefficients = {name: float(i + 1) for i, name in enumerate((*MEASURED, *FITTED, *STORE))}
    path = tmp_path / "sim_fit.json"
    path.write_text(json.dumps({"coefficients": coefficients | {"extra": "ignored"}, "points": []}))
    assert read_fit(path) == coefficients
    path.write_text(json.dumps({"coefficients": {k: v for k, v in coefficients.items() if k != "transfer_s"}}))
    with pytest.raises(ValueError, match="transfer_s"):
        read_fit(path)
    with pytest.raises(ValueError, match="cannot read"):
        read_fit(tmp_path / "missing.json")


def test_a_runs_resends_are_one_point_all_their_bytes_in_the_longest_time():
    points = [point(2, SMALL), point(4, SMALL), point(4, LARGE)]
    points[0]["resends"] = [(1e6, 0.01), (1e6, 0.02)]  # (2 MB, 0.02 s)
    points[1]["resends"] = []                          # no resend: no point
    points[2]["resends"] = [(6e6, 0.05)]               # (6 MB, 0.05 s)
    fit = fit_points(points)
    assert (fit["transfer_s"], fit["link_bytes_per_s"]) == pytest.approx((0.005, 4e6 / 0.03), rel=1e-9)
