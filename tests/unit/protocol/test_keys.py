"""Tests for deadpool/protocol/keys.py and plan.py: the JSON plan and the store keys."""

import json

from deadpool.coordinator.policy import place_devices
from deadpool.protocol.keys import Keys, torchrun_env
from deadpool.protocol.plan import Plan

PLAN = Plan(generation=3, ranks=("w0", "s1", "w2"), holders=(("s0",), ("s0", "s2"), ()), spares=("s0", "s2"),
            reason="w1 (rank 1) failed; spare s1 takes rank 1", fresh=((), ("s2",), ()))


def test_plan_json_round_trip():
    back = Plan.from_json(PLAN.to_json())
    assert back == PLAN
    assert type(back.ranks) is tuple and type(back.spares) is tuple
    assert type(back.holders) is tuple and all(type(h) is tuple for h in back.holders)


def test_plan_from_bytes():
    assert Plan.from_json(PLAN.to_json().encode()) == PLAN


def test_plan_json_is_plain_data():
    assert json.loads(PLAN.to_json()) == {
        "generation": 3, "ranks": ["w0", "s1", "w2"], "holders": [["s0"], ["s0", "s2"], []],
        "spares": ["s0", "s2"], "reason": "w1 (rank 1) failed; spare s1 takes rank 1",
        "replicate": True, "sources": [], "replicas": 1, "nodes": {}, "fresh": [[], ["s2"], []]}


def test_fresh_holders_by_rank():
    assert [PLAN.fresh_for(r) for r in range(3)] == [(), ("s2",), ()]
    assert Plan(generation=0, ranks=("w0",), holders=((),), spares=()).fresh_for(0) == ()


def test_plan_default_reason():
    assert Plan(generation=0, ranks=("w0",), holders=((),), spares=()).reason == "job start"


def test_world_size():
    assert PLAN.world_size == 3


def test_rank_of():
    assert [PLAN.rank_of(p) for p in ("w0", "s1", "w2")] == [0, 1, 2]
    assert PLAN.rank_of("s0") is None
    assert PLAN.rank_of("w1") is None  # replaced


def test_held_by():
    assert PLAN.held_by("s0") == [0, 1]
    assert PLAN.held_by("s2") == [1]
    assert PLAN.held_by("w0") == []


def all_keys(keys: Keys, gen: int) -> list[str]:
    return [keys.generation(), keys.plan(gen), keys.abort(gen), keys.shutdown(), keys.group_prefix(gen),
            keys.pair_prefix(gen, 1, "s0"), keys.transfer_prefix(gen, 1), keys.durable(gen, 5), keys.committed(gen),
            keys.ready(gen, 1), keys.target(gen), keys.resumed(gen, 1), keys.running(gen), keys.started("w1"),
            keys.heartbeat("w1"), keys.script_error("w1"), keys.fault_fired(0)]


def test_every_key_is_under_the_token_prefix():
    keys = Keys("s3cret")
    assert keys.prefix == "deadpool/s3cret/"
    listed = all_keys(keys, 2)
    assert all(k.startswith("deadpool/s3cret/") for k in listed)
    assert len(set(listed)) == len(listed)  # no two purposes share a key


def test_keys_exact_names():
    keys = Keys("t")
    assert all_keys(keys, 2) == [
        "deadpool/t/gen", "deadpool/t/plan/2", "deadpool/t/abort/2", "deadpool/t/shutdown", "deadpool/t/g2/pg/",
        "deadpool/t/g2/rep/1/s0/", "deadpool/t/g2/xfer/1/", "deadpool/t/g2/durable/5", "deadpool/t/g2/committed",
        "deadpool/t/g2/ready/1", "deadpool/t/g2/target", "deadpool/t/g2/resumed/1", "deadpool/t/running/2",
        "deadpool/t/started/w1", "deadpool/t/hb/w1", "deadpool/t/error/w1", "deadpool/t/fault/0"]


def test_different_tokens_share_no_key():
    assert not set(all_keys(Keys("a"), 1)) & set(all_keys(Keys("b"), 1))


def test_generations_get_disjoint_data_plane_prefixes():
    keys = Keys("t")
    for g1, g2 in [(1, 2), (1, 10), (2, 12)]:  # 10 and 12 must not be read as extensions of 1 and 2
        a, b = keys.group_prefix(g1), keys.group_prefix(g2)
        assert a != b and not a.startswith(b) and not b.startswith(a)
        a, b = keys.pair_prefix(g1, 0, "s0"), keys.pair_prefix(g2, 0, "s0")
        assert a != b and not a.startswith(b) and not b.startswith(a)
    per_gen = ["plan", "abort", "target", "committed", "running"]
    for name in per_gen:
        assert getattr(keys, name)(1) != getattr(keys, name)(2)
    assert keys.ready(1, 0) != keys.ready(2, 0) and keys.resumed(1, 0) != keys.resumed(2, 0)
    assert keys.durable(1, 5) != keys.durable(2, 5) and keys.transfer_prefix(1, 0) != keys.transfer_prefix(2, 0)


def test_pair_prefixes_differ_by_rank_and_holder():
    keys = Keys("t")
    prefixes = {keys.pair_prefix(1, r, h) for r in (0, 1, 11) for h in ("s0", "s1")}
    assert len(prefixes) == 6
    assert not any(a != b and a.startswith(b) for a in prefixes for b in prefixes)


def test_sources_say_who_streams_a_replica_to_its_new_owner():
    plan = Plan(generation=1, ranks=("s0", "w1", "s1"), holders=((), (), ()), spares=(), sources=(None, None, "s0"))
    assert plan.source_of(2) == "s0" and plan.source_of(0) is None
    assert plan.sends_from("s0") == [2] and plan.sends_from("s1") == []
    assert Plan.from_json(plan.to_json()) == plan


# ---- the device rule: LOCAL_RANK names the GPU a process uses (README "Devices") ----------------

def test_without_a_gpu_local_rank_is_the_place_on_the_node():
    assert torchrun_env(3, 4) == {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    assert torchrun_env(3, 4, nproc_per_node=2) == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                                                    "LOCAL_WORLD_SIZE": "2"}


def test_a_worker_gpu_is_its_place_on_the_node_so_nothing_changes_for_workers():
    devices = place_devices(workers=4, spares=0, gpus=4).value
    assert devices is not None
    for rank, gpu in enumerate(devices):
        assert torchrun_env(rank, 4, gpu=gpu) == torchrun_env(rank, 4)


def test_a_spare_on_a_gpu_of_its_own_gets_that_gpu_as_local_rank():
    """2 workers and 1 spare on 3 GPUs: s0 (GPU 2) takes rank 1. A script's cuda:{LOCAL_RANK} must be GPU 2,
    where session.device is, not GPU 1, which the failed rank held (and which may be broken)."""
    devices = place_devices(workers=2, spares=1, gpus=3).value
    assert devices == (0, 1, 2)
    env = torchrun_env(1, 2, gpu=devices[2])
    assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("1", "2", "2")


def test_a_spare_without_a_gpu_takes_the_failed_ranks_and_its_local_rank():
    """2 workers and 1 spare on 2 GPUs: s0 has none of its own and takes over rank 1's GPU (member._device_index),
    so its LOCAL_RANK is rank 1's, as before the swap."""
    devices = place_devices(workers=2, spares=1, gpus=2).value
    assert devices == (0, 1, None)
    assert torchrun_env(1, 2, gpu=devices[1]) == torchrun_env(1, 2)


def test_on_a_spare_node_the_taker_local_rank_is_its_gpu_on_its_own_machine():
    """Nodes of 2, 2 GPUs each: spare s1 (the second process of the spare node: GPU 1 there) takes rank 2,
    whose place on its node was 0."""
    env = torchrun_env(2, 4, nproc_per_node=2, gpu=1)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2", "1", "4", "2")


def test_the_reports_the_coordinator_waits_on_wake_it_and_nothing_else_does():
    keys = Keys("t")
    reports = [keys.durable(3, 1), keys.ready(0, 2), keys.resumed(1, 0), keys.started("w0"), keys.script_error("s0"),
               keys.exited("w1"), keys.node_exit(2, "w3"), keys.nodes_joined(), keys.persisted("s0")]
    others = [keys.heartbeat("w0"), keys.alive("w0"), keys.node_beat(1), keys.node(1), keys.node_claim(1),
              keys.committed(0),
              keys.status(), Keys.listening(keys.pair_prefix(0, 1, "s0")), keys.plan(1), keys.fault_fired(0),
              Keys("u").durable(3, 1)]  # another job's report
    assert [k for k in reports if not keys.is_report(k)] == []
    assert [k for k in others if keys.is_report(k)] == []
