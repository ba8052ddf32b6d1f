"""Tests for deadpool/runtime/standalone.py: who a process is when no launcher started it, where rank 0 hosts
the control plane, which GPU it uses, and what it says at start (the pure parts; test_standalone in
tests/integration runs real jobs)."""

import os
import stat
from pathlib import Path

import pytest

from deadpool.errors import ConfigError
from deadpool.protocol.secret import new_secret, write_secret
from deadpool.protocol.store import StoreServer
from deadpool.runtime.standalone import (
    Shape,
    _connect_to_rank_0,
    gpu_of,
    join,
    launched,
    secret_file,
    shape_of,
    start_line,
    store_address,
)

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "1"}


def test_without_torchrun_a_process_is_a_job_of_one_rank():
    assert shape_of({}) == Shape()
    assert (Shape().rank, Shape().world_size, Shape().torchrun, Shape().nodes) == (0, 1, False, 1)
    partial = {k: v for k, v in TORCHRUN.items() if k != "MASTER_PORT"}  # not torchrun's whole identity
    assert shape_of(partial) == Shape()


def test_under_torchrun_a_process_takes_its_identity():
    shape = shape_of(TORCHRUN)
    assert shape == Shape(rank=3, world_size=4, local_rank=1, local_world_size=2, master_addr="node0",
                          master_port=29500, run_id="abc-1")
    assert (shape.torchrun, shape.nodes) == (True, 2)


def test_the_control_plane_listens_on_loopback_or_master_addr_next_to_torchruns_store():
    assert store_address(Shape()) == ("127.0.0.1", 0)  # one rank: any free port
    assert store_address(shape_of({**TORCHRUN, "MASTER_ADDR": "localhost"})) == ("127.0.0.1", 29501)
    assert store_address(shape_of(TORCHRUN)) == ("node0", 29501)


def test_a_rank_uses_the_gpu_its_local_rank_names_when_every_local_rank_has_one():
    shape = shape_of(TORCHRUN)
    assert [gpu_of(shape, visible) for visible in (0, 1, 2, 8)] == [None, None, 1, 1]
    assert gpu_of(Shape(), 1) == 0 and gpu_of(Shape(), 0) is None


def test_the_start_line_says_what_runs_and_where():
    assert start_line(Shape(), "/r") == ("[deadpool] no launcher: running as one rank without spares (start with "
                                         "`deadpool run` for fault tolerance); run directory /r")
    assert start_line(shape_of(TORCHRUN), "/r").startswith("[deadpool] no launcher: running under torchrun as "
                                                           "4 ranks without spares")


def test_torchruns_secret_lives_in_a_private_directory_named_after_its_run(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = secret_file(shape_of(TORCHRUN), tmp_path / "run")
    assert path == tmp_path / f"deadpool-{os.getuid()}" / "torchrun-abc-1.secret"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert secret_file(Shape(), tmp_path / "run") == tmp_path / "run" / "secret"  # one rank: its run directory


def test_a_private_directory_others_can_enter_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    shared = Path(tmp_path / f"deadpool-{os.getuid()}")
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ConfigError, match="only you can enter"):
        secret_file(shape_of(TORCHRUN), tmp_path)


def test_a_process_the_launcher_started_has_the_config_path(monkeypatch):
    monkeypatch.delenv("DEADPOOL_CONFIG", raising=False)
    assert not launched()
    monkeypatch.setenv("DEADPOOL_CONFIG", "/run/config.json")
    assert launched()


def test_a_rank_refused_with_a_stale_secret_file_reads_it_again_and_a_wrong_secret_is_named(tmp_path):
    """Rank 1 read a file an earlier torchrun left (the stale secret); rank 0 has since replaced it: refused once,
    it connects with the file's new secret. A secret that is simply not rank 0's is a clear error."""
    secret, stale = new_secret(), new_secret()
    store = StoreServer("127.0.0.1", 0, secret)
    shape = Shape(rank=1, world_size=2, local_world_size=2, master_port=store.port - 1, run_id="none-0")
    try:
        path = write_secret(tmp_path / "torchrun-none-0.secret", secret)
        client = _connect_to_rank_0(shape, stale, path)
        client.set("k", "v")
        client.close()
        assert store.table.get("k", 0) == b"v"
        with pytest.raises(ConfigError, match=f"rank 0's control plane at 127.0.0.1:{store.port} refused rank 1 "
                                              r"\(.*\): every rank must have the same DEADPOOL_SECRET"):
            _connect_to_rank_0(shape, stale, None)
    finally:
        store.close()


def test_torchrun_on_several_machines_without_a_secret_stops_at_init_naming_the_variable(monkeypatch):
    """Checked before anything is written or connected: every rank of every machine says it alike."""
    for name, value in {**TORCHRUN, "DEADPOOL_SECRET": ""}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="torchrun on 2 machines: DeadPool's control plane needs a secret shared by "
                                          "every rank; set DEADPOOL_SECRET"):
        join()
