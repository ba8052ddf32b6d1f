"""Tests for deadpool/bench/cpu.py: the job's CPU time from /proc, with real processes that burn a known
amount of it (their own process_time says how much), and the window arithmetic the overhead bench uses."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from deadpool.bench.cells import VARIANTS
from deadpool.bench.cpu import JobCpu, tree_cpu_s
from deadpool.bench.overhead import measure, summarize
from deadpool.bench.overhead_table import table

BURN = "import time\nwhile time.process_time() < {s}: pass\n"  # a process that spends `s` CPU seconds, then exits


def test_a_grandchild_that_burned_cpu_and_was_reaped_still_counts():
    """The bench's descendants (the launcher's workers, torchrun's agent and its workers) are counted alive
    and after they exit: a child's time moves into its parent's once it is reaped, so the sum never drops."""
    with JobCpu(every_s=0.05) as cpu:
        start = time.monotonic()
        inner = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {BURN.format(s=0.6)!r}], check=True)"
        subprocess.run([sys.executable, "-c", inner], check=True, timeout=60)
        end = time.monotonic()
    spent = cpu.between(start, end)
    assert spent is not None and spent >= 0.6  # the grandchild's 0.6 s, plus two interpreters' start-up
    assert spent < 0.6 + 2.0  # and not counted twice (alive, then in its parent's children's time)
    assert all(b[1] >= a[1] for a, b in zip(cpu.samples, cpu.samples[1:]))


def test_the_tree_holds_a_running_child():
    child = subprocess.Popen([sys.executable, "-c", BURN.format(s=30)])
    try:
        before = tree_cpu_s(child.pid)
        deadline = time.monotonic() + 30
        while tree_cpu_s(child.pid) < before + 0.3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_s(child.pid) >= before + 0.3
    finally:
        child.kill()
        child.wait(10)


def sampled(points: list[tuple[float, float]]) -> JobCpu:
    cpu = JobCpu()
    cpu.samples = points
    return cpu


def test_cpu_between_two_moments_is_interpolated_and_none_outside_the_samples():
    cpu = sampled([(10.0, 1.0), (11.0, 3.0), (12.0, 3.5)])
    assert cpu.between(10.5, 11.5) == pytest.approx(3.25 - 2.0)
    assert cpu.between(10.0, 12.0) == pytest.approx(2.5)
    assert cpu.between(9.0, 11.0) is None and cpu.between(11.0, 12.5) is None


def test_a_run_reports_job_and_training_thread_cpu_per_measured_step():
    """Steps 3..4 are measured (warm-up 2): the window runs from step 2's earliest end to step 4's latest."""
    events = [{"event": "step", "rank": rank, "step": s, "t": float(s) + 0.1 * rank, "dur_s": 1.0,
               "thread_cpu_s": 0.5 * s + rank} for rank in (0, 1) for s in range(1, 5)]
    cpu = sampled([(0.0, 0.0), (10.0, 10.0)])  # one CPU second per second
    m = measure(events, warmup=2, cpu=cpu)
    assert m["job_cpu_s"] == pytest.approx((4.1 - 2.0) / 2)
    assert m["train_cpu_s"] == pytest.approx(0.5)
    assert m["beside_cpu_s"] == pytest.approx((4.1 - 2.0) / 2 - 2 * 0.5)  # both ranks' training threads
    unsampled = measure(events, warmup=2)
    assert unsampled["job_cpu_s"] is None and unsampled["beside_cpu_s"] is None


def run(step_s: float, job_cpu_s: float | None, train_cpu_s: float | None) -> dict:
    beside = None if job_cpu_s is None or train_cpu_s is None else job_cpu_s - 2 * train_cpu_s  # 2 ranks
    return {"step_s": step_s, "wait_fraction": 0.0, "chosen_every": None, "saves_after_window": 0,
            "snapshots_in_window": 1, "job_cpu_s": job_cpu_s, "train_cpu_s": train_cpu_s, "beside_cpu_s": beside}


def test_rows_give_cpu_medians_and_ratios_to_the_baseline_and_the_table_prints_them():
    variants = [VARIANTS["deadpool-off"], VARIANTS["deadpool-every-1"]]
    rounds = {"deadpool-off": [run(1.0, 1.0, 0.4), run(1.0, 1.2, 0.4), run(1.0, 1.1, 0.4)],
              "deadpool-every-1": [run(1.1, 1.21, 0.42)] * 3}
    rows = {r["variant"]: r for r in summarize(variants, rounds, ckpt_every=5)}
    every = rows["deadpool-every-1"]
    assert every["median_job_cpu_s"] == pytest.approx(1.21) and every["job_cpu_ratio"] == pytest.approx(1.1)
    assert every["train_cpu_ratio"] == pytest.approx(1.05)
    assert every["median_beside_cpu_s"] == pytest.approx(1.21 - 0.84) and every["beside_cpu_ratio"] == \
        pytest.approx((1.21 - 0.84) / (1.1 - 0.8))
    text = table([{"size": "3M", "params": 1, "batch_size": 8, "ranks": 4, "steps": 20, "warmup_steps": 10, **r}
                  for r in rows.values()])
    assert "1210 ms x1.100" in text and "420 ms x1.050" in text and "370 ms x1.233" in text
    rounds["deadpool-off"][1] = run(1.0, None, None)  # one round not sampled: no median rather than a skewed one
    row = summarize(variants, rounds, ckpt_every=5)[1]
    assert row["median_job_cpu_s"] == pytest.approx(1.21) and row["job_cpu_ratio"] is None
