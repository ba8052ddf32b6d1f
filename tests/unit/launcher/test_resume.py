"""Tests for deadpool/launcher/resume.py: the command that goes on from a stopped job."""

import pytest

from deadpool.launcher.resume import resume_command


@pytest.mark.parametrize("argv, command", [
    (["run", "--workers", "4", "--persist-dir", "ck pt", "train.py", "--steps", "9"],
     "deadpool run --resume auto --workers 4 --persist-dir 'ck pt' train.py --steps 9"),
    (["run", "--resume", "/old/step-3", "--persist-dir", "ckpt", "train.py"],
     "deadpool run --resume auto --persist-dir ckpt train.py"),
    (["coordinator", "--resume=auto", "--nnodes", "2", "train.py"],
     "deadpool coordinator --resume auto --nnodes 2 train.py"),
])
def test_the_same_command_with_resume_auto_in_place_of_any_earlier_resume(argv, command):
    assert resume_command(argv) == command
