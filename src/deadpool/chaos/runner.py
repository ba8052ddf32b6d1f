"""`deadpool chaos`: runs the fault matrix against the example GPT, one job at a time after a failure-free
reference, does from outside what a job cannot inject into itself (signals to spares and to the launcher, a cut
link, a damaged checkpoint), and writes DIR/chaos.md and DIR/chaos.json."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from deadpool.chaos import slow
from deadpool.chaos.job import Job
from deadpool.chaos.report import Seen, failed, markdown, row, skipped
from deadpool.chaos.scenarios import Drawn, select
from deadpool.config import Fault
from deadpool.disk.manifest import MANIFEST, listing
from deadpool.launcher.netns import available
from deadpool.launcher.options import EXAMPLE, default_out
from deadpool.report import summarize

# The integration tests' small GPT: a 12-step job takes seconds once its processes are up.
SMALL = ("--n-layer", "2", "--n-embd", "64", "--n-head", "2", "--batch-size", "4", "--log-every", "1000")
GONE_WAIT_S = 30.0  # a launcher's processes must be gone this long after it was SIGKILLed (--stop-grace 20 + 10)


def _spec(fault: Fault) -> str:
    return f"{fault.kind}:{fault.rank}:{fault.step}:{fault.phase}"


def job_argv(drawn: Drawn | None, run_dir: Path, steps: int, resume: bool = False) -> list[str]:
    """`deadpool run` arguments of a scenario's job (None: the reference, 4 workers and 1 spare). Every job
    trains the same model on the same data, so each must end on the reference's state."""
    s = drawn.scenario if drawn else None
    if s is not None and s.nodes:
        shape = ["--nnodes", "2", "--nproc-per-node", "2", "--spare-nodes", "1", "--netns"]
    else:
        shape = ["--workers", "4", "--spares", str(s.spares if s else 1)]
    disk = ["--persist-dir", str(run_dir.parent / "ckpt"), "--persist-every", str(s.persist_every)] \
        if s and s.persist_every else []
    faults = [f"--fault={_spec(f)}" for f in drawn.faults()] if drawn and not resume else []
    script = [str(Path(slow.__file__)), f"{s.slow_s:g}"] if s and s.slow_s else [str(EXAMPLE)]
    return [*shape, *disk, *(s.options if s else ()), *(["--resume", "auto"] if resume else []), *faults,
            "--out", str(run_dir), *script, "--steps", str(steps), *SMALL]


def _committed(step: int) -> Callable[[dict[str, Any]], bool]:
    return lambda e: e["event"] == "commit" and e["step"] >= step


def _plan(job: Job) -> dict[str, Any]:
    return [e for e in job.events() if e["event"] == "plan_published"][-1]


def _signal(job: Job, procs: list[str], sig: signal.Signals, seen: Seen) -> None:
    """Sends `sig` to the named processes at once; the time it did is the fault's."""
    pids = [pid for pid in map(job.pid, procs) if pid is not None]
    if len(pids) < len(procs):
        seen.problem = f"the runner found no pid for some of {procs}"
        return
    seen.t_action = time.monotonic()
    for pid in pids:
        os.kill(pid, sig)
    seen.notes.append(f"{signal.Signals(sig).name} to {', '.join(procs)}")


def _at_commit(drawn: Drawn, job: Job, seen: Seen) -> bool:
    if job.wait_for(_committed(drawn.step)) is None:
        seen.problem = f"the job ended or stalled before it committed step {drawn.step}"
        return False
    return True


def _holder(sig: signal.Signals) -> Callable[[Drawn, Job, Seen], None]:
    """SIGSTOP (a hung holder) or SIGKILL (a spare's death) to the spare holding the drawn rank's replica."""
    def act(drawn: Drawn, job: Job, seen: Seen) -> None:
        if _at_commit(drawn, job, seen):
            _signal(job, [_plan(job)["holders"][drawn.rank][0]], sig, seen)
    return act


def _kill_at_start(drawn: Drawn, job: Job, seen: Seen) -> None:
    """A worker SIGKILLed while the job starts: before, during or just after its deadpool.init()."""
    proc = f"w{drawn.rank}"
    if job.wait_for(lambda e: e["event"] == "process_spawned" and e["proc"] == proc) is None:
        seen.problem = f"{proc} was never spawned"
        return
    time.sleep(drawn.delay)
    _signal(job, [proc], signal.SIGKILL, seen)
    if any(e["event"] == "commit" and e["t"] < (seen.t_action or 0) for e in job.events()):
        seen.notes.append("after snapshot 0 was committed")


def _kill_rank_and_holders(drawn: Drawn, job: Job, seen: Seen) -> None:
    """The drawn rank and every holder of its replica at once, once a checkpoint is on disk."""
    if job.wait_for(lambda e: e["event"] == "checkpoint_persisted" and e["step"] >= drawn.step) is None:
        seen.problem = f"no checkpoint of step {drawn.step} or later was persisted"
        return
    plan = _plan(job)
    _signal(job, [plan["ranks"][drawn.rank], *plan["holders"][drawn.rank]], signal.SIGKILL, seen)


def _kill_source(drawn: Drawn, job: Job, seen: Seen) -> None:
    """The holder that streams a replica to its taker, killed as soon as the recovery's plan names it."""
    plan = job.wait_for(lambda e: e["event"] == "plan_published" and any(e["sources"]))
    if plan is None:
        seen.problem = "no recovery plan streamed a replica from one holder to another process"
        return
    _signal(job, [next(s for s in plan["sources"] if s)], signal.SIGKILL, seen)


def _kill_launcher(drawn: Drawn, job: Job, seen: Seen) -> None:
    """SIGKILL the launcher (its coordinator and store die with it): its processes must write their last
    commit and be gone within the stop grace."""
    if not _at_commit(drawn, job, seen):
        return
    seen.t_action = time.monotonic()
    job.proc.kill()
    job.finish()
    while time.monotonic() < seen.t_action + GONE_WAIT_S and job.alive():
        time.sleep(0.1)
    if job.alive():
        seen.problem = f"processes {job.alive()} outlived their SIGKILLed launcher by {GONE_WAIT_S:g} s"


def _term_launcher(drawn: Drawn, job: Job, seen: Seen) -> None:
    if _at_commit(drawn, job, seen):
        seen.t_action = time.monotonic()
        job.proc.send_signal(signal.SIGTERM)


def _corrupt_checkpoint(drawn: Drawn, job: Job, seen: Seen) -> None:
    """SIGTERM, then one byte flipped in a data file of the newest checkpoint, chosen by the scenario's seed."""
    _term_launcher(drawn, job, seen)
    if seen.problem or job.finish() is None:
        return
    found = listing(job.run_dir.parent / "ckpt", "step")
    if len(found) < 2:
        seen.problem = f"the stopped job left {len(found)} checkpoint(s), not two to choose between"
        return
    step, newest = found[0]
    files = sorted(p for p in newest.rglob("*") if p.is_file() and p.name != MANIFEST)
    victim = random.Random(drawn.seed).choice(files)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    seen.corrupted_step = step
    seen.notes.append(f"flipped a byte of {victim.relative_to(newest.parent)}")


def _cut_link(drawn: Drawn, job: Job, seen: Seen) -> None:
    """The drawn rank's node cut off (its link down, as a pulled cable), healed once the job swapped it."""
    if not _at_commit(drawn, job, seen):
        return
    network = next(e for e in job.events() if e["event"] == "network")
    link = network["links"][drawn.rank // 2]
    seen.t_action = time.monotonic()
    subprocess.run(["ip", "link", "set", link, "down"], check=True)
    try:
        job.wait_for(lambda e: e["event"] == "swap_complete" and e["t"] > (seen.t_action or 0))
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=True)


ACTIONS: dict[str, Callable[[Drawn, Job, Seen], None]] = {
    "stop-holder": _holder(signal.SIGSTOP), "kill-holder": _holder(signal.SIGKILL), "kill-at-start": _kill_at_start,
    "kill-rank-and-holders": _kill_rank_and_holders, "kill-source": _kill_source, "kill-launcher": _kill_launcher,
    "term-launcher": _term_launcher, "corrupt-checkpoint": _corrupt_checkpoint, "cut-link": _cut_link}


def _summary(job: Job, code: int | None) -> dict[str, Any]:
    """The job's summary.json, or the one its events give when its launcher was killed before writing it."""
    path = job.run_dir / "summary.json"
    if path.exists():
        return json.loads(path.read_text())
    events = job.run_dir / "events.jsonl"
    return summarize(events, exit_code=-1 if code is None else code) if events.exists() else {}


def run_scenario(drawn: Drawn, out: Path, steps: int, deadline_s: float) -> Seen:
    """One scenario, bounded: its job (and the resumed one) killed with all it started at `deadline_s` each."""
    shutil.rmtree(out, ignore_errors=True)
    started, seen = time.monotonic(), Seen(code=None, summary={}, events=[])
    job = Job(out / "run", job_argv(drawn, out / "run", steps), started + deadline_s)
    try:
        if drawn.scenario.action:
            ACTIONS[drawn.scenario.action](drawn, job, seen)
    except Exception as error:  # the runner's own failure (a command, an event it expected): this row, not all
        seen.problem = f"the runner could not act: {type(error).__name__}: {error}"
    try:
        code = job.finish()
    finally:
        left = job.cleanup()
    if left and code is not None:
        seen.notes.append(f"{len(left)} process(es) left running after the job, killed")
    seen.code, seen.events, seen.summary = code, job.events(), _summary(job, code)
    if code is None and not seen.problem:
        failure = seen.summary.get("error")
        seen.problem = (f"no end within {deadline_s:g} s: killed with every process it started"
                        + (f"; the job had failed: {failure}" if failure else ""))
    if drawn.scenario.resume and not seen.problem:
        resumed = Job(out / "resumed", job_argv(drawn, out / "resumed", steps, resume=True),
                      time.monotonic() + deadline_s)
        try:
            seen.resumed_code = resumed.finish()
        finally:
            resumed.cleanup()
        seen.resumed = _summary(resumed, seen.resumed_code)
    seen.wall_s = time.monotonic() - started
    return seen


def _write(out: Path, seed: int, steps: int, reference: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    (out / "chaos.json").write_text(json.dumps({"seed": seed, "steps": steps, "reference": {
        k: reference.get(k) for k in ("exit_code", "final_state_sha256", "rank_state_sha256", "error")},
        "scenarios": rows}, indent=2))
    (out / "chaos.md").write_text(f"`deadpool chaos --seed {seed} --steps {steps}`: 4 workers of the example GPT "
                                  f"(small), {steps} steps, each scenario against the failure-free run\n\n"
                                  f"{markdown(rows)}\n")


def chaos(args: argparse.Namespace) -> int:
    """Exit 0 if every scenario ended recovered bit for bit or with its documented error (skips aside), else 1."""
    out = args.out or default_out("chaos")
    out.mkdir(parents=True, exist_ok=True)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    drawn = select(args.scenarios, seed, args.steps)
    no_netns = available() if any(d.scenario.nodes for d in drawn) else ""
    print(f"[chaos] {len(drawn)} scenario(s), seed {seed} (replay one: --scenarios NAME@SEED); the failure-free "
          f"reference first", flush=True)
    ref = Job(out / "reference", job_argv(None, out / "reference", args.steps), time.monotonic() + args.deadline)
    try:
        code = ref.finish()
    finally:
        ref.cleanup()
    reference = _summary(ref, code)
    if code != 0:
        why = (f"did not finish within --deadline {args.deadline:g} s" if code is None
               else f"exited {code}: {reference.get('error') or 'see its output'}")
        print(f"[chaos] the failure-free reference {why}; nothing to judge against, see {ref.run_dir}", flush=True)
        _write(out, seed, args.steps, reference, [])
        return 1
    rows: list[dict[str, Any]] = []
    for d in drawn:
        print(f"[chaos] {d.scenario.name} (seed {d.seed}): {d.what}", flush=True)
        if d.scenario.nodes and no_netns:
            rows.append(skipped(d, f"needs network namespaces: {no_netns}"))
        else:
            rows.append(row(d, run_scenario(d, out / d.scenario.name, args.steps, args.deadline), reference))
        print(f"[chaos]   {rows[-1]['outcome']}" + (f": {rows[-1]['why']}" if rows[-1]["why"] else ""), flush=True)
        _write(out, seed, args.steps, reference, rows)
    print(f"\n{markdown(rows)}\n\n[chaos] written: {out / 'chaos.md'}, {out / 'chaos.json'}", flush=True)
    bad = failed(rows)
    if bad:
        print(f"[chaos] {len(bad)} scenario(s) FAILED: {', '.join(bad)}", flush=True)
    return 1 if bad else 0
