"""Tests for deadpool/launcher/status.py: `deadpool status` on a run directory."""

import json

import pytest

from deadpool.errors import ConfigError
from deadpool.launcher.cli import main
from deadpool.launcher.status import read_status, render
from deadpool.protocol.status import JobStatus, Member, Recovery, write_status

STATUS = JobStatus(generation=1, phase="steady", outcome="running", reason=None, exit_code=None,
                   members=(Member("w0", 0, 0, ()), Member("s0", 1, 2, ()), Member("s1", None, 3, (0, 1))),
                   committed=7, recoveries=(Recovery(1, "rank 1 (w1, pid 42) killed by SIGKILL", 4, 0.52,
                                                     {"1": "s0"}),),
                   hang_timeout_s=10.0, hang_timeout_reason="no step timed yet: 10 s")


def test_json_output_is_the_record_plus_the_holders_host_memory(tmp_path, capsys):
    write_status(tmp_path / "status.json", STATUS)
    events = [{"event": "plan_published", "holders": [["s1"], ["s1"]]},
              {"event": "replica_memory", "proc": "s1", "of_rank": 0, "bytes": 100},
              {"event": "replica_memory", "proc": "s1", "of_rank": 1, "bytes": 50, "mapped": 70}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert main(["status", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out.pop("replica_memory_bytes") == {"s1": 150}
    assert out.pop("replica_mapped_bytes") == {"s1": 70}  # its senders' slots, mapped on their machine
    assert out.pop("source") == "run directory"  # no coordinator answers for it
    assert out == json.loads(STATUS.to_json())


def test_text_output_says_where_the_job_stands():
    text = render(STATUS, {"s1": 3 * 2**20})
    assert text.splitlines() == [
        "job: running, generation 1 (steady)",
        "last commit: step 7",
        "ranks:",
        "  rank 0: w0 on node 0",
        "  rank 1: s0 on node 2",
        "spares and holders:",
        "  s1 on node 3 (idle spare): holds rank(s) 0, 1, 3.0 MiB of host memory",
        "recoveries: 1",
        "  generation 1: rank 1 (w1, pid 42) killed by SIGKILL; restored step 4; s0 took rank 1; 0.52 s from "
        "detection to resume",
        "hang timeout: 10.0 s (no step timed yet: 10 s)",
    ]


def test_a_directory_without_a_record_or_with_a_broken_one_is_refused(tmp_path, capsys):
    with pytest.raises(ConfigError, match="status.json does not exist"):
        read_status(tmp_path)
    (tmp_path / "status.json").write_text('{"version": 1}')
    assert main(["status", str(tmp_path)]) == 2
    assert "job status: missing" in capsys.readouterr().err


def test_text_output_names_the_senders_slots_a_holder_maps():
    text = render(STATUS, {"s1": 0}, {"s1": 6 * 2**20})
    assert "  s1 on node 3 (idle spare): holds rank(s) 0, 1, 0.0 MiB of host memory (and 6.0 MiB of its " \
           "senders' slots, mapped)" in text.splitlines()
