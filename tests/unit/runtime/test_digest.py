"""Tests for deadpool/runtime/digest.py: the copy and its hash in one pass, the lead fingerprint, int64 values."""

import zlib

import pytest
import torch
import xxhash

from deadpool.runtime import digest as digest_module
from deadpool.runtime.digest import Crc32, Digest, copy_hashed, int64, new_hasher
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


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(digest_module, "CHUNK", 256)  # many chunks, and chunks that straddle tensors


def test_one_pass_equals_the_hash_of_the_whole_bytes(small_chunks):
    tensors, lead = rank_state(private=1)
    layout, sources = layout_sources(tensors, lead)
    buffer = torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8)  # padding outside the lead: as it is
    fingerprint, whole = copy(sources, buffer, layout).finish(b"{}")
    raw = buffer.numpy().tobytes()
    assert whole == int64(xxhash.xxh3_64_intdigest(raw + b"{}")) == checksum(b"{}", buffer)
    assert fingerprint == int64(xxhash.xxh3_64_intdigest(raw[:layout.lead_nbytes]))
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
    assert digest.finish(b"x") == (int64(xxhash.xxh3_64_intdigest(data[:300])),
                                   int64(xxhash.xxh3_64_intdigest(data.tobytes() + b"x")))


def test_crc32_fallback_streams_like_zlib():
    data = memoryview(bytes(range(200)))
    digest = Digest(lead_nbytes=50, hasher=Crc32())
    digest.update(data)
    assert digest.finish(b"m") == (zlib.crc32(data[:50]), zlib.crc32(b"m", zlib.crc32(data)))


def test_the_hasher_is_xxh3_when_installed_and_crc32_without(monkeypatch):
    assert isinstance(new_hasher(), type(xxhash.xxh3_64()))
    monkeypatch.setattr(digest_module, "xxhash", None)
    assert isinstance(new_hasher(), Crc32) and digest_module.hash_name() == "crc32"


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (run by scripts/gpu_check.sh)")
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
