"""Tests for deadpool/config.py: Fault and JobConfig validation, and the JSON round trip."""

import dataclasses
import json
import re

import pytest

from deadpool.config import FAULT_PHASES, STEP_ZERO_PHASES, Fault, JobConfig
from deadpool.errors import ConfigError


def job(**overrides) -> JobConfig:
    return JobConfig(**{"script": "train.py", "workers": 2, "run_dir": "/tmp/run", **overrides})


# ---- Fault ----------------------------------------------------------------------------------

def test_fault_defaults_to_backward_phase():
    fault = Fault(kind="kill", rank=0, step=1)
    assert (fault.kind, fault.rank, fault.step, fault.phase) == ("kill", 0, 1, "backward")


@pytest.mark.parametrize("phase", FAULT_PHASES)
def test_fault_accepts_every_catalog_phase(phase):
    assert Fault(kind="corrupt_replica", rank=3, step=7, phase=phase).phase == phase
    step = 0 if phase in STEP_ZERO_PHASES else 7
    assert Fault(kind="kill", rank=3, step=step, phase=phase).phase == phase


@pytest.mark.parametrize("fields, message", [
    (dict(kind="explode", rank=0, step=1),
     "fault kind 'explode' is not one of ('kill', 'kill_node', 'hang', 'error', 'corrupt_replica')"),
    (dict(kind="kill", rank=0, step=1, phase="sideways"),
     "fault phase 'sideways' is not one of ('step_start', 'forward', 'backward', 'after_optimizer', "
     "'snapshot_copy', 'replicate', 'recovery', 'init', 'setup', 'handover', 'handover_data')"),
    (dict(kind="kill", rank=-1, step=1), "fault needs rank >= 0 and step >= 1, got rank=-1 step=1"),
    (dict(kind="kill", rank=0, step=0), "fault needs rank >= 0 and step >= 1, got rank=0 step=0"),
    (dict(kind="kill", rank=0, step=1, phase="init"),
     "a fault in phase init (no step of its own) needs rank >= 0 and step 0, got rank=0 step=1"),
])
def test_fault_rejects_bad_fields(fields, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        Fault(**fields)


def test_fault_is_frozen_and_keyword_only():
    fault = Fault(kind="kill", rank=0, step=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fault.rank = 1
    with pytest.raises(TypeError):
        Fault("kill", 0, 1)


# ---- JobConfig validation -------------------------------------------------------------------

def test_defaults_are_valid_and_world_size_is_workers():
    config = job(workers=3)
    assert config.world_size == 3
    assert config.spares == 0 and config.snapshot_every == 1 and config.faults == ()


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        job(workers=0)


@pytest.mark.parametrize("overrides, message", [
    (dict(workers=0), "--workers must be at least 1, got 0"),
    (dict(spares=-1), "--spares must be 0 or more, got -1"),
    (dict(backend="mpi"), "--backend must be auto, gloo or nccl, got 'mpi'"),
    (dict(gpus_per_node=-1), "--gpus-per-node must be 0 or more, got -1"),
    (dict(snapshot_every=-1), "--snapshot-every must be a step count >= 0 (0 = off) or 'auto', got -1"),
    (dict(snapshot_every="often"), "--snapshot-every must be a step count >= 0 (0 = off) or 'auto', got 'often'"),
    (dict(snapshot_every=True), "--snapshot-every must be a step count >= 0 (0 = off) or 'auto', got True"),
    (dict(snapshot_every=1.0), "--snapshot-every must be a step count >= 0 (0 = off) or 'auto', got 1.0"),
    (dict(snapshot_budget=0.0), "--snapshot-budget is a fraction of step time in (0, 1), got 0.0"),
    (dict(snapshot_budget=1.0), "--snapshot-budget is a fraction of step time in (0, 1), got 1.0"),
    (dict(backlog_policy="drop"), "--backlog-policy must be one of ('wait', 'skip'), got 'drop'"),
    (dict(connect_timeout_s=0.0), "connect timeout must be positive, got 0.0"),
    (dict(connect_timeout_s=-5.0), "connect timeout must be positive, got -5.0"),
    (dict(workers=2, faults=(Fault(kind="kill", rank=2, step=3),)),
     "fault targets rank 2 but the job has ranks 0..1"),
])
def test_rejects_invalid_fields(overrides, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        job(**overrides)


@pytest.mark.parametrize("every", [0, 1, 25, "auto"])
def test_accepts_snapshot_every(every):
    assert job(snapshot_every=every).snapshot_every == every


def test_accepts_fault_on_last_rank():
    fault = Fault(kind="kill", rank=1, step=3)
    assert job(workers=2, faults=(fault,)).faults == (fault,)


# The deadlines form a chain: poll < recovery < collective, each strictly, the first positive.
@pytest.mark.parametrize("overrides, message", [
    (dict(poll_interval_s=0.0),
     "timeouts must satisfy 0 < poll-interval < recovery-timeout, got poll-interval=0.0s recovery-timeout=30.0s"),
    (dict(poll_interval_s=30.0),
     "timeouts must satisfy 0 < poll-interval < recovery-timeout, got poll-interval=30.0s recovery-timeout=30.0s"),
    (dict(poll_interval_s=5.0, recovery_timeout_s=4.0),
     "timeouts must satisfy 0 < poll-interval < recovery-timeout, got poll-interval=5.0s recovery-timeout=4.0s"),
    (dict(recovery_timeout_s=60.0),
     "timeouts must satisfy 0 < recovery-timeout < collective-timeout, "
     "got recovery-timeout=60.0s collective-timeout=60.0s"),
    (dict(collective_timeout_s=20.0),
     "timeouts must satisfy 0 < recovery-timeout < collective-timeout, "
     "got recovery-timeout=30.0s collective-timeout=20.0s"),
])
def test_timeouts_must_be_strictly_ordered(overrides, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        job(**overrides)


def test_settle_window_must_end_before_the_recovery_timeout():
    with pytest.raises(ConfigError, match=r"^--settle-window must be in \[0, recovery-timeout\), got 30.0s$"):
        job(settle_s=30.0)


def test_accepts_tight_but_ordered_timeouts():
    config = job(poll_interval_s=0.01, settle_s=0.0, recovery_timeout_s=0.03, collective_timeout_s=0.04,
                 silence_timeout_s=0.02)
    assert config.collective_timeout_s == 0.04


@pytest.mark.parametrize("silence", [0.02, 60.0, float("nan")])
def test_silence_timeout_lies_between_the_poll_interval_and_the_collective_timeout(silence):
    """Silence shorter than a poll cannot be seen; a survivor must not give up on a collective before its
    silent peer is fenced."""
    message = (f"--silence-timeout must lie between the poll interval (0.02s) and the collective timeout (60.0s), "
               f"got {silence}s")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        job(silence_timeout_s=silence)


def test_rejects_nan_connect_timeout():
    with pytest.raises(ConfigError):
        job(connect_timeout_s=float("nan"))


# ---- JSON -----------------------------------------------------------------------------------

def full_config() -> JobConfig:
    return job(script_args=("--steps", "40"), workers=4, spares=2, store_port=29500, token="t0k",
               backend="gloo", snapshot_every="auto", snapshot_budget=0.05, backlog_policy="skip",
               faults=(Fault(kind="kill", rank=2, step=15, phase="forward"),
                       Fault(kind="corrupt_replica", rank=1, step=10)))


def test_json_round_trip_preserves_every_field_and_type():
    config = full_config()
    back = JobConfig.from_json(config.to_json())
    assert back == config
    assert type(back.script_args) is tuple and back.script_args == ("--steps", "40")
    assert type(back.faults) is tuple
    assert all(type(f) is Fault for f in back.faults)
    assert back.faults[0] == Fault(kind="kill", rank=2, step=15, phase="forward")


def test_json_is_plain_data():
    raw = json.loads(full_config().to_json())
    assert raw["script_args"] == ["--steps", "40"]
    assert raw["faults"] == [{"kind": "kill", "rank": 2, "step": 15, "phase": "forward"},
                             {"kind": "corrupt_replica", "rank": 1, "step": 10, "phase": "backward"}]
    assert raw["snapshot_every"] == "auto"


def test_json_round_trip_with_integer_interval_and_no_faults():
    config = job(snapshot_every=0)
    back = JobConfig.from_json(config.to_json())
    assert back == config and back.snapshot_every == 0 and back.faults == () and back.script_args == ()


def test_write_then_read(tmp_path):
    config = full_config()
    path = tmp_path / "config.json"
    config.write(path)
    assert JobConfig.read(path) == config
    assert JobConfig.read(str(path)) == config


def test_from_json_validates():
    raw = json.loads(job().to_json())
    raw["workers"] = 0
    with pytest.raises(ConfigError, match="^--workers must be at least 1, got 0$"):
        JobConfig.from_json(json.dumps(raw))
