"""The GPU check (scripts/gpu_check.sh) rehearsed on the CPU: the script a GPU session runs blind, with
minutes of device time, must not be the thing that fails. Same sequence, gloo instead of NCCL."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.integration.conftest import REPO


def test_the_gpu_check_runs_its_whole_sequence_and_passes_on_the_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--rehearse", "--skip-overhead",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["rehearsal"] is True and len(report["checks"]) == 2 and all(report["checks"].values())
    for mode in ("deterministic", "nondeterministic"):
        for fault in ("kill_backward", "kill_snapshot_copy"):
            run = report[mode][fault]
            assert run["exit"] == 0 and run["swaps"] == 1 and run["spare_device"] == ["cpu"]
            assert run["state_equal"] and run["losses_equal"]  # the CPU's kernels are deterministic either way
    assert "PASS  deterministic: kill_backward -> same state and losses, spare on cpu" in done.stdout
