"""The disk tier with real processes and real signals: a stopped or lost job resumes bit for bit, and a rank lost
with every holder of its replica is restored from disk in place."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deadpool.config import Fault
from deadpool.disk import listing, verify

from .conftest import REPO, SCRIPTS, SMALL, TRAIN, Background, alive, job_events, run_job


def _launch(run_dir: Path, persist: Path, *more: str) -> subprocess.Popen:
    """`deadpool run` in a process of its own (so that it can be signalled), the reference job's shape."""
    return subprocess.Popen([sys.executable, "-m", "deadpool.launcher.cli", "run", "--workers", "4", "--spares", "1",
                             "--persist-dir", str(persist), "--persist-every", "3", *more, "--out", str(run_dir),
                             str(TRAIN), "--steps", "10", *SMALL], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for_step(run_dir: Path, step: int, launcher: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(e["event"] == "commit" and e["step"] >= step for e in job_events(run_dir)):
        assert launcher.poll() is None and time.monotonic() < deadline, "the job ended or stalled before the step"
        time.sleep(0.05)


def _resumed_matches_reference(run_dir: Path, persist: Path, reference, expected_step: int) -> None:
    """`--resume auto` with the same job: it starts after `expected_step` and ends bit for bit the reference."""
    job = run_job(run_dir, persist_dir=str(persist), persist_every=3, resume="auto")
    assert job.code == 0, job.summary["error"]
    assert job.summary["resumed_from"]["step"] == expected_step
    assert min(e["step"] for e in job.named("step")) == expected_step + 1  # nothing before it is run again
    assert job.summary["rank_state_sha256"] == reference.summary["rank_state_sha256"]
    last = job.summary["checkpoints"][-1]  # the last commit, written by the ranks as they finished
    assert last["step"] == 10 and last["nbytes"] > 0 and last["write_s"] > 0
    assert expected_step not in [c["step"] for c in job.summary["checkpoints"]]  # on disk already: not rewritten


def test_sigterm_persists_the_newest_commit_and_resume_is_bit_for_bit(tmp_path, reference):
    """A scheduler's SIGTERM: the launcher has the newest commit written (by the idle spare), exits 143 and
    prints the command that goes on; that command finishes the run bit for bit."""
    persist, first = tmp_path / "ckpt", tmp_path / "first"
    launcher = _launch(first, persist)
    try:
        _wait_for_step(first, 4, launcher)
        launcher.send_signal(signal.SIGTERM)
        output, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    assert launcher.returncode == 143, output
    assert "to go on: deadpool run --resume auto" in output
    summary, events = json.loads((first / "summary.json").read_text()), job_events(first)
    [stopped] = [e for e in events if e["event"] == "job_stopped"]
    assert summary["stopped_by"] == "SIGTERM" and stopped["persisted"] == stopped["committed"] >= 4
    [asked] = [e for e in events if e["event"] == "stop_requested"]
    assert (asked["signal"], asked["committed"]) == ("SIGTERM", stopped["committed"])  # no commit after the stop
    order = [e for e in events if e["event"] == "persist_ordered" and e["step"] == stopped["persisted"]][-1]
    assert order["writers"] == ["s0"] * 4  # the idle spare, which holds every rank's replica, writes them all
    assert summary["checkpoints"][-1]["step"] == stopped["persisted"]
    _resumed_matches_reference(tmp_path / "second", persist, reference, stopped["persisted"])


def test_a_lost_coordinator_leaves_a_checkpoint_that_resume_completes(tmp_path, reference):
    """SIGKILL the launcher (and with it the coordinator and its store): every rank gets SIGTERM from the kernel,
    writes its newest commit and exits; `--resume auto` assembles that checkpoint and goes on, bit for bit."""
    persist, first = tmp_path / "ckpt", tmp_path / "first"
    launcher = _launch(first, persist, "--persist-every", "1000")  # no checkpoint but the ranks' own last words
    try:
        _wait_for_step(first, 5, launcher)
        pids = {e["proc"]: e["pid"] for e in job_events(first) if e["event"] == "process_start"}
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") and alive(p) for p in pids.values()):
            time.sleep(0.1)
        assert not [p for p in pids.values() if alive(p)], "a training process outlived its launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
    events = job_events(first)
    written = [e for e in events if e["event"] == "persist_part"]
    steps = {r: {e["step"] for e in written if e["ranks"] == [r]} for r in range(4)}
    assert all(steps.values()), steps  # every rank wrote its part on its way out
    last_words = {e["rank"]: e for e in events if e["event"] == "terminated" and e["rank"] is not None}
    assert sorted(last_words) == [0, 1, 2, 3] and all(e["launcher_gone"] for e in last_words.values())
    said = {e["rank"]: set(e["writes"]) for e in events if e["event"] == "persist_on_stop"}
    assert sorted(said) == [0, 1, 2, 3] and all(steps[r] <= said[r] for r in said)  # each wrote what it said
    # (a write may fail: the snapshot thread can replace a slot while the last words are said)
    newest = max(set.intersection(*steps.values()))  # the newest step every rank wrote
    _resumed_matches_reference(tmp_path / "second", persist, reference, newest)


def test_a_rank_lost_with_its_only_holder_is_restored_from_disk_in_place(tmp_path, reference):
    """Memory first, disk second, in one recovery: rank 1 and the spare holding its replica die together; the
    other spare takes rank 1 from the newest checkpoint, every rank rolls back to that step (the survivors from
    their own slots where they still hold it), and the survivors keep their processes."""
    job = Background(tmp_path / "run", spares=2, persist_dir=str(tmp_path / "ckpt"), persist_every=2,
                     script=SCRIPTS / "slow_steps.py", script_prefix=("0.4",))  # time to act after a checkpoint
    job.wait_for(lambda e: e["event"] == "checkpoint_persisted" and e["step"] >= 2)
    plan = [e for e in job.events() if e["event"] == "plan_published"][-1]
    [holder] = plan["holders"][1]
    victims = [job.pid("w1"), job.pid(holder)]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    done = job.join()
    assert done.code == 0, done.summary["error"]
    [decided] = done.named("restore_decided")
    assert decided["from_disk"] and "from disk" in decided["reason"]
    step = decided["target"]
    assert [e["proc"] for e in done.named("restored_from_disk")] == ["s0"]  # the taker: no copy was left in memory
    assert sorted(e["restored_step"] for e in done.named("recovered")) == [step] * 4  # survivors: their own slot
    spawned = {e["proc"]: e["pid"] for e in done.named("process_spawned")}
    assert sorted(spawned) == ["s0", "s1", "w0", "w1", "w2", "w3"]  # nobody was restarted
    finished = {e["rank"]: e["pid"] for e in done.named("finished")}
    assert [finished[r] for r in (0, 2, 3)] == [spawned["w0"], spawned["w2"], spawned["w3"]]
    assert done.summary["rank_state_sha256"] == reference.summary["rank_state_sha256"]


def test_resuming_from_a_checkpoint_of_another_job_is_refused_and_on_more_workers_goes_on(tmp_path, capsys):
    """A checkpoint of two data-parallel workers: another --seed is refused by the launcher, a model of other shapes
    by the ranks before they load it (exit 2, one line naming the difference, the checkpoint untouched), and so is
    a run that would start afresh into the same --persist-dir (its checkpoints would mix with these); three
    workers resume it: each loads the shared parameters and optimizer state, rank 2 rank 0's own state, and the
    data goes on from the same position with no sample lost or seen twice."""
    persist = tmp_path / "ckpt"
    first = run_job(tmp_path / "first", steps=2, workers=2, spares=0, persist_dir=str(persist), persist_every=1)
    assert first.code == 0 and first.summary["checkpoints"]
    before = {p: p.stat().st_mtime_ns for p in persist.rglob("*")}
    narrower = tuple("32" if a == "64" else a for a in SMALL)  # --n-embd 32
    resume = ("--resume", "auto")
    for args, says in (((*resume, "--seed", "7", str(TRAIN), "--steps", "4", *SMALL), r"written by another script or "
                        r"--seed"),
                       ((*resume, str(TRAIN), "--steps", "4", *narrower), r"it holds the state of another job "
                        r"\(model\.\S+ has shape \[(\d+, )*64\] in the checkpoint, \[(\d+, )*32\] now"),
                       ((str(TRAIN), "--steps", "4", *SMALL), r"already holds checkpoints of an earlier run "
                        r"\((step-\d{10}, )?step-0000000002\): go on from them with --resume auto, or give an empty")):
        out = subprocess.run([sys.executable, "-m", "deadpool.launcher.cli", "run", "--workers", "2", "--persist-dir",
                              str(persist), "--out", str(tmp_path / "refused"), *args],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        err = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(err) == 1 and re.search(says, err[0]), err
        assert {p: p.stat().st_mtime_ns for p in persist.rglob("*")} == before
    capsys.readouterr()
    wider = run_job(tmp_path / "wider", steps=4, workers=3, spares=0, persist_dir=str(persist), resume="auto")
    assert wider.code == 0, wider.summary["error"]
    assert "[deadpool] note: the checkpoint was written by 2 workers, this job has 3: " in capsys.readouterr().err
    assert first.summary["checkpoints"][-1]["step"] == wider.summary["resumed_from"]["step"] == 2
    assert sorted(e["rank"] for e in wider.named("resumed_from_disk")) == [0, 1, 2]
    assert {e["step"] for e in wider.named("step")} == {3, 4}  # steps 1 and 2 are not run again
    seen = [i for _, samples in sorted(first.batches().items()) + sorted(wider.batches().items()) for i in samples]
    assert len(seen) == 2 * 2 * 4 + 2 * 3 * 4 and len(set(seen)) == len(seen)  # nothing lost, nothing twice


def test_a_damaged_newest_checkpoint_is_passed_over_set_aside_and_its_step_written_again(tmp_path, capsys):
    """One command run twice, `--resume auto` (as a requeued job's script would): the first run finds nothing and
    starts from the beginning. A byte flipped in the newest checkpoint: the second says so and starts from the one
    before; the damaged one is set aside (left in place, its step would count as written by the new run) and that
    step is written again, intact, with the very snapshots the damaged one held (each rank's hash in the
    manifests)."""
    persist = tmp_path / "ckpt"
    job = dict(steps=3, workers=2, spares=0, persist_dir=str(persist), persist_every=1, resume="auto",
               script=SCRIPTS / "slow_steps.py", script_prefix=("0.1",))  # time to write a step before the next
    said = io.StringIO()
    first = run_job(tmp_path / "first", echo=said, **job)
    assert first.code == 0 and first.summary["checkpoints"][-1]["step"] == 3 and first.summary["resumed_from"] is None
    assert f"[deadpool] --resume auto: no checkpoint in {persist} yet, the job starts from the beginning" in \
        said.getvalue()
    damaged = persist / "step-0000000003"
    [(newest, _), (before, _)] = listing(persist, "step")  # --keep 2; 0, 1 or 2: an order in flight defers the next
    assert newest == 3
    data = max(damaged.rglob("*.distcp"), key=lambda f: f.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(raw)
    capsys.readouterr()
    second = run_job(tmp_path / "second", **job)
    assert second.code == 0, second.summary["error"]
    assert second.summary["resumed_from"]["step"] == before
    [skipped] = second.named("checkpoint_skipped")
    assert skipped["path"] == str(damaged) and skipped["reason"].endswith("hash (corrupted)")
    aside = persist / "step-0000000003.set-aside"
    [moved] = second.named("checkpoint_set_aside")
    assert (moved["path"], moved["to"]) == (str(damaged), str(aside))
    err = capsys.readouterr().err
    assert f"[deadpool] skipped checkpoint {damaged}: {skipped['reason']}" in err
    assert f"[deadpool] set aside checkpoint {damaged} as {aside.name}: newer than step {before}" in err
    assert before not in [c["step"] for c in second.summary["checkpoints"]]  # on disk already: not rewritten
    last = second.summary["checkpoints"][-1]  # the ranks wrote it as they finished (perhaps ordered too: once)
    parts = {e["proc"]: e["nbytes"] for e in second.named("persist_part") if e["step"] == 3}
    assert last["step"] == 3 and last["nbytes"] == sum(parts.values()) > 0 and sorted(parts) == ["w0", "w1"]
    assert verify(damaged) is None and "corrupted" in (verify(aside) or "")
    crcs = [{r: e["crc"] for r, e in json.loads((d / "manifest.json").read_text())["ranks"].items()}
            for d in (damaged, aside)]
    assert crcs[0] == crcs[1] and len(crcs[0]) == 2


def test_with_no_spare_left_the_newest_commit_is_persisted_and_the_command_to_go_on_printed(tmp_path):
    """Rank 1 dies and no spare is left: the newest commit is written first (rank 1's part by w0, which holds
    its replica), then the job stops naming it, and `deadpool run` prints the command that goes on."""
    persist, run_dir = tmp_path / "ckpt", tmp_path / "run"
    argv = ["run", "--workers", "2", "--persist-dir", str(persist), "--persist-every", "1000", "--fault",
            "kill:1:3:step_start", "--out", str(run_dir), str(TRAIN), "--steps", "4", *SMALL]
    out = subprocess.run([sys.executable, "-m", "deadpool.launcher.cli", *argv], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    events = job_events(run_dir)
    [stopped] = [e for e in events if e["event"] == "job_stopped"]
    step = max(e["step"] for e in events if e["event"] == "commit")
    assert out.returncode == 1 and (stopped["by"], stopped["persisted"], stopped["committed"]) == ("no spare", step,
                                                                                                 step)
    assert f"Step {step} is on disk in {persist}; go on from it with the same command and --resume auto." in out.stderr
    assert f"[deadpool] to go on: deadpool run --resume auto {' '.join(argv[1:])}\n" in out.stdout
    assert {(e["proc"], tuple(e["ranks"])) for e in events if e["event"] == "persist_part"} == {("w0", (0, 1))}
    assert [e["step"] for e in events if e["event"] == "checkpoint_persisted"] == [step]


@pytest.mark.parametrize("phase", ["handover", "handover_data"])
def test_a_holder_killed_as_it_hands_a_replica_over_leaves_its_taker_free_to_restore_from_disk(tmp_path, reference,
                                                                                             phase):
    """Ranks 0 and 3 die together; their holder s0 takes rank 0 and starts streaming rank 3's replica to s1,
    and dies then (a planned fault): before the two connect, with s1 waiting for the stream (`handover`), or
    connected, with s1 receiving the first snapshot (`handover_data`). The abort (or the broken stream)
    releases s1; no copy of ranks 0 and 3 is left in memory, so s1 and s2 take them from the newest
    checkpoint, every rank restores it in place, and the run is bit for bit the reference."""
    job = Background(tmp_path / "run", spares=3, persist_dir=str(tmp_path / "ckpt"), persist_every=2,
                     faults=(Fault(kind="kill", rank=3, step=0, phase=phase),),
                     script=SCRIPTS / "slow_steps.py", script_prefix=("0.4",))  # time to act after a checkpoint
    job.wait_for(lambda e: e["event"] == "checkpoint_persisted" and e["step"] >= 2)
    plan = [e for e in job.events() if e["event"] == "plan_published"][-1]
    assert plan["holders"][0] == plan["holders"][3] == ["s0"]
    for pid in (job.pid("w0"), job.pid("w3")):
        os.kill(pid, signal.SIGKILL)
    done = job.join()
    assert done.code == 0, done.summary["error"]
    [fault] = done.named("fault_injected")
    assert (fault["proc"], fault["target_rank"], fault["phase"]) == ("s0", 3, phase)
    assert [(e["proc"], e["of_rank"]) for e in done.named("transfer_failed")] == [("s1", 3)]  # released
    [decided] = done.named("restore_decided")
    assert decided["from_disk"] and [r["replaced"] for r in done.summary["recoveries"]] == [{"0": "s1", "3": "s2"}]
    assert sorted(e["restored_step"] for e in done.named("recovered")) == [decided["target"]] * 4
    spawned = {e["proc"]: e["pid"] for e in done.named("process_spawned")}
    finished = {e["rank"]: e["pid"] for e in done.named("finished")}
    assert [finished[r] for r in (1, 2)] == [spawned["w1"], spawned["w2"]]  # the survivors kept their processes
    assert done.summary["rank_state_sha256"] == reference.summary["rank_state_sha256"]
