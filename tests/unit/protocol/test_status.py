"""Tests for deadpool/protocol/status.py: the job-status record's JSON, and what it refuses."""

import json
import stat

import pytest

from deadpool.errors import ProtocolError
from deadpool.protocol.status import JobStatus, Member, Recovery, write_status

STATUS = JobStatus(generation=1, phase="steady", outcome="running", reason=None, exit_code=None,
                   members=(Member("w0", 0, 0, ()), Member("s0", 1, 2, ()), Member("s1", None, 3, (0, 1))),
                   committed=7, recoveries=(Recovery(1, "rank 1 (w1, pid 42) killed by SIGKILL", 4, 0.52,
                                                     {"1": "s0"}),),
                   hang_timeout_s=10.0, hang_timeout_reason="no step timed yet: 10 s")


def test_round_trip():
    back = JobStatus.from_json(STATUS.to_json())
    assert back == STATUS
    assert type(back.members) is tuple and type(back.members[2].holds) is tuple
    assert type(back.recoveries) is tuple


def test_json_is_plain_data_with_a_version():
    raw = json.loads(STATUS.to_json())
    assert raw["version"] == 1
    assert raw["members"][2] == {"proc": "s1", "rank": None, "node": 3, "holds": [0, 1]}
    assert raw["recoveries"][0]["replaced"] == {"1": "s0"}


def tampered(**changes) -> str:
    raw = json.loads(STATUS.to_json())
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        target = raw
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if value is KeyError:
            del target[leaf]
        else:
            target[leaf] = value
    return json.dumps(raw)


@pytest.mark.parametrize("text, complaint", [
    ("{not json", "job status is not JSON"),
    ("[1, 2]", "job status must be a JSON object, got list"),
    (tampered(generation=KeyError), "job status: missing generation"),
    (tampered(surprise=1), "job status: unknown surprise"),
    (tampered(generation="1"), "job status: generation has the wrong type (str): '1'"),
    (tampered(committed=True), "job status: committed has the wrong type (bool): True"),
    (tampered(version=2), "job status has version 2, this reader knows 1"),
    (tampered(outcome="paused"), "outcome must be running, finished or failed, got 'paused'"),
    (tampered(members__0__rank="0"), "job status member: rank has the wrong type (str)"),
    (tampered(members__2__holds=["0"]), "members.holds must hold rank numbers"),
    (tampered(recoveries__0__cause=KeyError), "job status recovery: missing cause"),
    (tampered(recoveries__0__replaced={"1": 2}), "recovery.replaced: 1 has the wrong type (int)"),
    (tampered(members=[1]), "job status member must be a JSON object, got int"),
])
def test_malformed_records_are_refused_naming_what_is_wrong(text, complaint):
    with pytest.raises(ProtocolError, match=None) as raised:
        JobStatus.from_json(text)
    assert complaint in str(raised.value)


def test_written_whole_and_readable_by_its_owner_only(tmp_path):
    path = tmp_path / "status.json"
    write_status(path, STATUS)
    write_status(path, STATUS)  # replaces it
    assert JobStatus.from_json(path.read_text()) == STATUS
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["status.json"]  # no temporary file left
