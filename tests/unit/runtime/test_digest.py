"""Tests for deadpool/runtime/digest.py: the blocked hash, the copy and its hash in one pass, the lead
fingerprint, int64 values."""

import random
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import xxhash

from deadpool.runtime import digest as digest_module
from deadpool.runtime.digest import BLOCK, Blocked, Crc32, Digest, Xxh3, copy_hashed, hasher_named, int64, new_hasher
from deadpool.runtime.pieces import sources
from deadpool.runtime.slices import held
from deadpool.runtime.slots import Slot, checksum
from deadpool.runtime.state import Layout


def layout_sources(tensors, lead):
    layout = Layout.of(tensors, lead=lead)
    return layout, sources(tensors, layout, None)


def copy(sources, buffer, layout, **options):
    """A whole snapshot's copy: every byte of the slot held, the lead region's hash read off."""
    ranges = held(layout.lead_nbytes, layout.nbytes, None)
    return copy_hashed(sources, buffer, ranges, layout.lead_nbytes, **options)


def rank_state(private: int):
    """Two stable tensors (parameters: equal on every data-parallel rank) and one private one."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(1000, generator=g), torch.randn(37, generator=g)]  # 37 floats: padded to 192 bytes
    return [params[0], torch.full((5,), float(private)), params[1]], [True, False, True]


def blocked(data: bytes, block: int = BLOCK) -> int:
    """The blocked hash written out: xxh3_64 of the little-endian xxh3_64 of each block (the last one short)."""
    inner = [xxhash.xxh3_64_intdigest(data[i: i + block]) for i in range(0, len(data), block)]
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(inner)}Q", *inner))


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(digest_module, "CHUNK", 256)  # many chunks, and chunks that straddle tensors
    monkeypatch.setattr(digest_module, "BLOCK", 96)  # blocks that straddle chunks and tensors


@pytest.mark.parametrize("threads", [1, 3])
def test_the_blocked_hash_is_the_same_however_the_stream_is_cut_and_on_however_many_threads(monkeypatch, threads):
    monkeypatch.setattr(digest_module, "BLOCK", 64)
    data = random.Random(threads).randbytes(64 * 40 + 17)
    cuts = sorted(random.Random(1).sample(range(1, len(data)), 25)) + [len(data)]
    with ThreadPoolExecutor(threads) as pool:
        hasher = Blocked(pool if threads > 1 else None, threads)
        start = 0
        for end in cuts:
            hasher.update(memoryview(data)[start:end])
            start = end
        assert hasher.intdigest() == blocked(data, 64)


def test_a_mark_keeps_the_digest_of_the_stream_so_far(monkeypatch):
    monkeypatch.setattr(digest_module, "BLOCK", 64)
    data = bytes(range(200)) * 3
    hasher = Blocked()
    hasher.update(data[:150])
    so_far = hasher.mark()
    hasher.update(data[150:])
    assert (so_far(), hasher.intdigest()) == (blocked(data[:150], 64), blocked(data, 64))


def test_hash_threads_are_a_quarter_of_the_cores_and_none_on_a_small_machine(monkeypatch):
    make = digest_module.hash_pool.__wrapped__  # the process's pool is made once: call the function itself
    for cores, threads in ((2, None), (7, None), (8, 2), (16, 4), (128, 8)):
        monkeypatch.setattr(digest_module.os, "sched_getaffinity", lambda _, n=cores: set(range(n)))
        made = make()
        assert (None if made is None else made[1]) == threads
        if made is not None:
            made[0].shutdown()


def test_a_checkpoint_may_name_the_plain_xxh3_of_before_and_an_unknown_hash_is_refused():
    plain = hasher_named("xxh3_64")
    plain.update(b"abc")
    assert isinstance(plain, Xxh3) and plain.intdigest() == xxhash.xxh3_64_intdigest(b"abc")
    assert isinstance(hasher_named(digest_module.hash_name()), Blocked)
    with pytest.raises(ValueError, match="'sha7' is unknown to this DeadPool"):
        hasher_named("sha7")


def test_one_pass_equals_the_hash_of_the_whole_bytes(small_chunks):
    tensors, lead = rank_state(private=1)
    layout, sources = layout_sources(tensors, lead)
    buffer = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8)  # padding outside the lead: as it is
    fingerprint, whole = copy(sources, buffer, layout).finish(b"{}")
    raw = buffer.numpy().tobytes()
    assert whole == int64(blocked(raw + b"{}", 96)) == checksum(b"{}", buffer)
    assert fingerprint == int64(blocked(raw[:layout.lead_nbytes], 96))
    for tensor, (_, _, offset, n) in zip(tensors, layout.specs):
        assert buffer[offset: offset + n].numpy().tobytes() == tensor.numpy().tobytes()


def test_fingerprint_is_equal_for_equal_lead_regions_whatever_the_buffers_held(small_chunks):
    """Each rank's slot starts with other garbage and holds other private state: the lead region's hash
    (its tensors and its zeroed padding) is equal, the whole checksum is not."""
    results = []
    for rank in (0, 1):
        tensors, lead = rank_state(private=rank)
        layout, sources = layout_sources(tensors, lead)
        buffer = torch.full((layout.nbytes,), 7 * rank + 1, dtype=torch.uint8)
        results.append(copy(sources, buffer, layout).finish(b"m"))
    (fp0, whole0), (fp1, whole1) = results
    assert fp0 == fp1 and whole0 != whole1


def test_a_changed_lead_byte_changes_the_fingerprint():
    tensors, lead = rank_state(private=0)
    layout, sources = layout_sources(tensors, lead)
    fp = copy(sources, torch.empty(layout.nbytes, dtype=torch.uint8), layout).finish(b"")[0]
    tensors[0][3] += 1
    assert copy(sources, torch.empty(layout.nbytes, dtype=torch.uint8), layout).finish(b"")[0] != fp


def test_corruption_after_sealing_is_detected():
    tensors, lead = rank_state(private=0)
    layout, sources = layout_sources(tensors, lead)
    slot = Slot()
    _, whole = copy(sources, slot.reserve(layout.nbytes), layout).finish(b"{}")
    slot.seal(3, b"{}", whole)
    assert slot.intact()
    slot.buffer[layout.nbytes // 2] ^= 0xFF
    assert not slot.intact() and not slot.usable()


def test_the_lead_region_may_end_inside_a_piece():
    data = memoryview(bytes(range(256)) * 4)
    digest = Digest(lead_nbytes=300)
    digest.update(data[:100])
    digest.update(data[100:])
    assert digest.finish(b"x") == (int64(blocked(data[:300].tobytes())), int64(blocked(data.tobytes() + b"x")))


def test_crc32_of_older_checkpoints_streams_like_zlib():
    data = memoryview(bytes(range(200)))
    digest = Digest(lead_nbytes=50, hasher=Crc32())
    digest.update(data)
    assert digest.finish(b"m") == (zlib.crc32(data[:50]), zlib.crc32(b"m", zlib.crc32(data)))


def test_the_hasher_is_blocked_xxh3_and_older_checkpoints_hashes_are_still_known():
    assert isinstance(new_hasher(), Blocked) and digest_module.hash_name() == "xxh3_64/1MiB"
    assert [type(hasher_named(name)) for name in ("xxh3_64/1MiB", "xxh3_64", "crc32")] == [Blocked, Xxh3, Crc32]
    with pytest.raises(ValueError, match="hash 'md5' is unknown"):
        hasher_named("md5")


def test_hashes_fit_an_int64_field_with_their_bits():
    for value in (0, 2**63 - 1, 2**63, 2**64 - 1):
        signed = int64(value)
        assert -2**63 <= signed < 2**63 and signed % 2**64 == value
        assert torch.tensor([signed], dtype=torch.int64).item() == signed


def test_midway_and_settle_run_once_in_order():
    tensors, lead = rank_state(private=0)
    layout, sources = layout_sources(tensors, lead)
    calls = []
    copy(sources, torch.empty(layout.nbytes, dtype=torch.uint8), layout,
         midway=lambda: calls.append("midway"), settle=lambda: calls.append("settle"))
    assert calls == ["midway", "settle"]


def many_small():
    """A model's shape in miniature: many small tensors, scalars (an optimizer's step), odd sizes that leave
    padding, a few bigger than the test's CHUNK, and private tensors after the stable ones."""
    g = torch.Generator().manual_seed(1)
    sizes = [None, 3, 16, 37, 300, 1, None, 129] * 5
    tensors = [torch.randn((), generator=g) if n is None else torch.randn(n, generator=g) for n in sizes]
    return tensors, [i < 32 for i in range(len(tensors))]


def test_many_small_tensors_land_in_runs_with_their_padding_zeroed_and_hash_as_their_bytes(small_chunks):
    tensors, lead = many_small()
    layout, sources = layout_sources(tensors, lead)
    runs = list(digest_module._runs(sorted(sources, key=lambda source: source[1])))
    assert all(sum(p.numel() for p in parts) == end - start for start, end, parts, _ in runs)  # cat's exact out
    assert [middle for *_, middle in runs].count(True) == 1 and max(len(parts) for _, _, parts, _ in runs) >= 4
    buffer = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)  # garbage where padding will be
    fingerprint, whole = copy(sources, buffer, layout).finish(b"{}")
    raw = buffer.numpy().tobytes()
    for tensor, (_, _, offset, n) in zip(tensors, layout.specs):
        assert raw[offset: offset + n] == tensor.numpy().tobytes()
        assert raw[offset + n: offset + -(-n // 64) * 64] == bytes(-(-n // 64) * 64 - n)
    assert whole == int64(blocked(raw + b"{}", 96)) and fingerprint == int64(blocked(raw[:layout.lead_nbytes], 96))


def test_midway_runs_once_the_sources_before_the_middle_one_are_in(small_chunks):
    """The snapshot_copy fault point: a process killed there leaves a slot half written."""
    tensors, lead = many_small()
    layout, sources = layout_sources(tensors, lead)
    ordered = sorted(sources, key=lambda source: source[1])
    buffer = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    seen = []

    def midway() -> None:
        seen.append([bytes(buffer[offset: offset + source.numel()].numpy()) == bytes(source.numpy())
                     for source, offset, _ in ordered])

    copy(sources, buffer, layout, midway=midway)
    mid = len(ordered) // 2
    assert seen == [[True] * mid + [False] * (len(ordered) - mid)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (scripts/gpu_check.sh runs it)")
def test_from_a_gpu_each_piece_is_hashed_once_landed_and_settle_follows_the_last_copy(monkeypatch):
    monkeypatch.setattr(digest_module, "DEVICE_CHUNK", 1000)  # pieces that straddle tensors and padding
    tensors, lead = rank_state(private=0)
    layout, on_cpu = layout_sources(tensors, lead)
    _, on_gpu = layout_sources([t.cuda() for t in tensors], lead)
    gpu_slot, cpu_slot = torch.zeros(layout.nbytes, dtype=torch.uint8).pin_memory(), torch.zeros(layout.nbytes,
                                                                                                 dtype=torch.uint8)
    side, seen = torch.cuda.Stream(), []
    with torch.cuda.stream(side):
        got = copy(on_gpu, gpu_slot, layout, device=True, settle=lambda: seen.append(gpu_slot.clone()))
    assert got.finish(b"") == copy(on_cpu, cpu_slot, layout).finish(b"")
    assert torch.equal(gpu_slot, cpu_slot) and torch.equal(seen[0], cpu_slot)  # settled once all had landed
