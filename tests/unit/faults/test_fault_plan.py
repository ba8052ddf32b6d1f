"""Tests for deadpool/faults/plan.py: a planned fault fires at its exact point, for its rank, once per job."""

import pytest

from deadpool.config import Fault
from deadpool.errors import InjectedError
from deadpool.faults.plan import FaultInjector
from deadpool.protocol.keys import Keys
from deadpool.protocol.plane import ControlPlane
from deadpool.protocol.store import StoreClient, StoreServer

SECRET = bytes(range(32))


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []

    def emit(self, event: str, **fields) -> None:
        self.seen.append((event, fields))


@pytest.fixture
def plane():
    """A control plane on a real store server on loopback: the injector counts firings there, once per job."""
    server = StoreServer("127.0.0.1", 0, SECRET)
    client = StoreClient("127.0.0.1", server.port, SECRET, timeout_s=5)
    yield ControlPlane(client)
    client.close()
    server.close()


def injector(plane: ControlPlane, *faults: Fault, rank: int | None):
    events = Events()
    faults_ = FaultInjector(faults, plane, Keys("job"), events)
    faults_.rank = rank
    return faults_, events


def test_a_holder_handing_over_fires_the_fault_planned_for_the_rank_it_hands_over_once(plane):
    faults, events = injector(plane, Fault(kind="error", rank=3, step=0, phase="handover"), rank=0)  # s0, now rank 0
    faults.point("handover", 0, rank=2)  # another rank's hand-over: nothing
    with pytest.raises(InjectedError, match="^injected error on rank 3 in handover of step 0$"):
        faults.point("handover", 0, rank=3)
    faults.point("handover", 0, rank=3)  # once per job
    assert events.seen == [("fault_injected", dict(kind="error", target_rank=3, step=0, phase="handover"))]


def test_a_process_without_a_rank_fires_nothing_of_its_own(plane):
    faults, events = injector(plane, Fault(kind="error", rank=1, step=0, phase="init"), rank=None)
    faults.point("init", 0)
    assert events.seen == []
