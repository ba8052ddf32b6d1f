"""`deadpool status` on a real job: while it runs, and once it ended, it tells what summary.json tells."""

from __future__ import annotations

import json
import subprocess
import sys

from deadpool.config import Fault
from deadpool.launcher.status import read_status

from .conftest import Background


def test_status_while_running_and_after_a_swap_matches_the_summary(tmp_path):
    job = Background(tmp_path, steps=6, workers=2, spares=1, faults=(Fault(kind="kill", rank=1, step=4),))
    job.wait_for(lambda e: e["event"] == "commit" and e["step"] >= 1)
    live, source = read_status(tmp_path)  # from the coordinator, through the authenticated control plane
    assert (live.outcome, source) == ("running", "live")
    done = job.join()
    assert done.code == 0, done.summary["error"]
    out = subprocess.run([sys.executable, "-m", "deadpool.launcher.cli", "status", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    status = json.loads(out.stdout)
    assert status.pop("source") == "run directory"  # the coordinator is gone: its last record
    assert (status["outcome"], status["exit_code"], status["phase"]) == ("finished", 0, "steady")
    [recovery] = done.summary["recoveries"]
    assert status["generation"] == recovery["generation"] == 1
    [swap] = done.named("swap_complete")
    assert status["recoveries"] == [{"generation": 1, "cause": recovery["cause"],
                                     "restored_step": recovery["restored_step"],
                                     "detect_to_resume_s": swap["detect_to_resume_s"], "replaced": {"1": "s0"}}]
    assert [(m["proc"], m["rank"]) for m in status["members"]] == [("w0", 0), ("s0", 1)]
    assert status["committed"] == done.named("commit")[-1]["step"]
