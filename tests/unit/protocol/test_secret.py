"""Tests for deadpool/protocol/secret.py: files only their owner reads, clear errors for everything else."""

from __future__ import annotations

import os
import stat

import pytest

from deadpool.errors import ConfigError
from deadpool.protocol.secret import ENV_SECRET, find_secret, new_secret, read_secret, write_secret


def test_a_written_secret_is_readable_by_its_owner_only_and_reads_back(tmp_path):
    secret = new_secret()
    path = write_secret(tmp_path / "secret", secret)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert read_secret(path) == secret and len(secret) == 32
    assert write_secret(path, b"\x01" * 32) == path and read_secret(path) == b"\x01" * 32  # replaced in place


def test_a_secret_others_can_read_is_refused(tmp_path):
    path = write_secret(tmp_path / "secret", new_secret())
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match=f"readable by others \\(mode 644\\): run `chmod 600 {path}`"):
        read_secret(path)


@pytest.mark.parametrize("text, complaint", [("not hex", "hex digits expected"), ("00ff", "at least 16 are needed")])
def test_what_is_not_a_secret_is_named(tmp_path, text, complaint):
    path = tmp_path / "secret"
    path.write_text(text)
    os.chmod(path, 0o600)
    with pytest.raises(ConfigError, match=complaint):
        read_secret(path)


def test_an_agent_finds_its_secret_in_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_SECRET, raising=False)
    with pytest.raises(ConfigError, match="--secret-file"):
        find_secret(None)
    monkeypatch.setenv(ENV_SECRET, "ab" * 16)
    assert find_secret(None) == b"\xab" * 16
    path = write_secret(tmp_path / "secret", b"\x02" * 32)
    assert find_secret(path) == b"\x02" * 32  # the file wins
    with pytest.raises(ConfigError, match="cannot read the job's secret"):
        find_secret(tmp_path / "missing")
