"""Tests for the disk tier with data-parallel slices (chunks.py, write.py, finish.py, read.py): N ranks each
holding only its piece of the same replicated state write one checkpoint that torch loads whole and that gives
each rank its whole snapshot back, every byte checked."""

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from tests.unit.disk.plain_model import Tiny
from tests.unit.disk.snapshots import Box, data_parallel_tree, plain_load, slice_of, sliced_slots, slot_tensors
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex

from deadpool.disk import Identity, chunk_rank, finalize, newest, private_key, read_rank, verify, write_part
from deadpool.errors import CheckpointError
from deadpool.runtime.digest import Xxh3
from deadpool.runtime.persist import load_from_disk
from deadpool.runtime.slots import Slot, checksum
from deadpool.runtime.state import flatten, load_into, state_sha256, unflatten


def write_all(root, slots, step=7, writers=None):
    """Each rank's part by its own writer (or as `writers` groups them); the finalized checkpoint's path."""
    ident = Identity.of(slots[0].meta, len(slots), "cfg")
    for writer, ranks in (writers or {f"w{r}": [r] for r in range(len(slots))}).items():
        write_part(root, step, writer, {r: slots[r] for r in ranks}, ident)
    return finalize(root, step, len(slots), ident, keep=3)


def stable_rows(slots):
    """(fqn, row) -> how many times the ranks' chunks hold it, over every rank's chunks of stable tensors."""
    seen: dict[tuple[str, int], int] = {}
    for rank, slot in enumerate(slots):
        for c in chunk_rank(slot.meta, slot.data, rank, len(slots)).chunks:
            if c.sliced:
                rows = range(c.offsets[0], c.offsets[0] + c.tensor.shape[0]) if c.global_shape else [0]
                for row in rows:
                    seen[(c.fqn, row)] = seen.get((c.fqn, row), 0) + 1
    return seen


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_row_of_every_stable_tensor_is_one_ranks_chunk(world):
    slots, wholes, _ = sliced_slots(world=world)
    meta = json.loads(wholes[0].meta)
    expected = {}
    for i, (_, shape, _, n) in enumerate(meta["tensors"]):
        if meta["stable"][i] and n:
            fqn = next(c.fqn for c in chunk_rank(wholes[0].meta, wholes[0].data, 0, world).chunks
                       if c.key == private_key(0, i))
            expected.update({(fqn, row): 1 for row in range(shape[0] if shape else 1)})
    assert stable_rows(slots) == expected


def test_sliced_chunks_are_views_of_the_rows_in_the_piece_and_nothing_is_shared():
    slots, wholes, _ = sliced_slots(world=3)
    for rank, slot in enumerate(slots):
        chunks = chunk_rank(slot.meta, slot.data, rank, 3)
        assert chunks.shared == {}
        start, end = json.loads(slot.meta)["slice"]
        base = slot.data.data_ptr()
        whole = {c.fqn: c.tensor for c in chunk_rank(wholes[rank].meta, wholes[rank].data, 0, 3).chunks}
        for c in chunks.chunks:
            nbytes = c.tensor.numel() * c.tensor.element_size()
            assert c.tensor.untyped_storage().nbytes() == nbytes  # DCP writes it as it is, no clone
            if c.sliced and nbytes:
                assert start <= c.tensor.data_ptr() - base and c.tensor.data_ptr() - base + nbytes <= end
                first = c.offsets[0] if c.offsets else 0
                assert torch.equal(c.tensor, whole[c.fqn][first:first + c.tensor.shape[0]] if c.offsets
                                   else whole[c.fqn])
    private = {(r, c.fqn) for r, s in enumerate(slots) for c in chunk_rank(s.meta, s.data, r, 3).chunks
               if not c.sliced}
    assert (0, "rng.seen") in private and (0, "model.bn.running_mean") in private  # rank 0: global fqns
    assert not {fqn for r, fqn in private if r and not fqn.startswith(f"_deadpool/rank{r}/")}
    empty = [(r, c.fqn) for r, s in enumerate(slots) for c in chunk_rank(s.meta, s.data, r, 3).chunks
             if c.fqn == "extra.none"]
    assert empty == [(0, "extra.none")]  # in no piece: rank 0 stores it


@pytest.mark.parametrize("world", [2, 3, 4])
def test_round_trip_loads_whole_tensors_and_gives_each_rank_its_whole_snapshot(tmp_path, world):
    """dcp.load into plain state dicts gives the replicated state and rank 0's buffers bit for bit; read_rank
    gives each rank exactly the whole slot (metadata without "slice", every byte, zero padding), which
    restores exactly that rank's state, private tensors included, as a resumed rank loads it."""
    slots, wholes, trees = sliced_slots(world=world)
    path = write_all(tmp_path, slots)
    assert verify(path) is None
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 3 and [manifest["ranks"][str(r)]["slice"] for r in range(world)] == \
        [json.loads(s.meta)["slice"] for s in slots]
    model = Tiny()
    for t in model.state_dict().values():
        t.fill_(-1)
    optimizer = trees[0]["optimizer"].state_dict()["state"]  # a plain dict of tensors: no optimizer object
    plain = {"model": model.state_dict(),
             "extra": {k: torch.full_like(v, -1) for k, v in trees[0]["extra"].state.items()},
             "optimizer": {"state": {k: {n: torch.full_like(t, -1) for n, t in v.items()}
                                     for k, v in optimizer.items()}}}
    dcp.load(plain, checkpoint_id=path, no_dist=True)
    for name, tensor in trees[0]["model"].state_dict().items():
        assert torch.equal(plain["model"][name], tensor), name
    for name, tensor in trees[0]["extra"].state.items():
        assert torch.equal(plain["extra"][name], tensor), name
    for k, v in optimizer.items():
        for n, t in v.items():
            assert torch.equal(plain["optimizer"]["state"][k][n], t), (k, n)
    for rank in range(world):
        meta, buffer = read_rank(path, rank)
        assert meta == wholes[rank].meta and torch.equal(buffer, wholes[rank].data)
        assert checksum(meta, buffer) == wholes[rank].digest
        restored = Slot()
        assert load_from_disk(path, rank, restored, world) == 7 and restored.digest == wholes[rank].digest
        skeleton, tensors, numpy_flags = restored.tensors(torch.device("cpu"))
        fresh = data_parallel_tree(world + 5, 0)  # another rank's state, then loaded
        load_into(fresh, unflatten(skeleton, tensors, numpy_flags))
        assert state_sha256(fresh) == state_sha256(trees[rank])


def test_the_replicated_state_is_written_once_about_a_quarter_by_each_of_four_ranks(tmp_path):
    """4 MiB of parameters on four data-parallel ranks: the checkpoint holds one copy of them, as when rank 0
    wrote them whole, each rank about a quarter; no rank refers to another's tensors ("shared")."""
    torch.manual_seed(0)
    weights = torch.randn(1024, 1024)
    flats = [flatten({"model": Box({"w": torch.nn.Parameter(weights.clone())}),
                      "rng": Box({"r": torch.full((64,), r)})}) for r in range(4)]
    path = write_all(tmp_path, [slice_of(flat, 1, r, 4)[0] for r, flat in enumerate(flats)], step=1)
    sizes = [sum(f.stat().st_size for f in (path / f"part-w{r}").glob("*.distcp")) for r in range(4)]
    assert 4 << 20 < sum(sizes) < (4 << 20) + 64_000
    assert all(1 << 20 < size < (1 << 20) + 16_000 for size in sizes)
    for rank in range(4):
        assert json.loads((path / f"part-w{rank}" / "part.json").read_text())["ranks"][str(rank)]["shared"] == {}
    state = {"model": {"w": torch.zeros(1024, 1024)}}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    assert torch.equal(state["model"]["w"], weights)


def test_a_plain_torch_process_loads_a_sliced_checkpoint(tmp_path):
    """Without importing deadpool: dcp.load of a plain model and dcp_to_torch_save, equal to the state bit for
    bit (the optimizer's too); the converted file has no piece under a rank's private key."""
    slots, wholes, trees = sliced_slots(world=3)
    path = write_all(tmp_path / "ckpt", slots, writers={"s0": [0], "w1": [1, 2]})
    out = tmp_path / "out"
    plain_load(path, out)
    loaded = torch.load(out / "model.pt")
    assert set(loaded) == set(trees[0]["model"].state_dict())
    for name, tensor in trees[0]["model"].state_dict().items():
        assert torch.equal(loaded[name], tensor), name
    full = torch.load(out / "full.pt", weights_only=False)
    for k, v in trees[0]["optimizer"].state_dict()["state"].items():
        for n, t in v.items():
            assert torch.equal(full["optimizer"]["state"][str(k)][n], t), (k, n)
    ours = slot_tensors(wholes[1])
    stable = json.loads(wholes[1].meta)["stable"]
    assert {k for k in full if k.startswith("_deadpool/rank1/t")} == {private_key(1, i) for i, s in enumerate(stable)
                                                                      if not s}
    for i, s in enumerate(stable):
        assert s or torch.equal(full[private_key(1, i)], ours[i]), i


def _flip(path: Path, key: str) -> Path:
    """Flips one byte of the stored tensor `key` in its file; returns the file."""
    info = FileSystemReader(path).read_metadata().storage_data
    where = next(v for k, v in info.items() if isinstance(k, MetadataIndex) and k.fqn == key)
    file = path.parent / where.relative_path if "/" in where.relative_path else path / where.relative_path
    raw = bytearray(file.read_bytes())
    raw[where.offset + where.length // 2] ^= 0x10
    file.write_bytes(bytes(raw))
    return file


def test_a_corrupted_slice_is_refused_by_verify_and_by_every_rank_that_rebuilds_with_it(tmp_path):
    slots, _, _ = sliced_slots(world=3)
    path = write_all(tmp_path, slots)
    table = json.loads((path / "part-w1" / "part.json").read_text())["ranks"]["1"]
    key = next(k for k, c in table["chunks"].items() if c.get("sliced") and c["fqn"].startswith("optimizer"))
    file = _flip(path / "part-w1", key)
    assert verify(path) == f"part-w1/{file.name} does not match its xxh3_128 hash (corrupted)"
    start, end = table["slice"]
    with pytest.raises(CheckpointError, match=rf"bytes {start}-{end} of the replicated state \(rank 1's slice\) "
                                              "do not match the hash they were written with"):
        read_rank(path, 0)
    with pytest.raises(CheckpointError, match="does not match the checksum of the slot it was written from"):
        read_rank(path, 1)


def test_a_checkpoint_from_before_the_blocked_hash_still_reads_and_one_naming_an_unknown_hash_is_refused(tmp_path):
    """Formats 1 and 2 checked each rank's slot with plain streaming xxh3_64 and did not name it."""
    slots, _, _ = sliced_slots(world=2)
    path = write_all(tmp_path, slots)
    manifest = json.loads((path / "manifest.json").read_text())
    assert all(entry["hash"] == "xxh3_64/1MiB" for entry in manifest["ranks"].values())
    old = {**manifest, "format": 2, "ranks": {r: {k: v for k, v in entry.items() if k != "hash"}
                                              for r, entry in manifest["ranks"].items()}}
    for rank, slot in enumerate(slots):
        old["ranks"][str(rank)]["crc"] = checksum(slot.meta, slot.data, hasher=Xxh3())
    (path / "manifest.json").write_text(json.dumps(old))
    assert verify(path) is None
    assert [read_rank(path, r)[1].numel() for r in range(2)] == [s.nbytes for s in slots]
    old["ranks"]["1"]["hash"] = "sha7"
    (path / "manifest.json").write_text(json.dumps(old))
    with pytest.raises(CheckpointError, match="rank 1's snapshot in .* cannot be checked: hash 'sha7' is unknown"):
        read_rank(path, 1)


def test_slices_that_overlap_or_leave_a_gap_or_mix_with_whole_snapshots_are_not_finalized(tmp_path):
    slots, wholes, trees = sliced_slots(world=3)
    twice = slice_of(flatten(trees[1]), 7, 0, 3)[0]  # rank 1 holding rank 0's piece
    with pytest.raises(CheckpointError, match=r"rank 1's slice \[0, \d+\] .* a row is missing or twice"):
        write_all(tmp_path / "a", [slots[0], twice, slots[2]])
    with pytest.raises(CheckpointError, match=r"ranks \[1\] wrote whole snapshots and the others slices"):
        write_all(tmp_path / "b", [slots[0], wholes[1], slots[2]])
    short = slice_of(flatten(trees[1]), 7, 1, 2)[0]  # cut for 2 ranks: a gap after rank 0, rank 2's rows twice
    with pytest.raises(CheckpointError, match="a row is missing or twice"):
        write_all(tmp_path / "c", [slots[0], short, slots[2]])


def test_empty_pieces_write_nothing_and_still_round_trip(tmp_path):
    """One stable tensor of one row: the whole replicated state is one piece, the others are empty."""
    flats = [flatten({"model": Box({"w": torch.nn.Parameter(torch.arange(300.0).reshape(1, 300)),
                                    "s": torch.nn.Parameter(torch.tensor(3.5))}),
                      "rng": Box({"r": torch.full((5,), r)})}) for r in range(3)]
    pairs = [slice_of(flat, 2, r, 3) for r, flat in enumerate(flats)]
    pieces = [json.loads(s.meta)["slice"] for s, _ in pairs]
    assert sum(b > a for a, b in pieces) <= 2  # one or two pieces hold everything
    path = write_all(tmp_path, [s for s, _ in pairs], step=2)
    assert verify(path) is None
    for rank, (_, whole) in enumerate(pairs):
        meta, buffer = read_rank(path, rank)
        assert meta == whole.meta and torch.equal(buffer, whole.data)


def test_a_checkpoint_written_sliced_fits_a_job_that_does_not_slice_and_an_unknown_format_is_refused(tmp_path):
    slots, wholes, _ = sliced_slots(world=2)
    assert Identity.of(slots[1].meta, 2, "cfg") == Identity.of(wholes[0].meta, 2, "cfg")
    sliced = write_all(tmp_path / "s", slots)
    assert newest(tmp_path / "s", Identity.of(wholes[1].meta, 2, "cfg"))[0] == sliced
    whole = write_all(tmp_path / "w", wholes)
    assert json.loads((whole / "manifest.json").read_text())["format"] == 3
    manifest = json.loads((sliced / "manifest.json").read_text())
    (sliced / "manifest.json").write_text(json.dumps({**manifest, "format": 4}))
    assert verify(sliced) == "manifest.json has format 4, this DeadPool reads 1, 2 and 3"
