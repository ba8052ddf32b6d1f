"""The chaos matrix as data: each scenario's fault, what the runner does to the job, what must come out; and the
seeded draw of each one's timing (step, phase, ranks), so that a scenario's seed alone reproduces it."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from deadpool.config import Fault
from deadpool.errors import ConfigError

WORKERS = 4
STEP_PHASES = ("step_start", "forward", "backward", "after_optimizer", "snapshot_copy", "replicate")
TRAINING_PHASES = ("step_start", "forward", "backward")  # where an error is raised in the script's own thread
RECOVERED = "recovered bit for bit"


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """One row of the matrix. `plan` faults are injected by the job itself (`--fault`), exactly at a phase of a
    step; `action` is done to the job from outside by the runner (signals, a cut link, a damaged file), after the
    job committed the drawn step. `expect` is the documented error that must end the job ("" = it must end bit
    for bit equal to the failure-free run); `resume` runs `--resume auto` after the first job is gone.
    `what` says what is done, with {rank}, {other}, {step} and {phase} of the draw filled in."""

    name: str
    what: str
    plan: str = ""  # kill, kill2, hang, error, kill_node, corrupt+kill, kill+hang-in-recovery, kill-0+3
    action: str = ""  # see runner.ACTIONS
    phases: tuple[str, ...] = ("backward",)
    spares: int = 1
    options: tuple[str, ...] = ()  # more `deadpool run` options
    persist_every: int = 0  # > 0: a --persist-dir, a checkpoint every N commits
    slow_s: float = 0.0  # each forward pass slowed by this (the numbers are untouched): time for the runner to act
    nodes: bool = False  # 2 worker nodes of 2 ranks and a spare node, each in a network namespace
    resume: bool = False
    expect: str = ""


CATALOG: tuple[Scenario, ...] = (
    *(Scenario(name=f"kill-{phase}", what="SIGKILL rank {rank} in " + phase + " of step {step}", plan="kill",
               phases=(phase,)) for phase in STEP_PHASES),
    Scenario(name="kill-two", what="SIGKILL ranks {rank} and {other} at once, {phase} of step {step}", plan="kill2",
             phases=STEP_PHASES, spares=2),
    Scenario(name="hang", what="SIGSTOP rank {rank} in {phase} of step {step}", plan="hang", phases=STEP_PHASES),
    # the kill in the step's own thread: one in a background phase (a snapshot's copy) strikes while the survivors
    # are already in the next step, which the recovery then names, and the hang planned for this step never fires
    Scenario(name="hang-in-recovery", plan="kill+hang-in-recovery", phases=TRAINING_PHASES, spares=2,
             what="SIGKILL rank {rank} in {phase} of step {step}, SIGSTOP rank {other} during the recovery"),
    Scenario(name="hung-holder", action="stop-holder", spares=2, slow_s=0.2,
             what="SIGSTOP the spare holding rank {rank}'s replica after commit {step}"),
    Scenario(name="spare-death", action="kill-holder", spares=2, slow_s=0.2,
             what="SIGKILL the spare holding rank {rank}'s replica after commit {step}"),
    Scenario(name="script-error", what="an exception in the script on rank {rank}, {phase} of step {step}",
             plan="error", phases=TRAINING_PHASES,
             expect="error in the training script on rank {rank} (w{rank}) at step {step}: raised InjectedError"),
    Scenario(name="kill-at-start", action="kill-at-start", spares=1,
             what="SIGKILL rank {rank} {delay:.1f} s after it was spawned (start-up)"),
    Scenario(name="corrupt-replica", plan="corrupt+kill", phases=STEP_PHASES,
             what="flip a byte of rank {rank}'s replica of step {before}, SIGKILL it in {phase} of step {step}"),
    Scenario(name="rank-and-holders-disk", action="kill-rank-and-holders", spares=2, persist_every=2, slow_s=0.2,
             what="SIGKILL rank {rank} and every holder of its replica after checkpoint {step} (disk fallback)"),
    Scenario(name="holder-mid-transfer", plan="kill-0+3", action="kill-source", phases=STEP_PHASES, spares=3,
             persist_every=2, slow_s=0.1,
             what="SIGKILL ranks 0 and 3 ({phase} of step {step}), then their holder as it streams a replica"),
    Scenario(name="coordinator-death-resume", action="kill-launcher", persist_every=1000, slow_s=0.2, resume=True,
             what="SIGKILL the launcher (coordinator) after commit {step}, then --resume auto"),
    Scenario(name="sigterm-resume", action="term-launcher", persist_every=3, slow_s=0.2, resume=True,
             what="SIGTERM the launcher after commit {step}, then --resume auto"),
    Scenario(name="corrupt-checkpoint-resume", action="corrupt-checkpoint", persist_every=2, slow_s=0.2,
             resume=True, options=("--keep", "3"),
             what="SIGTERM after commit {step}, flip a byte of the newest checkpoint, then --resume auto"),
    Scenario(name="cut-link", action="cut-link", nodes=True, spares=2, slow_s=0.2,
             options=("--node-timeout", "3"), what="cut the link of rank {rank}'s node after commit {step}"),
    Scenario(name="kill-node", plan="kill_node", phases=STEP_PHASES, nodes=True, spares=2,
             what="SIGKILL rank {rank}'s whole node (agent and ranks), {phase} of step {step}"),
)
NAMES = tuple(s.name for s in CATALOG)


@dataclass(frozen=True)
class Drawn:
    """A scenario with its timing drawn: `step` is the step the fault strikes (plan) or the commit (checkpoint,
    for the disk scenario) after which the runner acts; `delay` is kill-at-start's seconds after the spawn."""

    scenario: Scenario
    seed: int
    step: int
    phase: str
    rank: int
    other: int
    delay: float

    @property
    def what(self) -> str:
        return self.scenario.what.format(rank=self.rank, other=self.other, step=self.step, phase=self.phase,
                                         before=self.step - 1, delay=self.delay)

    @property
    def expect(self) -> str:
        return self.scenario.expect.format(rank=self.rank, step=self.step)

    def faults(self) -> tuple[Fault, ...]:
        """The faults the job injects itself (`--fault`), at the drawn step and phase."""
        kind, step, phase = self.scenario.plan, self.step, self.phase
        if kind == "kill2":
            return tuple(Fault(kind="kill", rank=r, step=step, phase=phase) for r in (self.rank, self.other))
        if kind == "kill-0+3":  # both held by s0 of 3 spares: one of them is streamed to another spare
            return tuple(Fault(kind="kill", rank=r, step=step, phase=phase) for r in (0, 3))
        if kind == "corrupt+kill":
            return (Fault(kind="corrupt_replica", rank=self.rank, step=step - 1),
                    Fault(kind="kill", rank=self.rank, step=step, phase=phase))
        if kind == "kill+hang-in-recovery":
            return (Fault(kind="kill", rank=self.rank, step=step, phase=phase),
                    Fault(kind="hang", rank=self.other, step=step, phase="recovery"))
        return (Fault(kind=kind, rank=self.rank, step=step, phase=phase),) if kind else ()


def scenario_seed(seed: int, name: str) -> int:
    """Each scenario's own seed, from the run's: stable across Python versions and independent of the other
    scenarios chosen, so `NAME@SEED` replays one scenario alone."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "big")


def draw(scenario: Scenario, seed: int, steps: int) -> Drawn:
    """The scenario's timing from its seed alone. A fault strikes between step 3 and steps - 3 (snapshots and
    replicas are flowing, and steps are left to recover into); the runner acts between commits 2 and steps - 5,
    leaving it the time to act before the job ends; with a disk tier from step 5, after a checkpoint."""
    rng = random.Random(seed)
    if steps < 10:
        raise ConfigError(f"the chaos matrix needs at least 10 steps, got {steps}")
    low = 5 if scenario.persist_every else 3 if scenario.plan else 2  # with a disk tier: a checkpoint first
    high = steps - 3 if scenario.plan else steps - 5
    step = rng.randint(low, high)
    phase = rng.choice(scenario.phases)
    rank, other = rng.sample(range(WORKERS), 2)
    return Drawn(scenario, seed, step, phase, rank, other, round(rng.uniform(0.1, 5.0), 1))


def select(text: str, seed: int, steps: int) -> list[Drawn]:
    """--scenarios: "all", or names separated by commas, each optionally NAME@SEED to replay one draw."""
    wanted = NAMES if text == "all" else tuple(t.strip() for t in text.split(",") if t.strip())
    by_name = {s.name: s for s in CATALOG}
    drawn = []
    for item in wanted:
        name, _, own = item.partition("@")
        if name not in by_name or (own and not own.isdigit()):
            raise ConfigError(f"--scenarios: {item!r} is not NAME or NAME@SEED; the names: {', '.join(NAMES)}")
        drawn.append(draw(by_name[name], int(own) if own else scenario_seed(seed, name), steps))
    return drawn
