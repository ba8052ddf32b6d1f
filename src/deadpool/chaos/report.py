"""Judges each chaos scenario against the failure-free run and writes the matrix as a table: pure functions of
what the runner saw, so that the verdicts are tested without running a job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deadpool.chaos.scenarios import RECOVERED, Drawn

DOCUMENTED = "documented error"
FAILED = "FAILED"
SKIPPED = "skipped"
TRIGGERS = ("kill", "kill_node", "hang", "error")  # injected faults that start a scenario's clock


@dataclass
class Seen:
    """What the runner saw of one scenario: the first job's exit code (None: killed at its deadline; negative:
    the signal that ended it), summary and events; when the runner acted itself, the time it did
    (time.monotonic(), the events' clock); anything that went wrong on the runner's side; and the resumed job's
    exit code and summary for the scenarios that resume."""

    code: int | None
    summary: dict[str, Any]
    events: list[dict[str, Any]]
    t_action: float | None = None
    problem: str = ""
    resumed_code: int | None = None
    resumed: dict[str, Any] | None = None
    corrupted_step: int | None = None  # the checkpoint the runner damaged before resuming
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def fault_time(seen: Seen) -> float | None:
    """When the scenario's fault struck: the runner's own action, else the first fault the job injected."""
    if seen.t_action is not None:
        return seen.t_action
    return min((e["t"] for e in seen.events if e["event"] == "fault_injected" and e["kind"] in TRIGGERS),
               default=None)


def timings(seen: Seen) -> tuple[float | None, float | None]:
    """(detection, recovery) seconds from the fault: to the coordinator's first verdict (a failure detected, or
    the job failed), and to the first step completed after the recovery that followed (None without one)."""
    t = fault_time(seen)
    if t is None:
        return None, None
    after = [e for e in seen.events if e["t"] >= t]
    verdict = min((e["t"] for e in after if e["event"] in ("failure_detected", "job_failed")), default=None)
    swapped = min((e["t"] for e in after if e["event"] == "swap_complete"), default=None)
    step = None if swapped is None else min((e["t"] for e in after if e["event"] == "step" and e["t"] > swapped),
                                            default=None)
    return (None if verdict is None else verdict - t), (None if step is None else step - t)


def _spare_used(events: list[dict[str, Any]]) -> bool:
    return any(e["event"] in ("spare_called", "spare_activated", "failure_detected") for e in events)


def _same(summary: dict[str, Any], reference: dict[str, Any], losses: bool) -> bool:
    return (summary.get("rank_state_sha256") == reference["rank_state_sha256"]
            and (not losses or summary.get("losses") == reference["losses"]))


def verdict(drawn: Drawn, seen: Seen, reference: dict[str, Any]) -> tuple[str, str]:
    """(outcome, why): recovered bit for bit, the documented error, or FAILED and what went wrong."""
    error = seen.summary.get("error") or ""
    if seen.problem:
        return FAILED, seen.problem
    if drawn.expect:
        if seen.code != 1 or drawn.expect not in error:
            return FAILED, f"expected exit 1 with {drawn.expect!r}; got exit {seen.code}: {error or 'no error'}"
        if _spare_used(seen.events):
            return FAILED, "the script's error was treated as a node failure (a spare was used)"
        return DOCUMENTED, error.splitlines()[0].split(". ")[0]  # its first sentence: the table's cell
    unfired = [f for f in seen.summary.get("faults_not_fired", []) if not f.startswith("fault corrupt_replica")]
    if unfired:
        return FAILED, unfired[0]
    if drawn.scenario.action in ("term-launcher", "corrupt-checkpoint") and seen.code != 143:
        return FAILED, f"the launcher's exit after SIGTERM was {seen.code}, not 143: {error or 'no error'}"
    if drawn.scenario.resume:
        final, code = seen.resumed or {}, seen.resumed_code
        if code != 0:
            return FAILED, f"the resumed job ended with exit {code}: {final.get('error') or 'no error'}"
        start = (final.get("resumed_from") or {}).get("step")
        if start is None:
            return FAILED, "the resumed job started at step 0: nothing committed was kept"
        if seen.corrupted_step is not None and start >= seen.corrupted_step:
            return FAILED, f"resumed from step {start}, the damaged checkpoint {seen.corrupted_step} was not skipped"
    else:
        final, code = seen.summary, seen.code
        if code != 0:
            return FAILED, f"exit {code}: {error or 'no error recorded'}"
    if not _same(final, reference, losses=not drawn.scenario.resume):
        return FAILED, "ended, but not bit for bit equal to the failure-free run"
    return RECOVERED, ""


def steps_redone(drawn: Drawn, seen: Seen) -> int | None:
    """Finished steps run again: replayed after in-job recoveries, or, after a resume, the steps the first job
    had finished past the checkpoint it resumed from."""
    if not drawn.scenario.resume:
        return seen.summary.get("steps_replayed")
    start = ((seen.resumed or {}).get("resumed_from") or {}).get("step")
    done = max((e["step"] for e in seen.events if e["event"] == "step"), default=None)
    return None if start is None or done is None else max(0, done - start)


def _notes(seen: Seen) -> list[str]:
    """What the table's reader needs to trust the row: where the job restored from, what it refused."""
    notes = list(seen.notes)
    decided = [e for e in seen.events if e["event"] == "restore_decided" and e.get("target") is not None]
    if decided:
        notes.append(f"restored step {decided[-1]['target']}" + (" from disk" if decided[-1].get("from_disk") else ""))
    rejected = sorted({e["step"] for e in seen.events if e["event"] == "replica_rejected" and "step" in e})
    if rejected:
        notes.append(f"corrupt replica of step {', '.join(map(str, rejected))} rejected")
    if seen.resumed and seen.resumed.get("resumed_from"):
        notes.append(f"first job exit {seen.code}; resumed from step {seen.resumed['resumed_from']['step']}")
    return notes


def row(drawn: Drawn, seen: Seen, reference: dict[str, Any]) -> dict[str, Any]:
    """One scenario's line of chaos.json."""
    outcome, why = verdict(drawn, seen, reference)
    detect, recover = timings(seen)
    equal = None if outcome == DOCUMENTED else outcome == RECOVERED
    return {"scenario": drawn.scenario.name, "seed": drawn.seed, "what": drawn.what,
            "expected": drawn.expect or RECOVERED, "outcome": outcome, "why": why,
            "detect_s": detect, "fault_to_next_step_s": recover, "steps_redone": steps_redone(drawn, seen),
            "bit_for_bit": equal, "exit_code": seen.code, "resumed_exit_code": seen.resumed_code,
            "error": seen.summary.get("error"), "notes": _notes(seen), "wall_s": round(seen.wall_s, 1)}


def skipped(drawn: Drawn, why: str) -> dict[str, Any]:
    return {"scenario": drawn.scenario.name, "seed": drawn.seed, "what": drawn.what,
            "expected": drawn.expect or RECOVERED, "outcome": SKIPPED, "why": why, "detect_s": None,
            "fault_to_next_step_s": None, "steps_redone": None, "bit_for_bit": None, "exit_code": None,
            "resumed_exit_code": None, "error": None, "notes": [], "wall_s": 0.0}


def failed(rows: list[dict[str, Any]]) -> list[str]:
    """The scenarios that ended neither recovered bit for bit nor with their documented error."""
    return [r["scenario"] for r in rows if r["outcome"] == FAILED]


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict[str, Any]]) -> str:
    """The matrix as a markdown table: one line per scenario, FAILED and skipped ones with why."""
    head = ("scenario", "seed", "what was done", "outcome", "detect s", "fault → next step s", "steps redone",
            "bit for bit", "notes")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        outcome = r["outcome"] + (f": {r['why']}" if r["why"] else "")
        cells = (r["scenario"], r["seed"], r["what"], outcome, r["detect_s"], r["fault_to_next_step_s"],
                 r["steps_redone"], r["bit_for_bit"], "; ".join(r["notes"]) or None)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)
