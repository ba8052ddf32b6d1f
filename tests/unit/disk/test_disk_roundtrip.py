"""Tests for deadpool/disk write.py, finish.py and read.py together: real slots, real DCP, real files."""

import json

import torch
import torch.distributed.checkpoint as dcp
from tests.unit.disk.snapshots import Box, plain_load, replicated_slots, seal, sharded_slots, slot_tensors

from deadpool.disk import Identity, finalize, newest, read_rank, step_dir, tmp_dir, verify, write_part
from deadpool.runtime.slots import checksum
from deadpool.runtime.state import flatten


def identity(slot, world=2) -> Identity:
    return Identity.of(slot.meta, world, "cfg-1")


def checkpoint(root, step=7, slots=None):
    """Writes `slots` (default: 2 replicated ranks) as checkpoint `step`: rank 0 by s0, the rest by w1."""
    slots = slots or replicated_slots(step)
    ident = identity(slots[0], len(slots))
    write_part(root, step, "s0", {0: slots[0]}, ident)
    write_part(root, step, "w1", {r: s for r, s in enumerate(slots) if r}, ident)
    return finalize(root, step, len(slots), ident, keep=3), slots, ident


def test_round_trip_two_writers(tmp_path):
    slots = replicated_slots()
    ident = identity(slots[0])
    assert write_part(tmp_path, 7, "s0", {0: slots[0]}, ident) == tmp_dir(tmp_path, 7) / "part-s0"
    assert finalize(tmp_path, 7, 2, ident, keep=2) is None  # rank 1 is missing: nothing visible yet
    assert newest(tmp_path) is None
    write_part(tmp_path, 7, "w1", {1: slots[1]}, ident)
    path = finalize(tmp_path, 7, 2, ident, keep=2)
    assert path == step_dir(tmp_path, 7) and not tmp_dir(tmp_path, 7).exists()
    found, manifest = newest(tmp_path, ident)
    assert found == path and manifest["step"] == 7 and manifest["world_size"] == 2 and verify(path) is None
    for rank, slot in enumerate(slots):
        meta, buffer = read_rank(path, rank)
        assert meta == slot.meta and buffer.numel() == slot.nbytes
        assert checksum(meta, buffer) == slot.digest  # every tensor, and zero padding, exactly as in the slot
        assert torch.equal(buffer, slot.data)


def test_a_plain_torch_process_loads_the_model_and_converts_the_checkpoint(tmp_path):
    """Without importing deadpool: dcp.load of {"model": model.state_dict()} (tied weights and buffers
    included) and dcp_to_torch_save, both equal to rank 0's snapshot bit for bit."""
    path, slots, _ = checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    plain_load(path, out)
    ours = slot_tensors(slots[0])
    skeleton = json.loads(slots[0].meta)["skeleton"]
    model_nodes = dict(skeleton["d"])["model"]["d"]
    loaded = torch.load(out / "model.pt")
    assert set(loaded) == {k for k, _ in model_nodes}
    for name, node in model_nodes:
        assert torch.equal(loaded[name], ours[node["T"]]), name
    assert torch.equal(loaded["head.weight"], loaded["wte.weight"])
    full = torch.load(out / "full.pt", weights_only=False)
    for name, node in model_nodes:
        assert torch.equal(full["model"][name], ours[node["T"]]), name
    assert torch.equal(full["optimizer"]["state"]["0"]["exp_avg"],
                       slots[0].tensors(torch.device("cpu"))[1][_index(skeleton, "optimizer", "state", 0, "exp_avg")])


def _index(skeleton, *path) -> int:
    node = skeleton
    for key in path:
        node = dict((k, v) for k, v in node["d"])[key]
    return node["T"]


def test_replicated_tensors_are_written_once(tmp_path):
    """Two data-parallel ranks with 4 MiB of parameters each: the checkpoint holds one copy of them."""
    slots = []
    for rank in range(2):
        torch.manual_seed(0)
        weights = Box({"w": torch.nn.Parameter(torch.randn(1024, 1024))})
        slots.append(seal(flatten({"model": weights, "rng": Box({"r": torch.full((64,), rank)})}), 1, True))
    path, _, _ = checkpoint(tmp_path, 1, slots)
    data = sum(f.stat().st_size for f in path.rglob("*.distcp"))
    assert 4 << 20 < data < (4 << 20) + 64_000
    assert not [k for k, c in json.loads((path / "part-w1" / "part.json").read_text())["ranks"]["1"]["chunks"].items()
                if c["fqn"] != k]  # rank 1 stored only its private tensors
    for rank, slot in enumerate(slots):
        meta, buffer = read_rank(path, rank)
        assert checksum(meta, buffer) == slot.digest


def test_fsdp_shards_are_chunks_of_the_global_tensors(tmp_path):
    """Three ranks' Shard(0) pieces (torch.chunk layout, one rank holding none of `few`) load as the whole
    global tensors into plain tensors; each rank reads back its own shard exactly."""
    slots, full = sharded_slots()
    path, _, _ = checkpoint(tmp_path, 3, slots)
    state = {"model": {k: torch.zeros_like(t) for k, t in full.items()}}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    for name, tensor in full.items():
        assert torch.equal(state["model"][name], tensor), name
    for rank, slot in enumerate(slots):
        meta, buffer = read_rank(path, rank)
        assert meta == slot.meta and checksum(meta, buffer) == slot.digest
    assert json.loads(path.joinpath("manifest.json").read_text())["identity"]["parallelism"] == "sharded"


def test_a_part_is_written_once(tmp_path):
    slots = replicated_slots()
    ident = identity(slots[0])
    part = write_part(tmp_path, 7, "s0", {0: slots[0]}, ident)
    before = {p.name: p.stat().st_mtime_ns for p in part.iterdir()}
    assert write_part(tmp_path, 7, "s0", {0: slots[0]}, ident) == part
    assert {p.name: p.stat().st_mtime_ns for p in part.iterdir()} == before
    (part / "part.json").unlink()  # a crash before part.json: the part is written again
    assert write_part(tmp_path, 7, "s0", {0: slots[0]}, ident) == part and (part / "part.json").exists()


def test_a_slot_with_garbage_padding_is_refused(tmp_path):
    slot = replicated_slots()[0]
    meta = json.loads(slot.meta)
    _, _, offset, n = next(spec for spec in meta["tensors"] if spec[3] % 64)
    slot.data[offset + n] = 1
    slot.digest = checksum(slot.meta, slot.data)
    try:
        write_part(tmp_path, 7, "s0", {0: slot}, identity(slot))
    except ValueError as error:
        assert "padding" in str(error)
    else:
        raise AssertionError("written")
