"""Tests for deadpool/launcher/agent.py: the environment each training process starts with, and its output."""

import io
import threading
import time
from dataclasses import replace
from pathlib import Path

from deadpool.config import JobConfig
from deadpool.launcher.agent import Agent, process_env

CONFIG = JobConfig(script="train.py", workers=2, spares=2, run_dir="runs/x", seed=7)


def env_of(config: JobConfig, name: str, role: str, rank: int, inherited: dict | None = None) -> dict[str, str]:
    return process_env(config, Path("runs/x/config.json"), name, role, rank, inherited or {})


def test_identity_is_deadpools_and_torchruns():
    env = env_of(CONFIG, "w1", "worker", 1)
    proc = (env["DEADPOOL_PROC"], env["DEADPOOL_ROLE"], env["DEADPOOL_CONFIG"])
    assert proc == ("w1", "worker", "runs/x/config.json")
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("1", "1", "2")
    assert env_of(CONFIG, "s0", "spare", 2)["RANK"] == "2"  # a placeholder past the workers' ranks


def test_devices_follow_the_placement():
    config = replace(CONFIG, gpus_per_node=3)
    devices = [env_of(config, name, role, rank)["DEADPOOL_DEVICE"]
               for name, role, rank in [("w0", "worker", 0), ("w1", "worker", 1), ("s0", "spare", 2),
                                        ("s1", "spare", 3)]]
    assert devices == ["0", "1", "2", ""]  # s1 has none of its own: it inherits the GPU of the rank it replaces
    assert env_of(CONFIG, "w0", "worker", 0)["DEADPOOL_DEVICE"] == ""  # no GPUs: the CPU


def test_nccl_error_handling_is_deadpools_even_if_the_user_set_it():
    env = env_of(CONFIG, "w0", "worker", 0, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"


def test_gloo_listens_on_the_jobs_interface_unless_the_user_chose_one():
    config = replace(CONFIG, interface="lo")
    assert env_of(config, "w0", "worker", 0)["GLOO_SOCKET_IFNAME"] == "lo"
    assert env_of(config, "w0", "worker", 0, {"GLOO_SOCKET_IFNAME": "eth9"})["GLOO_SOCKET_IFNAME"] == "eth9"


def test_determinism_settings_and_user_values_win():
    assert env_of(CONFIG, "w0", "worker", 0)["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert "CUBLAS_WORKSPACE_CONFIG" not in env_of(replace(CONFIG, deterministic=False), "w0", "worker", 0)
    mine = env_of(CONFIG, "w0", "worker", 0, {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "OMP_NUM_THREADS": "4"})
    assert mine["CUBLAS_WORKSPACE_CONFIG"] == ":16:8" and mine["OMP_NUM_THREADS"] == "4"
    assert mine["PYTHONHASHSEED"] == "7"


def test_on_nodes_local_ranks_and_gpus_are_each_nodes_own():
    """2 worker nodes and 1 spare node of 2 processes, 2 GPUs per node: rank 3 is the second process of node 1,
    and spare s1 the second of node 2; each uses GPU 1 of its own machine."""
    config = replace(CONFIG, workers=4, spares=2, nproc_per_node=2, gpus_per_node=2)
    w3, s1 = env_of(config, "w3", "worker", 3), env_of(config, "s1", "spare", 5)
    assert (w3["RANK"], w3["LOCAL_RANK"], w3["WORLD_SIZE"], w3["LOCAL_WORLD_SIZE"]) == ("3", "1", "4", "2")
    assert (s1["LOCAL_RANK"], s1["LOCAL_WORLD_SIZE"]) == ("1", "2")
    assert w3["DEADPOOL_DEVICE"] == s1["DEADPOOL_DEVICE"] == "1"


def test_a_process_with_a_gpu_has_it_as_its_local_rank():
    """Workers' GPUs are their places; a spare on a GPU of its own has that GPU as LOCAL_RANK from the start,
    and keeps it when it takes a rank (runtime/generation.assume)."""
    config = replace(CONFIG, gpus_per_node=3)
    assert [env_of(config, n, role, r)["LOCAL_RANK"] for n, role, r in
            [("w0", "worker", 0), ("w1", "worker", 1), ("s0", "spare", 2), ("s1", "spare", 3)]] == ["0", "1", "2", "3"]


def _idle_spare(tmp_path: Path, script: str) -> tuple[Agent, io.StringIO]:
    """An agent of a one-worker job that has started spare s0 running `script`; the console it prints to."""
    path = tmp_path / "train.py"
    path.write_text(script)
    echo = io.StringIO()
    agent = Agent(JobConfig(script=str(path), workers=1, spares=1, run_dir=str(tmp_path)), tmp_path / "c.json",
                  echo=echo)
    agent.spawn("s0", "spare", 1)
    return agent, echo


def test_an_idle_spares_output_is_held_back_in_its_log_until_it_takes_a_rank(tmp_path):
    agent, echo = _idle_spare(tmp_path, "import time\nprint('the banner', flush=True)\n"
                                        "time.sleep(1)\nprint('training')\n")
    log, deadline = tmp_path / "logs" / "s0.log", time.monotonic() + 30
    while not (log.exists() and "the banner" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert echo.getvalue() == ""  # in the log, not on the console
    agent.relabel("s0", "s0=r0")
    agent.stop_all(grace_s=30)
    assert echo.getvalue() == "[s0=r0] the banner\n[s0=r0] training\n"


def test_the_agent_calls_its_wake_up_as_soon_as_a_child_exits(tmp_path):
    """The coordinator sleeps between ticks; a SIGKILLed rank must not wait for the next one to be seen."""
    script = tmp_path / "train.py"
    script.write_text("import time\ntime.sleep(60)\n")
    agent = Agent(JobConfig(script=str(script), workers=1, run_dir=str(tmp_path)), tmp_path / "c.json", echo=None)
    exited = threading.Event()
    agent.on_exit(exited.set)
    child = agent.spawn("w0", "worker", 0)
    time.sleep(0.2)
    assert not exited.is_set()
    agent.fence("w0")
    assert exited.wait(10.0) and child.popen.poll() == -9
    assert [c.name for c in agent.poll()] == ["w0"]


def test_an_idle_spare_that_fails_has_its_held_back_output_shown(tmp_path):
    """A spare's traceback must be seen even though it never took a rank: its held lines go out, labelled."""
    agent, echo = _idle_spare(tmp_path, "import sys\nprint('the banner', flush=True)\n"
                                        "sys.exit('a spare that cannot start')\n")
    deadline = time.monotonic() + 30
    while "cannot start" not in echo.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert echo.getvalue() == "[s0] the banner\n[s0] a spare that cannot start\n"
    agent.stop_all(grace_s=30)
