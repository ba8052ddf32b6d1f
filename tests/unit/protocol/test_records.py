"""Tests for deadpool/protocol/records.py: records round-trip, and malformed ones are refused by name."""

import json

import pytest

from deadpool.errors import ProtocolError
from deadpool.protocol.records import PersistOrder, PersistReport


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
