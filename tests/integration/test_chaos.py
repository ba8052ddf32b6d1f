"""`deadpool chaos` end to end on two cheap scenarios: a SIGKILL recovered bit for bit and a script error ending
with its documented error, judged against the command's own failure-free run; chaos.md and chaos.json written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .conftest import REPO


def test_chaos_runs_two_scenarios_and_judges_them(tmp_path):
    out = subprocess.run([sys.executable, "-m", "deadpool.launcher.cli", "chaos", "--out", str(tmp_path), "--seed",
                          "7", "--scenarios", "kill-backward,script-error", "--deadline", "90"],
                         cwd=REPO, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads((tmp_path / "chaos.json").read_text())
    kill, error = report["scenarios"]
    assert (kill["scenario"], kill["outcome"], kill["bit_for_bit"]) == ("kill-backward", "recovered bit for bit", True)
    assert kill["detect_s"] > 0 and kill["fault_to_next_step_s"] > kill["detect_s"] and kill["steps_redone"] >= 0
    assert (error["scenario"], error["outcome"], error["exit_code"]) == ("script-error", "documented error", 1)
    assert error["why"].startswith("error in the training script on rank ")
    table = (tmp_path / "chaos.md").read_text()
    assert table.count("\n| kill-backward | ") == 1 and table.count("\n| script-error | ") == 1
    assert f"| kill-backward | {kill['seed']} |" in out.stdout  # the table is printed, with each seed


def test_chaos_exits_1_when_its_reference_cannot_finish(tmp_path):
    """Nothing can be judged without the failure-free run: one that misses its deadline ends the command, exit 1,
    saying why, with chaos.json holding the reference and no scenario; no process is left behind."""
    out = subprocess.run([sys.executable, "-m", "deadpool.launcher.cli", "chaos", "--out", str(tmp_path), "--seed",
                          "7", "--scenarios", "kill-backward", "--deadline", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "[chaos] the failure-free reference did not finish within --deadline 2 s" in out.stdout
    report = json.loads((tmp_path / "chaos.json").read_text())
    assert report["scenarios"] == [] and report["reference"]["final_state_sha256"] is None
    assert not [pid for pid in Path("/proc").glob("[0-9]*") if str(tmp_path).encode() in _cmdline(pid)]


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:  # it ended meanwhile
        return b""
