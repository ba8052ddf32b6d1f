"""Tests for deadpool/protocol/records.py, nodes.py, plan.py and record.py: every record round-trips, and a
malformed one is refused naming the record and the field."""

import json

import pytest

from deadpool.errors import ProtocolError
from deadpool.protocol.kinds import Ending, Phase, Role
from deadpool.protocol.nodes import NodeHello, Pid, ProcessExit, SpawnOrder
from deadpool.protocol.plan import Plan
from deadpool.protocol.records import (
    Abort,
    Commit,
    Device,
    Durable,
    Fence,
    Handover,
    Heartbeat,
    Listening,
    PersistOrder,
    PersistReport,
    Published,
    Ready,
    Resumed,
    Running,
    ScriptError,
    Shutdown,
    Started,
    Target,
)


def test_records_round_trip():
    order = PersistOrder(step=12, gen=3, writers=("s0", "w1", "s0"), reason="10 commits")
    assert PersistOrder.from_json(order.to_json()) == order
    assert order.ranks_of("s0") == [0, 2] and order.ranks_of("w9") == []
    report = PersistReport(step=12, proc="s0", ranks=(0, 2), ok=True, nbytes=7, seconds=0.25)
    assert PersistReport.from_json(report.to_json()) == report


@pytest.mark.parametrize("text,why", [
    (b"\xff", "not JSON"),
    ("[1, 2]", "expected an object"),
    (json.dumps({"step": 1, "gen": 0, "writers": ["s0"]}), "'reason'"),
    (json.dumps({"step": "1", "gen": 0, "writers": ["s0"], "reason": ""}), "'step'"),
    (json.dumps({"step": True, "gen": 0, "writers": ["s0"], "reason": ""}), "'step'"),
    (json.dumps({"step": 1, "gen": 0, "writers": [7], "reason": ""}), "process names"),
])
def test_a_malformed_order_is_refused_naming_what_is_wrong(text, why):
    with pytest.raises(ProtocolError, match="malformed PersistOrder") as error:
        PersistOrder.from_json(text)
    assert why in str(error.value)


def test_a_report_without_its_outcome_is_refused():
    with pytest.raises(ProtocolError, match="'ok'"):
        PersistReport.from_json(json.dumps({"step": 1, "proc": "s0", "ranks": [0], "error": "", "nbytes": 0,
                                            "seconds": 0}))


# ---- every record of the control plane -------------------------------------------------------

EVERY_RECORD = [
    Published(gen=4),
    Abort(gen=4, reason="w1 (rank 1) failed"),
    Commit(gen=4, step=12, abandoned=(13,)),
    Commit(gen=0, step=None, abandoned=()),
    Target(gen=4, step=12),
    Running(gen=4),
    Shutdown(how=Ending.TERMINATED),
    Fence(proc="w2"),
    Started(proc="s0"),
    Heartbeat(gen=4, beat=17, step=12, phase="forward", marks=40, waiting=True, step_s=0.25),
    Heartbeat(gen=0, beat=-1, step=0, phase=Phase.FINISHED, marks=0, waiting=False, step_s=None),
    ScriptError(rank=1, step=3, error="ValueError: boom", taking_over=None, gen=4),
    ScriptError(rank=None, step=None, error="EOFError: Ran out of input", taking_over=4),
    Device(proc="w1", gpu=3),
    Durable(gen=4, rank=1, steps=(11, 12), skipped=(10,), fingerprints={11: 7, 12: 2**63 - 1}, audits={12: (3, -5)}),
    Ready(gen=5, rank=0, steps=(12,)),
    Resumed(gen=5, rank=0, step=12),
    Listening(gen=5, host="10.0.0.2", port=41000),
    Handover(gen=5, snapshots=2),
    NodeHello(node=2, host="n2", pid=99),
    SpawnOrder(node=2, index=1, name="s4", role=Role.SPARE, rank=8),
    Pid(proc="s4", pid=1234),
    ProcessExit(proc="s4", code=-9, pid=None),
    Plan(generation=2, ranks=("w0", "s0"), holders=(("s1",), ("w0",)), spares=("s1",), sources=(None, "s0"),
         nodes={"w0": 0, "s0": 1, "s1": 1}, fresh=((), ("w0",))),
]


@pytest.mark.parametrize("record", EVERY_RECORD, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_as_plain_json(record):
    text = record.to_json()
    assert type(record).from_json(text) == record
    assert type(record).from_json(text.encode()) == record
    assert isinstance(json.loads(text), dict)  # plain data, nothing pickled


def test_types_come_back_as_declared():
    back = Durable.from_json(Durable(gen=1, rank=0, steps=(1,), skipped=(), fingerprints={1: 5}).to_json())
    assert type(back.steps) is tuple and back.fingerprints == {1: 5}  # JSON's string keys read back as steps
    order = SpawnOrder.from_json(SpawnOrder(0, 1, "w0", Role.WORKER, 0).to_json())
    assert order.role is Role.WORKER
    assert Heartbeat.from_json(json.dumps({**json.loads(EVERY_RECORD[9].to_json()), "step_s": 1})).step_s == 1.0


def _without(record, name):
    raw = json.loads(record.to_json())
    del raw[name]
    return json.dumps(raw)


def _with(record, **fields):
    return json.dumps({**json.loads(record.to_json()), **fields})


@pytest.mark.parametrize("kind, text, why", [
    (Commit, "{not json", "not JSON"),
    (Commit, b"\xff", "not JSON"),
    (Commit, "[4, 12]", "expected an object"),
    (Commit, _without(Commit(4, 12, ()), "abandoned"), "field 'abandoned' is missing"),
    (Commit, _with(Commit(4, 12, ()), step="12"), "field 'step'"),
    (Commit, _with(Commit(4, 12, ()), abandoned=[True]), "field 'abandoned[0]'"),
    (Target, _with(Target(4, 12), gen=True), "field 'gen'"),  # JSON true is no generation
    (Target, _with(Target(4, 12), extra=1), "unknown field(s) extra"),
    (Shutdown, _with(Shutdown(Ending.DONE), how="paused"), "field 'how'"),
    (Heartbeat, _with(EVERY_RECORD[9], waiting=1), "field 'waiting'"),
    (Durable, _with(EVERY_RECORD[14], fingerprints={"eleven": 7}), "field 'fingerprints key'"),
    (SpawnOrder, _with(EVERY_RECORD[20], role="king"), "field 'role'"),
    (ProcessExit, _without(EVERY_RECORD[22], "code"), "field 'code' is missing"),
    (Plan, _with(EVERY_RECORD[23], holders=[["s1"], [7]]), "field 'holders[1][0]'"),
    (Plan, _with(EVERY_RECORD[23], nodes={"w0": "zero"}), "field 'nodes.w0'"),
])
def test_a_malformed_record_is_refused_naming_the_record_and_the_field(kind, text, why):
    with pytest.raises(ProtocolError, match=f"malformed {kind.__name__} record") as error:
        kind.from_json(text)
    assert why in str(error.value)


def test_role_of_a_process_name():
    assert (Role.of("w0"), Role.of("s12")) == (Role.WORKER, Role.SPARE)
    assert Role.WORKER == "worker"  # plain JSON and environment values
