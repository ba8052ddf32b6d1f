"""Tests for deadpool/runtime/plane.py: torch's Store over the control plane, and the interruptible view of it
that lets a generation's end release a gloo rendezvous whose peer never comes (real server, real gloo)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from deadpool.errors import StoreTimeout
from deadpool.protocol.store import StoreClient, StoreServer
from deadpool.runtime.plane import Interruptible, PlaneStore

SECRET = bytes(range(32))


@pytest.fixture
def plane():
    server = StoreServer("127.0.0.1", 0, SECRET)
    yield PlaneStore(StoreClient("127.0.0.1", server.port, SECRET, timeout_s=5))
    server.close()


def stop_after(seconds: float) -> threading.Event:
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    return stop


def test_an_interruptible_get_returns_a_key_that_comes_and_gives_up_when_stopped(plane):
    store = Interruptible(plane, stop_after(0.3).is_set)
    threading.Timer(0.1, lambda: plane.client.set("k", "v")).start()
    assert store.get("k") == b"v"
    started = time.monotonic()
    with pytest.raises(InterruptedError, match="stopped while waiting for \\['never'\\]"):
        store.wait(["never"])
    assert time.monotonic() - started < 2.0


def test_an_interruptible_wait_times_out_like_the_store_when_nobody_stops_it(plane):
    with pytest.raises(StoreTimeout):
        Interruptible(plane, lambda: False).wait(["never"], timedelta(seconds=0.2))


def test_a_gloo_rendezvous_whose_peer_never_comes_is_released_when_stopped(plane):
    """A taker whose holder died as the transfer started: gloo would wait the whole group timeout (60 s here)."""
    view = Interruptible(plane, stop_after(0.5).is_set)  # referenced: torch holds only the C++ half of it
    started = time.monotonic()
    with pytest.raises(Exception, match="stopped while waiting for"):
        dist.ProcessGroupGloo(dist.PrefixStore("pair/", view), 1, 2, timedelta(seconds=60))
    assert time.monotonic() - started < 5.0
