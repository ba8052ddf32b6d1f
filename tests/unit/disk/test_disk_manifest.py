"""Tests for deadpool/disk/manifest.py: a job's identity, and the one line saying why a checkpoint does not fit."""

from tests.unit.disk.snapshots import replicated_slots, sharded_slots

from deadpool.disk import Identity, compatible
from deadpool.disk.manifest import shapes_misfit


def manifest_of(identity: Identity) -> dict:
    return {"world_size": identity.world_size, "identity": identity.to_json()}


def test_identity_of_a_snapshot_has_global_shapes_of_stable_tensors_under_every_name():
    ident = Identity.of(replicated_slots()[0].meta, 2, "cfg")
    assert ident.parallelism == "replicated" and ident.world_size == 2
    assert ident.shapes["model.wte.weight"] == ident.shapes["model.head.weight"] == [11, 8]  # tied
    assert ident.shapes["optimizer.state.0.exp_avg"] == [11, 8] and ident.shapes["optimizer.state.0.step"] == []
    assert "model.mask" not in ident.shapes and "rng.torch" not in ident.shapes  # buffers and RNG: not stable
    sharded = Identity.of(sharded_slots()[0][1].meta, 3, "cfg")
    assert sharded.parallelism == "sharded" and sharded.shapes["model.w"] == [7, 4]  # global, not the shard


def test_compatible_is_none_for_the_same_job():
    ident = Identity.of(replicated_slots()[0].meta, 2, "cfg")
    assert compatible(manifest_of(ident), Identity.from_json(ident.to_json())) is None


def test_compatible_names_every_difference_in_one_line():
    saved = Identity("cfg", "replicated", 2, {"model.w": [4, 3], "model.b": [3], "model.old": [1]})
    now = Identity("cfg2", "sharded", 4, {"model.w": [4, 5], "model.b": [3], "model.new": [2]})
    line = compatible(manifest_of(saved), now)
    assert line == ("world size 2 in the checkpoint, 4 now; parallelism replicated in the checkpoint, sharded now; "
                    "config hash cfg in the checkpoint, cfg2 now; model.new missing from the checkpoint; "
                    "model.old in the checkpoint only; model.w has shape [4, 3] in the checkpoint, [4, 5] now")
    assert "\n" not in line
    assert compatible(manifest_of(saved), Identity("cfg", "replicated", 3, saved.shapes)) == \
        "world size 2 in the checkpoint, 3 now"


def test_shapes_misfit_names_what_the_live_state_lacks_or_shapes_otherwise_not_state_built_later():
    saved = Identity("cfg", "replicated", 2, {"model.w": [4, 3], "model.b": [3], "model.c": [2],
                                              "optimizer.state.0.exp_avg": [4, 3]})
    assert shapes_misfit(manifest_of(saved), {"model.w": [4, 3], "model.b": [3], "model.c": [2]}) is None
    live = {"model.w": [8, 3], "model.b": [8], "model.c": [2], "model.new": [1]}
    assert shapes_misfit(manifest_of(saved), live) == (
        "model.new missing from the checkpoint; model.w has shape [4, 3] in the checkpoint, [8, 3] now "
        "(and 1 more of other shapes)")
