"""Tests for deadpool/launcher/resume.py: the command that goes on from a stopped job, and what a resume does with
the checkpoints newer than its own."""

from dataclasses import replace
from pathlib import Path

import pytest
from tests.unit.disk.snapshots import replicated_slots

from deadpool.config import JobConfig
from deadpool.disk import Identity, finalize, step_dir, write_part
from deadpool.errors import ConfigError
from deadpool.launcher.resume import (
    misfits,
    refuse_used,
    reshard_note,
    resolve,
    resume_command,
    set_aside_newer,
    writable,
)
from deadpool.runtime.persist import source_rank


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


def _manifest(world_size: int, parallelism: str, config: JobConfig) -> dict:
    return {"world_size": world_size, "identity": {"parallelism": parallelism, "config_hash": config.config_hash()}}


def test_a_data_parallel_checkpoint_resumes_on_another_number_of_workers() -> None:
    config = JobConfig(script="train.py", run_dir="run", workers=3)
    manifest = _manifest(2, "replicated", config)
    assert misfits(manifest, config) is None
    assert "rank r mod 2" in (reshard_note(manifest, config) or "")
    assert [source_rank(manifest, r, 3) for r in range(3)] == [0, 1, 0]
    assert reshard_note(_manifest(3, "replicated", config), config) is None


def test_a_sharded_checkpoint_resumes_on_another_number_of_workers_with_its_shards_cut_anew() -> None:
    config = JobConfig(script="train.py", run_dir="run", workers=3)
    manifest = _manifest(2, "sharded", config)
    assert misfits(manifest, config) is None
    assert "its shard of the parameters and optimizer state, cut anew for 3 workers" in (reshard_note(manifest, config)
                                                                                         or "")
    assert [source_rank(manifest, r, 3) for r in range(3)] == [0, 1, 0]
    assert source_rank(_manifest(3, "sharded", config), 2, 3) == 2


def test_another_seed_is_refused() -> None:
    manifest = _manifest(2, "replicated", JobConfig(script="train.py", run_dir="run", workers=2, seed=7))
    now = JobConfig(script="train.py", run_dir="run", workers=2)
    assert "another script or --seed" in (misfits(manifest, now) or "")


def test_checkpoints_newer_than_the_resumed_one_are_set_aside_and_their_parts_deleted(tmp_path: Path) -> None:
    """A resume from step 2 writes steps 3 and on again: a step-3 left in place would count as written (damaged or
    not), so it is renamed, never deleted; parts of newer steps go; older ones, and other files, stay."""
    for name in ("step-0000000001", "step-0000000002", "step-0000000003", "step-0000000005",
                 "step-0000000003.set-aside", ".tmp-0000000002", ".tmp-0000000004", "notes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "f").write_text(name)
    config = JobConfig(script="train.py", run_dir="run", workers=2, persist_dir=str(tmp_path))
    moved = set_aside_newer(config, 2)
    assert [(old.name, new.name) for old, new in moved] == [("step-0000000005", "step-0000000005.set-aside"),
                                                           ("step-0000000003", "step-0000000003.set-aside-2")]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".tmp-0000000002", "notes", "step-0000000001", "step-0000000002", "step-0000000003.set-aside",
        "step-0000000003.set-aside-2", "step-0000000005.set-aside"]
    assert (tmp_path / "step-0000000003.set-aside-2" / "f").read_text() == "step-0000000003"  # kept whole
    assert set_aside_newer(config, 2) == []
    assert set_aside_newer(JobConfig(script="t.py", run_dir="r", workers=2), 0) == []  # no --persist-dir


def test_a_run_that_does_not_resume_refuses_a_persist_dir_holding_checkpoints(tmp_path: Path) -> None:
    config = JobConfig(script="train.py", run_dir="run", workers=2, persist_dir=str(tmp_path / "ckpt"))
    refuse_used(config)  # not there yet: made by the first checkpoint
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    refuse_used(config)  # nothing of a checkpoint's
    (tmp_path / "ckpt" / ".tmp-0000000004").mkdir()
    with pytest.raises(ConfigError, match=r"already holds checkpoints of an earlier run \(\.tmp-0000000004\): go on "
                                          r"from them with --resume auto, or give an empty directory"):
        refuse_used(config)


def test_resume_auto_with_nothing_ever_written_starts_afresh_and_with_only_damaged_ones_refuses(tmp_path: Path) -> None:
    """One command for a job's first run and every requeue: `auto` on a persist dir that is not there yet, or
    holds no checkpoint, starts from the beginning; one whose every checkpoint is damaged is refused, saying why
    each was passed over (starting afresh would throw their steps away); a named directory must exist."""
    persist = tmp_path / "ckpt"
    config = JobConfig(script="train.py", run_dir="run", workers=2, persist_dir=str(persist), resume="auto")
    skipped: list[tuple[Path, str]] = []
    assert resolve(config, lambda p, why: skipped.append((p, why))) is None
    persist.mkdir()
    assert resolve(config, lambda p, why: skipped.append((p, why))) is None
    (persist / ".tmp-0000000002" / "part-w0").mkdir(parents=True)  # a first run's part, never completed
    assert resolve(config, lambda p, why: skipped.append((p, why))) is None and skipped == []
    (persist / "step-0000000001").mkdir()
    with pytest.raises(ConfigError, match=r"--resume auto: no intact checkpoint in \S+ \(step-0000000001: no "
                                          r"manifest\.json \(never finished, or damaged\)\)"):
        resolve(config, lambda p, why: skipped.append((p, why)))
    assert [p.name for p, _ in skipped] == ["step-0000000001"]
    with pytest.raises(ConfigError, match=r"--resume \S+/nowhere: \S+ is not a directory"):
        resolve(replace(config, resume=str(tmp_path / "nowhere")), lambda p, why: None)


def test_a_persist_dir_is_made_and_written_to_before_the_job_starts(tmp_path: Path) -> None:
    writable(tmp_path / "a" / "ckpt")
    assert (tmp_path / "a" / "ckpt").is_dir() and not list((tmp_path / "a" / "ckpt").iterdir())  # nothing left
    (tmp_path / "file").write_text("not a directory")
    for where in (tmp_path / "file" / "ckpt", Path("/proc/deadpool-ckpt")):
        with pytest.raises(ConfigError, match=rf"cannot write checkpoints to --persist-dir {where} \(.+\): give a "
                                              "directory this job can write"):
            writable(where)


def test_resume_from_a_persist_dir_takes_its_newest_intact_checkpoint_of_this_job(tmp_path: Path) -> None:
    """`--resume DIR` naming a persist directory (not one checkpoint): the newest intact checkpoint there, a
    damaged newer one passed over and reported; a checkpoint another script wrote (by file name) is refused
    naming the script or --seed, one whose every checkpoint is damaged names why each was passed over."""
    config = JobConfig(script="train.py", run_dir="run", workers=2, resume=str(tmp_path))
    for step in (3, 5):
        slots = replicated_slots(step)
        identity = Identity.of(slots[0].meta, 2, config.config_hash())
        write_part(tmp_path, step, "w0", dict(enumerate(slots)), identity)
        assert finalize(tmp_path, step, 2, identity, keep=3) == step_dir(tmp_path, step)
    data = next(step_dir(tmp_path, 5).glob("part-*/*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one bit flipped in the newest checkpoint's data: its size stays
    data.write_bytes(bytes(raw))
    skipped: list[tuple[Path, str]] = []
    assert resolve(config, lambda p, why: skipped.append((p, why))) == (step_dir(tmp_path, 3).resolve(), 3)
    assert skipped == [(step_dir(tmp_path, 5), "part-w0/__0_0.distcp does not match its xxh3_128 hash (corrupted)")]
    with pytest.raises(ConfigError, match=r"^cannot resume from \S+/step-0000000003: it was written by another "
                                          r"script or --seed$"):
        resolve(replace(config, script="other/finetune.py"), lambda p, why: None)
    (step_dir(tmp_path, 3) / "manifest.json").unlink()
    with pytest.raises(ConfigError, match=r"^--resume \S+: no intact checkpoint in \S+ \(step-0000000005: .+; "
                                          r"step-0000000003: no manifest\.json \(never finished, or damaged\)\)$"):
        resolve(config, lambda p, why: None)
