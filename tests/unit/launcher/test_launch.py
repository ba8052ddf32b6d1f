"""Tests for deadpool/launcher/launch.py: how many GPUs a node's processes share out (this machine has none), and
what the console is told at the end."""

from dataclasses import replace

import pytest
import torch

from deadpool.config import JobConfig
from deadpool.errors import ConfigError
from deadpool.launcher.launch import closing_lines, count_gpus, launch

CONFIG = JobConfig(script="train.py", workers=2, spares=1, run_dir="runs/x")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="these check a machine without GPUs")


def test_no_gpu_here_means_the_cpu():
    assert count_gpus(CONFIG) == 0 and count_gpus(replace(CONFIG, backend="gloo", gpus_per_node=4)) == 0


def test_torch_is_asked_only_where_a_gpu_driver_is(tmp_path, monkeypatch):
    """No driver's device node: no GPU, and torch is not consulted (a CPU job's launcher and agents never
    import it). With one, torch's count is the answer."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert count_gpus(CONFIG) == 0
    (tmp_path / "nvidiactl").touch()
    monkeypatch.setattr("deadpool.launcher.launch.GPU_DRIVERS", (str(tmp_path / "nvidiactl"),))
    assert count_gpus(CONFIG) == 2 and count_gpus(replace(CONFIG, gpus_per_node=1)) == 1


def test_asking_for_gpus_that_are_not_there_is_refused():
    with pytest.raises(ConfigError, match="--gpus-per-node 2, but 0 GPUs are visible here"):
        count_gpus(replace(CONFIG, gpus_per_node=2))
    with pytest.raises(ConfigError, match="--backend nccl needs GPUs.*--backend gloo"):
        count_gpus(replace(CONFIG, backend="nccl"))


def test_launch_refuses_before_starting_anything(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    config = replace(CONFIG, script=str(script), run_dir=str(tmp_path / "run"), backend="nccl")
    with pytest.raises(ConfigError, match="needs GPUs"):
        launch(config, echo=None)
    assert not (tmp_path / "run" / "logs").exists()


def test_the_end_says_which_faults_never_fired_and_how_many_checkpoints_were_not_written():
    summary = {"faults_not_fired": ["fault kill:1:9 never fired"], "persist_failures": [
        {"step": 3, "reason": "w1: OSError: no space left"}, {"step": 6, "reason": "parts of some ranks are missing"}]}
    assert closing_lines(summary) == [
        "fault kill:1:9 never fired",
        "2 checkpoint(s) not written (the last, step 6: parts of some ranks are missing): see persist_failures in "
        "summary.json"]
    assert closing_lines({"faults_not_fired": [], "persist_failures": []}) == []
