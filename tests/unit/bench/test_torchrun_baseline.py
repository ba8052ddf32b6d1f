"""The torchrun + DCP baseline of `deadpool bench recovery`: a worker SIGKILLed mid-step is recovered by
torchrun's restart from the last DCP checkpoint, and the replay is bit-identical to a run without failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from deadpool.bench.baselines.run_torchrun import run_torchrun_dcp

pytestmark = pytest.mark.timeout(240)

TINY = ("--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--batch-size", "2")
WORKERS, STEPS, EVERY = 2, 8, 3


def _last_losses(events: list[dict]) -> dict[tuple[int, int], float]:
    """(rank, step) -> loss of that step's last execution (a replayed step overrides the lost one)."""
    return {(e["rank"], e["step"]): e["loss"] for e in events if e["event"] == "step"}


def _hashes(events: list[dict]) -> dict[int, str]:
    return {e["rank"]: e["state_sha256"] for e in events if e["event"] == "finished"}


def _log(out: Path) -> str:
    return (out / "torchrun.log").read_text()[-4000:]


def test_killed_worker_is_restarted_from_checkpoint_and_replays_identically(tmp_path: Path) -> None:
    code, clean = run_torchrun_dcp(tmp_path / "clean", workers=WORKERS, steps=STEPS, ckpt_every=EVERY, kill=None,
                                   script_args=TINY, timeout_s=100)
    assert code == 0, _log(tmp_path / "clean")
    assert {e["attempt"] for e in clean} == {0}
    assert not [e for e in clean if e["event"] == "resumed"]
    assert sorted(e["step"] for e in clean if e["event"] == "checkpoint") == [3, 3, 6, 6]
    assert len(_hashes(clean)) == WORKERS

    code, faulty = run_torchrun_dcp(tmp_path / "faulty", workers=WORKERS, steps=STEPS, ckpt_every=EVERY,
                                    kill=(1, 5), script_args=TINY, timeout_s=100)
    assert code == 0, _log(tmp_path / "faulty")
    fault = [e for e in faulty if e["event"] == "fault_injected"]
    assert [(e["target_rank"], e["step"], e["attempt"]) for e in fault] == [(1, 5, 0)]
    # step 5 never completed on the killed rank in the first attempt
    assert not [e for e in faulty if e["event"] == "step" and e["rank"] == 1 and e["step"] == 5 and e["attempt"] == 0]
    starts = sorted((e["attempt"], e["rank"]) for e in faulty if e["event"] == "process_start")
    assert starts == [(0, 0), (0, 1), (1, 0), (1, 1)]  # exactly one restart, of all ranks
    resumed = [e for e in faulty if e["event"] == "resumed"]
    assert sorted((e["rank"], e["from_step"], e["attempt"]) for e in resumed) == [(0, 3, 1), (1, 3, 1)]
    replayed = sorted({e["step"] for e in faulty if e["event"] == "step" and e["attempt"] == 1})
    assert replayed == list(range(4, STEPS + 1))

    assert _hashes(faulty) == _hashes(clean)
    assert _last_losses(faulty) == _last_losses(clean)
    assert len(_last_losses(clean)) == WORKERS * STEPS
