"""What a training script may count on, and the mistakes of a first port named as the script's, with real
processes: the smallest jobs of tests/integration/scripts/tiny.py (one or two workers, one spare)."""

from __future__ import annotations

from deadpool.config import Fault

from .conftest import SCRIPTS, Job, run_job

TINY = SCRIPTS / "tiny.py"


def tiny(run_dir, *args: str, steps: int = 6, workers: int = 1, **job) -> Job:
    return run_job(run_dir, steps=steps, workers=workers, spares=1, script=TINY, script_args=args, **job)


def test_an_unseeded_script_drawing_its_data_in_set_up_is_bit_for_bit_after_a_swap(tmp_path):
    """init() seeds torch with --seed plus the rank, a spare once it knows its rank: the spare that takes
    rank 0 draws the same data (torch.randn, before run) as the worker it replaced."""
    reference = tiny(tmp_path / "reference")
    swapped = tiny(tmp_path / "swapped", faults=(Fault(kind="kill", rank=0, step=3, phase="backward"),))
    assert reference.code == swapped.code == 0 and swapped.summary["swaps"] == 1
    assert swapped.summary["final_state_sha256"] == reference.summary["final_state_sha256"]
    assert swapped.summary["losses"] == reference.summary["losses"]
