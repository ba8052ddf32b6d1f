"""`deadpool bench overhead`'s own logic (not timings): step times from events, rows, presets, arguments,
the plot; and the DCP baseline's --async-save, in one short real torchrun run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deadpool.bench.baselines.run_torchrun import run_torchrun_dcp
from deadpool.bench.cells import VARIANTS
from deadpool.bench.overhead import measure, run_steps, summarize
from deadpool.bench.overhead_table import table
from deadpool.bench.plots import plot_overhead
from deadpool.errors import ConfigError


def step(rank: int, step: int, t: float, **fields: float) -> dict:
    return {"event": "step", "rank": rank, "step": step, "t": t, "dur_s": 1.0, **fields}


def checkpoint(rank: int, step: int, t: float, save_s: float) -> dict:
    return {"event": "checkpoint", "rank": rank, "step": step, "t": t, "save_s": save_s}


def dcp_events() -> list[dict]:
    """2 ranks, 9 steps of 1 s each; steps 1-3 are slow (warm-up); a 0.5 s save after step 6 on each rank."""
    events = []
    for rank in (0, 1):
        t = 0.0
        for s in range(1, 10):
            t += 10.0 if s <= 3 else 1.0
            events.append(step(rank, s, t))
            if s == 6:
                t += 0.5
                events.append(checkpoint(rank, s, t, save_s=0.5))
    return events


def test_dcp_step_time_runs_from_step_end_to_step_end_and_includes_the_save():
    m = measure(dcp_events(), warmup=3)
    # steps 4..9 per rank; step 4's interval starts at step 3's end; step 7's holds the save
    assert m["intervals"] == [1.0, 1.0, 1.0, 1.5, 1.0, 1.0] * 2
    assert m["step_s"] == pytest.approx(6.5 / 6)
    assert m["wait_fraction"] == pytest.approx(0.5 / 6.5)
    assert m["chosen_every"] is None and m["saves_after_window"] == 0


def test_warm_up_steps_are_not_measured():
    assert max(measure(dcp_events(), warmup=3)["intervals"]) < 10.0
    assert max(measure(dcp_events(), warmup=2)["intervals"]) == 10.0  # step 3 is in, and it was slow


def test_deadpool_wait_counts_as_blocked_and_auto_reports_its_interval():
    events = [step(0, s, float(s), wait_s=0.25) for s in range(1, 8)]
    events.append({"event": "snapshot_interval", "rank": 0, "t": 5.0, "every": 9})
    m = measure(events, warmup=5)
    assert m["intervals"] == [1.0, 1.0]
    assert (m["wait_fraction"], m["chosen_every"]) == (0.25, 9)


def test_snapshots_in_the_window_are_those_whose_cost_falls_in_it():
    """Steps 6 and 7 are measured: the snapshots of steps 5 and 6 run during them; step 7's, after the end."""
    events = [step(0, s, float(s)) for s in range(1, 8)]
    events += [{"event": "snapshot", "rank": 0, "step": s, "t": s + 0.1, "bytes": 8, "holders": ["s0"], "total_s": 0.5}
               for s in (4, 5, 6, 7)]
    assert measure(events, warmup=5)["snapshots_in_window"] == 2
    assert measure(events, warmup=5)["snapshot_cpu_s"] is None  # events of a version that did not time it
    assert measure([e for e in events if e.get("step") not in (5, 6) or e["event"] == "step"],
                   warmup=5)["snapshots_in_window"] == 0


def test_an_auto_row_whose_window_missed_every_snapshot_says_so_with_an_estimate():
    variants = [VARIANTS[n] for n in ("deadpool-off", "deadpool-every-1", "deadpool-auto")]
    rounds = {"deadpool-off": [run(1.0)], "deadpool-every-1": [run(1.2, snapshots=5)],
              "deadpool-auto": [run(1.0, chosen_every=40, snapshots=0)]}
    rows = [{"size": "1M", "params": 1, "batch_size": 8, "ranks": 2, "steps": 15, "warmup_steps": 10, **row}
            for row in summarize(variants, rounds, ckpt_every=5)]
    text = table(rows)
    assert "the 5 measured steps held 0: this figure leaves its cost out" in text
    assert "every-1's extra time / 40 = 0.50% of a step" in text  # 0.2 s / 40 / 1.0 s
    rounds["deadpool-auto"] = [run(1.0, chosen_every=4, snapshots=1)]
    assert "note" not in table([dict(rows[0], **row) for row in summarize(variants, rounds, ckpt_every=5)])


def test_an_async_save_written_after_the_last_step_is_reported():
    events = [step(0, s, float(s)) for s in range(1, 9)]
    events += [{"event": "checkpoint_written", "rank": 0, "step": 6, "t": 8.5},  # in the window, written after it
               {"event": "checkpoint_written", "rank": 0, "step": 8, "t": 9.0}]  # after the last step: not measured
    assert measure(events, warmup=2)["saves_after_window"] == 1


def test_a_run_without_steps_after_warm_up_is_an_error():
    with pytest.raises(ValueError):
        measure([step(0, s, float(s)) for s in range(1, 6)], warmup=5)


def run(step_s: float, wait_fraction: float = 0.0, chosen_every: int | None = None, snapshots: int = 0) -> dict:
    return {"step_s": step_s, "wait_fraction": wait_fraction, "chosen_every": chosen_every, "saves_after_window": 0,
            "snapshots_in_window": snapshots}


def test_summary_ratios_against_each_systems_own_baseline_with_spread():
    variants = list(VARIANTS.values())
    rounds = {"deadpool-off": [run(1.0), run(2.0), run(1.5)],
              "deadpool-every-1": [run(3.0, 0.1)] * 3,
              "deadpool-every-1-whole": [run(4.5, 0.1)] * 3,
              "deadpool-every-5": [run(1.8, 0.0)] * 3,
              "deadpool-auto": [run(1.5, 0.0, 7), run(1.5, 0.0, 8), run(1.5, 0.0, 7)],
              "dcp-off": [run(2.0)] * 3,
              "dcp-sync": [run(3.0, 0.2), run(2.5, 0.1), run(4.0, 0.3)],
              "dcp-async": [run(2.2)] * 3}
    rows = {r["variant"]: r for r in summarize(variants, rounds, ckpt_every=5)}
    assert list(rows) == list(VARIANTS)
    off = rows["deadpool-off"]
    assert (off["median_step_s"], off["ratio"], off["min_step_s"], off["max_step_s"]) == (1.5, 1.0, 1.0, 2.0)
    assert (rows["deadpool-every-1"]["ratio"], rows["deadpool-every-1"]["baseline"]) == (2.0, "deadpool-off")
    assert rows["deadpool-every-1-whole"]["ratio"] == 3.0
    assert rows["deadpool-every-5"]["ratio"] == pytest.approx(1.2)
    assert rows["deadpool-auto"]["chosen_every"] == [7, 8, 7]
    sync = rows["dcp-sync"]
    assert (sync["median_step_s"], sync["ratio"], sync["baseline"]) == (3.0, 1.5, "dcp-off")
    assert sync["system"] == "torchrun-dcp"
    assert (sync["min_step_s"], sync["max_step_s"], sync["wait_fraction"], sync["rounds"]) == (2.5, 4.0, 0.2, 3)
    assert rows["dcp-async"]["ratio"] == pytest.approx(1.1)
    assert (rows["dcp-async"]["snapshot_every"], rows["dcp-async"]["save"]) == (None, "async")
    assert (rows["dcp-async"]["ckpt_every"], rows["dcp-off"]["ckpt_every"]) == (5, None)
    assert (rows["deadpool-every-1"]["snapshot_every"], rows["deadpool-every-1"]["save"]) == (1, None)


def test_rounds_are_also_compared_pair_by_pair_and_deadpools_ddp_against_torchs():
    """A machine that drifts between rounds moves both runs of a round alike: each round's ratio cancels it,
    where the ratio of medians mixes rounds."""
    variants = [VARIANTS[n] for n in ("deadpool-off", "deadpool-every-1", "dcp-off")]
    rounds = {"deadpool-off": [run(1.0), run(2.0), run(1.5)],
              "deadpool-every-1": [run(1.1), run(2.2), run(1.5)],
              "dcp-off": [run(1.25), run(1.6), run(1.5)]}
    rows = {r["variant"]: r for r in summarize(variants, rounds, ckpt_every=5)}
    assert rows["deadpool-every-1"]["paired_ratios"] == pytest.approx([1.1, 1.1, 1.0])
    assert rows["deadpool-off"]["against_ddp"] == {"ratio": 1.0, "paired_ratios": pytest.approx([0.8, 1.25, 1.0])}
    assert "against_ddp" not in rows["dcp-off"]
    text = table([{"size": "1M", "params": 1, "batch_size": 8, "ranks": 2, "steps": 15, "warmup_steps": 10, **row}
                  for row in rows.values()])
    assert "per round, against deadpool-off in the same round: x1.100, x1.100, x1.000 (median x1.100" in text
    assert "against torch DDP (dcp-off): x1.000 (medians); per round x0.800, x1.250, x1.000 (median x1.000, " \
           "geometric mean x1.000)" in text


def test_warm_up_is_two_checkpoint_intervals_and_the_window_whole_intervals():
    assert run_steps(ckpt_every=5, steps=None, calibrating=False) == (10, 15)  # 2K
    assert run_steps(ckpt_every=5, steps=20, calibrating=False) == (10, 20)
    assert run_steps(ckpt_every=5, steps=None, calibrating=True) == (40, 45)  # auto's calibration ends at step 35
    assert run_steps(ckpt_every=5, steps=60, calibrating=True) == (40, 60)
    assert run_steps(ckpt_every=20, steps=60, calibrating=True) == (40, 60)  # 2K
    assert run_steps(ckpt_every=2, steps=None, calibrating=True) == (38, 40)
    for every, steps, calibrating in ((10, 25, False), (5, 10, False), (0, 15, False), (5, 20, True)):
        with pytest.raises(ConfigError):
            run_steps(ckpt_every=every, steps=steps, calibrating=calibrating)


def test_plot_has_a_panel_per_cell(tmp_path):
    pytest.importorskip("matplotlib")
    cells = {f"{s} x {n} ranks": {"dcp-off": [0.3, 0.31], "dcp-sync": [0.3, 0.6]}
             for s in ("1M", "10M") for n in (2, 4)}
    path = plot_overhead(tmp_path, cells, columns=2)
    assert path.name == "overhead.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- the DCP baseline's --async-save, for real ------------------------------------------------

TINY = ("--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "2")
WORKERS, STEPS, EVERY = 2, 6, 3


def restored_hash(directory: Path, rank: int) -> str:
    """state_sha256 of rank `rank`'s state loaded from checkpoint `directory` in this (non-distributed) process."""
    from deadpool.bench.baselines import torchrun_dcp as baseline
    from deadpool.bench.baselines.dcp_checkpoints import load_checkpoint, set_rng_state

    text = baseline.load_text(None)
    tokenizer = baseline.CharTokenizer(text)
    gpt = baseline.GPT(baseline.GPTConfig(vocab_size=tokenizer.vocab_size, block_size=64, n_layer=1, n_head=2,
                                          n_embd=32, dropout=0.1))
    optimizer = torch.optim.AdamW(gpt.parameters(), lr=1e-3, weight_decay=0.1)
    sampler = baseline.BatchSampler(num_tokens=len(text), block_size=64, batch_size=2, rank=rank,
                                    world_size=WORKERS, seed=1337)
    step, rng = load_checkpoint(directory, gpt, optimizer, sampler, rank, WORKERS)
    set_rng_state(rng)
    return baseline.state_sha256(gpt, optimizer, sampler, step)


@pytest.mark.timeout(120)
def test_async_save_writes_complete_checkpoints_renamed_only_once_written(tmp_path: Path) -> None:
    runs = {}
    for mode in ("sync", "async"):
        code, events = run_torchrun_dcp(tmp_path / mode, workers=WORKERS, steps=STEPS, ckpt_every=EVERY, kill=None,
                                        script_args=TINY, timeout_s=50, async_save=mode == "async", max_restarts=0)
        assert code == 0, (tmp_path / mode / "torchrun.log").read_text()[-4000:]
        runs[mode] = events
    events = runs["async"]
    assert sorted((e["rank"], e["step"], e["mode"]) for e in events if e["event"] == "checkpoint") == \
        [(r, s, "async") for r in range(WORKERS) for s in (3, 6)]
    assert sorted((e["rank"], e["step"], e["ok"]) for e in events if e["event"] == "checkpoint_written") == \
        [(r, s, True) for r in range(WORKERS) for s in (3, 6)]
    ckpt = tmp_path / "async" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-3", "step-6"]  # no .tmp-step-* left
    renames = [e for e in events if e["event"] == "checkpoint_renamed"]
    assert [(e["rank"], e["step"]) for e in renames] == [(0, 3), (0, 6)]
    for renamed in renames:
        files = list((ckpt / f"step-{renamed['step']}").iterdir())
        assert {".metadata", "rank0.pt", "rank1.pt"} <= {f.name for f in files}
        # every file was last written before rank 0 renamed the directory
        assert max(f.stat().st_mtime for f in files) <= renamed["wall"]
    # the training itself is the same as with synchronous saves, and so is every checkpoint's content
    final = {e["rank"]: e["state_sha256"] for e in events if e["event"] == "finished"}
    assert final == {e["rank"]: e["state_sha256"] for e in runs["sync"] if e["event"] == "finished"}
    for rank in range(WORKERS):
        assert restored_hash(ckpt / "step-6", rank) == final[rank]
        assert restored_hash(ckpt / "step-3", rank) == restored_hash(tmp_path / "sync" / "ckpt" / "step-3", rank)
