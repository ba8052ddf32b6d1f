"""Tests for deadpool/runtime/generation.py: an incarnation names only its own generation's keys, and
`assume` is how a process takes up its identity (events, faults, torchrun's variables)."""

import os
from types import SimpleNamespace

import pytest

from deadpool.protocol.keys import Keys
from deadpool.protocol.plan import Plan
from deadpool.runtime.generation import Incarnation, assume

PLAN = Plan(generation=3, ranks=("w0", "s0", "w2"), holders=(("w2",), ("w0",), ("s0",)), spares=("s1",))


def fake_ctx(nproc_per_node: int = 0) -> SimpleNamespace:
    return SimpleNamespace(events=SimpleNamespace(rank=None, generation=0), faults=SimpleNamespace(rank=None),
                           config=SimpleNamespace(nproc_per_node=nproc_per_node))


@pytest.fixture
def environ(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(name, "unset")
    return os.environ


def test_a_rank_takes_up_its_identity_everywhere(environ):
    ctx = fake_ctx()
    assume(ctx, Incarnation.of(PLAN, "s0", Keys("token")), gpu=None)  # a spare that took rank 1
    assert (ctx.events.rank, ctx.events.generation, ctx.faults.rank) == (1, 3, 1)
    assert [environ[n] for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")] == ["1", "1", "3", "3"]


def test_on_nodes_the_local_rank_is_the_place_on_the_node(environ):
    assume(fake_ctx(nproc_per_node=2), Incarnation.of(PLAN, "w2", Keys("token")), gpu=None)
    assert [environ[n] for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")] == ["2", "0", "3", "2"]


def test_a_spare_without_a_rank_takes_up_only_the_generation(environ):
    ctx = fake_ctx()
    assume(ctx, Incarnation.of(PLAN, "s1", Keys("token")), gpu=None)
    assert (ctx.events.rank, ctx.events.generation, ctx.faults.rank) == (None, 3, None)
    assert environ["RANK"] == "unset"


def test_an_incarnation_names_only_its_generations_keys():
    keys = Keys("token")
    inc = Incarnation.of(PLAN, "w2", keys)
    assert (inc.abort_key(), inc.ready_key(), inc.resumed_key()) == (keys.abort(3), keys.ready(3, 2),
                                                                     keys.resumed(3, 2))


def test_local_rank_names_the_gpu_the_process_trains_on(environ):
    """A spare on GPU 2 of its own takes rank 1: `cuda:{LOCAL_RANK}` must be GPU 2 (protocol.torchrun_env)."""
    assume(fake_ctx(), Incarnation.of(PLAN, "s0", Keys("token")), gpu=2)
    assert [environ[n] for n in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")] == ["1", "2", "3", "3"]
