"""Tests for deadpool/bench/limits.py: the copy-limit bound (a pure formula), bytes per step from events,
and the bandwidth measurements (tiny sizes: their figures are not checked, only that they are made)."""

from __future__ import annotations

import pytest
import torch

from deadpool.bench.cells import VARIANTS
from deadpool.bench.cpu import JobCpu
from deadpool.bench.limits import Bandwidths, Traffic, copy_limit_s, loopback_rates, measure_bandwidths, traffic
from deadpool.bench.overhead import measure, summarize
from deadpool.bench.overhead_table import table

GB = 1e9
MACHINE = Bandwidths(memcpy=2 * GB, hash=4 * GB, crc32=1 * GB, copy_and_hash=1.5 * GB, loopback=3 * GB,
                     loopback_cpu=1 * GB, hash_name="xxh3_64", cores=2)


def test_the_bound_is_each_bytes_cpu_time_at_one_core_bandwidths_spread_over_the_cores():
    """A send is priced at the loopback stream's CPU rate (both ends), not its faster wall-clock rate."""
    moved = Traffic(copied=4e6, hashed=8e6, sent=4e6, hash_name="xxh3_64")
    # (4 MB / 2 GB/s + 8 MB / 4 GB/s + 4 MB / 1 GB per CPU-second) / 2 cores = (2 + 2 + 4) ms / 2
    assert copy_limit_s(moved, MACHINE) == pytest.approx(0.004)


def test_snapshots_checked_with_crc32_are_bounded_at_crc32_speed():
    moved = Traffic(copied=4e6, hashed=8e6, sent=4e6, hash_name="crc32")
    assert copy_limit_s(moved, MACHINE) == pytest.approx((0.002 + 0.008 + 0.004) / 2)


def snapshot(rank: int, step: int, nbytes: int, holders: list[str], **fields) -> dict:
    return {"event": "snapshot", "rank": rank, "step": step, "t": step + 0.1, "bytes": nbytes,
            "holders": holders, "total_s": 0.25, "cpu_s": 0.0045, **fields}


def test_bytes_per_step_count_every_rank_and_holder_in_the_window():
    """Steps 6..9 measured: the snapshots of steps 5..8 run during them (3 of 4 steps here)."""
    events = [snapshot(r, s, 100, ["s0", "s1"], hash="xxh3_64") for r in (0, 1) for s in (4, 5, 6, 8, 9)]
    moved = traffic(events, first_step=6, last_step=9)
    assert moved == Traffic(copied=2 * 3 * 100 / 4, hashed=(600 + 1200) / 4, sent=2 * 3 * 200 / 4,
                            hash_name="xxh3_64")
    assert traffic([snapshot(0, 6, 10, ["s0"])], 6, 9).hash_name == "crc32"  # events from before xxHash


def test_sliced_snapshots_count_what_they_hold_and_the_audit_they_hash():
    """Under slices a rank copies and sends its piece and own state (`held`), and hashes one other piece
    in place (`audited`, 0 on the rank that owns the audited piece)."""
    events = [snapshot(r, 5, 400, ["s0"], held=110, audited=0 if r == 0 else 100) for r in range(4)]
    assert traffic(events, first_step=6, last_step=6) == Traffic(copied=440, hashed=440 + 440 + 300, sent=440,
                                                                 hash_name="crc32")


def step(rank: int, step: int, t: float, **fields) -> dict:
    return {"event": "step", "rank": rank, "step": step, "t": t, "dur_s": 1.0, **fields}


def sampled(points: list[tuple[float, float]]) -> JobCpu:
    cpu = JobCpu()
    cpu.samples = points
    return cpu


def test_rows_state_bytes_bound_and_the_costs_as_multiples_of_it():
    """Snapshots off: 1.0 s a step, 0.3 s of CPU beside the training thread; every step: 1.1 s, 0.305 s beside
    it, 1 MB per step per rank sent to one holder."""
    off = [step(0, s, float(s), thread_cpu_s=0.5 * s) for s in range(1, 11)]
    every = [step(0, s, 1.1 * s, thread_cpu_s=0.5 * s) for s in range(1, 11)] + [
        snapshot(0, s, 10**6, ["s0"], hash="xxh3_64") for s in range(1, 11)]
    variants = [VARIANTS["deadpool-off"], VARIANTS["deadpool-every-1"]]
    job = {"deadpool-off": sampled([(0.0, 0.0), (20.0, 16.0)]),  # 0.8 CPU-s per second, 1 s a step
           "deadpool-every-1": sampled([(0.0, 0.0), (22.0, 22 * 0.805 / 1.1)])}  # 0.805 CPU-s per 1.1 s step
    rounds = {name: [measure(events, warmup=5, cpu=job[name])]
              for name, events in (("deadpool-off", off), ("deadpool-every-1", every))}
    rows = {r["variant"]: r for r in summarize(variants, rounds, ckpt_every=5, bandwidths=MACHINE)}
    assert rows["deadpool-off"]["copy_limit"] is None
    limit = rows["deadpool-every-1"]["copy_limit"]
    assert (limit["copied_bytes"], limit["hashed_bytes"], limit["sent_bytes"]) == (1e6, 2e6, 1e6)
    bound = (1e6 / (2 * GB) + 2e6 / (4 * GB) + 1e6 / GB) / 2
    assert limit["bound_s"] == pytest.approx(bound) and limit["cost_s"] == pytest.approx(0.1)
    assert limit["multiple"] == pytest.approx(0.1 / bound)
    assert limit["cpu_cost_s"] == pytest.approx(0.005) and limit["bound_cpu_s"] == pytest.approx(2 * bound)
    assert limit["cpu_multiple"] == pytest.approx(0.005 / (2 * bound))  # 2 cores: the bytes' CPU is twice it
    text = table([{"size": "1M", "params": 1, "batch_size": 8, "ranks": 1, "steps": 10, "warmup_steps": 5, **r}
                  for r in rows.values()])
    assert "1/2/1" in text and f"{bound * 1e3:.1f} ms" in text and f"{0.1 / bound:.1f}x" in text
    assert f"5/{2 * bound * 1e3:.0f} ms {0.005 / (2 * bound):.1f}x" in text
    assert limit["snapshot_busy_s"] == 0.25 and limit["snapshot_cpu_s"] == 0.0045 and "250 ms (4.5 ms)" in text


def test_a_cost_below_zero_is_called_noise_not_a_multiple():
    off = [step(0, s, 1.2 * s) for s in range(1, 11)]  # snapshots off ran slower: other load on the machine
    every = [step(0, s, 1.0 * s) for s in range(1, 11)] + [snapshot(0, s, 10**6, ["s0"]) for s in range(1, 11)]
    variants = [VARIANTS["deadpool-off"], VARIANTS["deadpool-every-1"]]
    rounds = {"deadpool-off": [measure(off, warmup=5)], "deadpool-every-1": [measure(every, warmup=5)]}
    rows = [{"size": "1M", "params": 1, "batch_size": 8, "ranks": 1, "steps": 10, "warmup_steps": 5, **r}
            for r in summarize(variants, rounds, ckpt_every=5, bandwidths=MACHINE)]
    assert rows[1]["copy_limit"]["multiple"] < 0 and " noise " in table(rows)


def test_loopback_moves_the_bytes_and_reports_both_rates():
    wall, cpu = loopback_rates(3 * 2**20 + 5)
    assert wall > 0 and cpu > 0


def test_bandwidths_are_measured_on_one_thread_and_the_thread_count_restored():
    threads = torch.get_num_threads()
    measured = measure_bandwidths(2**20)
    assert torch.get_num_threads() == threads
    assert min(measured.memcpy, measured.hash, measured.crc32, measured.copy_and_hash, measured.loopback,
               measured.loopback_cpu) > 0
    assert measured.hash_name == "xxh3_64/1MiB" and "xxh3_64/1MiB" in measured.line()
