"""Tests for deadpool/disk finish.py and read.py: a checkpoint is visible only when complete and intact,
finalize is idempotent and crash-safe, and pruning keeps the newest K."""

import json
import shutil

from tests.unit.disk.snapshots import replicated_slots

from deadpool.disk import Identity, finalize, newest, read_rank, step_dir, tmp_dir, verify, write_part
from deadpool.disk.manifest import METADATA
from deadpool.runtime.slots import checksum


def write(root, step, slots, writers=("s0", "w1"), keep=5):
    ident = Identity.of(slots[0].meta, len(slots), "cfg")
    for rank, writer in enumerate(writers):
        write_part(root, step, writer, {rank: slots[rank]}, ident)
    return finalize(root, step, len(slots), ident, keep), ident


def test_a_tmp_dir_with_a_missing_part_is_not_picked_up(tmp_path):
    slots = replicated_slots(5)
    good, ident = write(tmp_path, 5, slots)
    later = replicated_slots(9)
    write_part(tmp_path, 9, "s0", {0: later[0]}, ident)
    assert finalize(tmp_path, 9, 2, ident, keep=5) is None
    assert tmp_dir(tmp_path, 9).exists() and not step_dir(tmp_path, 9).exists()
    assert newest(tmp_path)[0] == good


def test_damaged_checkpoints_are_skipped_for_older_ones_saying_why(tmp_path):
    """Newest first: one without its manifest, one with a flipped byte, one truncated mid-file; each is
    skipped (on_skip names the reason) until the intact one."""
    paths = [write(tmp_path, step, replicated_slots(step))[0] for step in (1, 2, 3, 4)]
    data = sorted(paths[1].rglob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # step 2: truncated
    flipped = sorted(paths[2].rglob("*.distcp"))[0]
    raw = bytearray(flipped.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    flipped.write_bytes(bytes(raw))  # step 3: one bit flipped, same size
    (paths[3] / "manifest.json").unlink()  # step 4: never finished writing its manifest
    skipped = []
    found, manifest = newest(tmp_path, on_skip=lambda path, reason: skipped.append((path.name, reason)))
    assert found == paths[0] and manifest["step"] == 1
    assert [name for name, _ in skipped] == [p.name for p in paths[3:0:-1]]
    assert "no manifest.json" in skipped[0][1]
    assert "does not match its xxh3_128 hash" in skipped[1][1] and flipped.name in skipped[1][1]
    assert "bytes" in skipped[2][1] and "truncated" in skipped[2][1]
    assert verify(paths[0]) is None and verify(paths[2]) == skipped[1][1]


def test_a_checkpoint_without_dcp_metadata_is_skipped(tmp_path):
    old, _ = write(tmp_path, 1, replicated_slots(1))
    new, _ = write(tmp_path, 2, replicated_slots(2))
    (new / METADATA).unlink()
    skipped = []
    assert newest(tmp_path, on_skip=lambda p, r: skipped.append(r))[0] == old
    assert skipped == [f"{METADATA} is missing"]


def test_a_checkpoint_that_does_not_fit_the_job_is_skipped(tmp_path):
    path, ident = write(tmp_path, 1, replicated_slots(1))
    other = Identity(ident.config_hash, ident.parallelism, 4, ident.shapes)
    skipped = []
    assert newest(tmp_path, other, on_skip=lambda p, r: skipped.append(r)) is None
    assert skipped == ["does not fit this job: world size 2 in the checkpoint, 4 now"]
    assert newest(tmp_path, ident)[0] == path


def test_finalize_again_is_idempotent_and_finishes_after_a_crash(tmp_path):
    slots = replicated_slots(6)
    path, ident = write(tmp_path, 6, slots)
    manifest = (path / "manifest.json").read_bytes()
    assert finalize(tmp_path, 6, 2, ident, keep=2) == path
    assert (path / "manifest.json").read_bytes() == manifest and verify(path) is None
    # a crash after the metadata and the manifest were written, before the rename: finalize again finishes
    shutil.copytree(path, tmp_dir(tmp_path, 8))
    for part in tmp_dir(tmp_path, 8).glob("part-*"):
        record = json.loads((part / "part.json").read_text())
        record["step"] = 8
        (part / "part.json").write_text(json.dumps(record))
    final = finalize(tmp_path, 8, 2, ident, keep=2)
    assert final == step_dir(tmp_path, 8) and verify(final) is None and not tmp_dir(tmp_path, 8).exists()
    assert json.loads((final / "manifest.json").read_text())["step"] == 8
    meta, buffer = read_rank(final, 1)
    assert checksum(meta, buffer) == slots[1].digest


def test_a_rank_written_by_two_writers_is_used_once(tmp_path):
    slots = replicated_slots(4)
    ident = Identity.of(slots[0].meta, 2, "cfg")
    write_part(tmp_path, 4, "a", {0: slots[0], 1: slots[1]}, ident)
    write_part(tmp_path, 4, "b", {1: slots[1]}, ident)  # a holder wrote rank 1 as well
    path = finalize(tmp_path, 4, 2, ident, keep=2)
    assert sorted(p.name for p in path.glob("part-*")) == ["part-a"] and verify(path) is None
    for rank in range(2):
        meta, buffer = read_rank(path, rank)
        assert checksum(meta, buffer) == slots[rank].digest


def test_keep_prunes_older_checkpoints_and_stale_tmp_dirs(tmp_path):
    ident = None
    for step in (1, 2, 3):
        _, ident = write(tmp_path, step, replicated_slots(step), keep=2)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step-0000000002", "step-0000000003"]
    write_part(tmp_path, 3, "late", {1: replicated_slots(3)[1]}, ident)  # step 3 is done: nothing written
    assert not tmp_dir(tmp_path, 3).exists()
    write_part(tmp_path, 4, "s0", {0: replicated_slots(4)[0]}, ident)  # never completed
    write(tmp_path, 5, replicated_slots(5), keep=2)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step-0000000003", "step-0000000005"]
