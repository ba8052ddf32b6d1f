"""Goodput of three recovery strategies on 1,000-100,000 GPUs: closed-form expectations and a seeded Monte Carlo.

Failures. Every node fails as its own Poisson process, so the cluster sees one Poisson stream of node failures
at rate lambda = nodes / node MTTF. The default node MTTF makes a 1,024-GPU job fail every 7.9 h, as Meta
reported for its research clusters (Kokolis et al., arXiv 2410.21680), and the job MTTF scales as 1024 / gpus.
A failed node is always replaced, so lambda stays constant; idle spares are assumed not to fail. Times are in
seconds; goodput is useful training time / wall time (Meta's effective training time ratio).

Strategies (a failure stops the whole synchronous job unless said otherwise):

- checkpoint_restart: after every T s of work the job stalls C s to write a checkpoint. A failure loses the
  work since the last finished checkpoint and costs a restart of R s (reschedule, start, load), which a failure
  during it starts over. Exact for this model (Daly 2006): T s of work take on average
  E = exp(lambda R) (exp(lambda (T + C)) - 1) / lambda, so goodput = T / E, to first order
  1 - C / (T + C) - lambda (T / 2 + R). T defaults to Young/Daly's sqrt(2 C MTTF), at least one step.
- replica_drop (torchft style): the job is `groups` data-parallel replica groups of `replica_group_nodes`
  nodes. Assumptions: a failed node takes its whole group out until the node is replaced (spare_replenish_s)
  and other failures in a group that is already out cost nothing; the survivors carry on at throughput
  proportional to the groups up (a smaller global batch, whose effect on convergence is not modelled), after a
  stall of reconfig_s plus the discarded step (half a step on average); a returning group heals from a peer in
  the background, for free. Each group alternates Exp(g lambda_node) up and D down, so it is up a fraction
  u = 1 / (1 + g lambda_node D) of the time (exact); counted failures arrive at about lambda u, and a moment
  is stall-free when none arrived in the last s seconds: goodput ~= u exp(-lambda u s), off by O(1 / groups).
- hot_swap with S spares: a failure that finds an idle spare costs the recovery phases h (detect + decide +
  report + rebuild + transfer + resend + restore + replay of half a step; sim/scale.py prices them in the world size
  and the state size) and holds that spare for spare_replenish_s; one that
  finds none falls back to a restart from the disk tier, which is persisted every T s in the background (no
  stall), i.e. checkpoint_restart with C = 0. Closed form: with B the blocking probability below, swaps come at
  lambda (1 - B) and fallbacks at lambda B, and goodput ~= exp(-lambda (1 - B) h) * checkpoint_restart(lambda
  B, C = 0). Exact for S = 0 and as S grows; in between it treats the two streams as independent Poisson
  streams, whereas blocking comes in bursts whose restarts overlap, so it errs low (100,000 GPUs, 5 spares:
  0.45 where the Monte Carlo finds 0.50) and the Monte Carlo is the reference there.

Spares are an Erlang loss (M/G/S/S) system: failures arrive Poisson at lambda; one that finds an idle spare
holds it for D = spare_replenish_s; one that finds none is lost to the pool (the job restarts on a node the
scheduler provides) and is a stall. By PASTA the fraction of failures that stall is Erlang B(S, a = lambda D),
whatever the distribution of D. (The Poisson tail P(N >= S), N ~ Poisson(a), would be the answer only if a
stalled failure still took a spare.) Stalls per day, lambda * 86400 * B, bound P(a stall in a day) from above
(Markov), so `spares_needed` keeps that expectation under the target. That count does not depend on h: a
spare is held for D whatever the swap costs. What h changes is what a spare is worth: `spares_worth` is the
count that maximizes goodput per GPU paid for, idle spare nodes included.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

HOUR = 3600.0
DAY = 86400.0
STRATEGIES = ("checkpoint_restart", "replica_drop", "hot_swap")


def require(name: str, value: object, *, zero_ok: bool = False, inf_ok: bool = False) -> None:
    """Rejects a bad number at construction, naming the field, so a sweep never fails halfway."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not (value >= 0 if zero_ok else value > 0) or not (inf_ok or math.isfinite(value)):
        raise ValueError(f"{name} must be {'non-negative' if zero_ok else 'positive'}"
                         f"{'' if inf_ok else ' and finite'}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ClusterParams:
    """One cluster, its failure rate and its recovery costs (seconds), validated when built."""

    gpus: int
    gpus_per_node: int = 8
    mttf_hours_at_1024: float = 7.9        # job MTTF of 1,024 GPUs; math.inf: nothing ever fails
    step_s: float = 5.0
    detect_s: float = 0.07                 # hot-swap phases: medians of `deadpool demo` at 4 ranks on our 2-core
    decide_s: float = 0.001                # box (docs/benchmarks.md); `deadpool simulate` prices them per size
    report_s: float = 0.08                 # with sim/scale.py instead, and --phases-from takes your own
    rebuild_s: float = 0.12
    transfer_s: float = 0.0                # replicas streamed to the spare: none when it holds them already
    resend_s: float = 0.0                  # restored snapshots sent to holders placed anew: none when all stay
    restore_s: float = 0.02
    swap_cost_s: float | None = None       # the whole cost of a swap, to price one directly; None: swap_s below
    ckpt_interval_s: float | None = None   # work between checkpoints; None: Young/Daly
    ckpt_cost_s: float = 30.0              # training stall per checkpoint (checkpoint_restart only)
    restart_s: float = 300.0               # reschedule + process start + load
    spares: int = 8
    spare_replenish_s: float = 3600.0      # until a used spare (or a dropped node) is back
    reconfig_s: float = 5.0                # replica_drop: quorum + communicator rebuild
    replica_group_nodes: int = 1

    def __post_init__(self) -> None:
        for name, least in (("gpus", 1), ("gpus_per_node", 1), ("replica_group_nodes", 1), ("spares", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer of at least {least}, got {value!r}")
        if self.gpus % self.gpus_per_node:
            raise ValueError(f"gpus ({self.gpus}) must be a multiple of gpus_per_node ({self.gpus_per_node})")
        if self.nodes % self.replica_group_nodes:
            raise ValueError(f"{self.nodes} nodes do not split into replica groups of {self.replica_group_nodes}")
        require("mttf_hours_at_1024", self.mttf_hours_at_1024, inf_ok=True)
        for name in ("step_s", "spare_replenish_s"):
            require(name, getattr(self, name))
        for name in ("ckpt_interval_s", "swap_cost_s"):
            if getattr(self, name) is not None:
                require(name, getattr(self, name), zero_ok=name == "swap_cost_s")
        for name in ("detect_s", "decide_s", "report_s", "rebuild_s", "transfer_s", "resend_s", "restore_s",
                     "ckpt_cost_s", "restart_s", "reconfig_s"):
            require(name, getattr(self, name), zero_ok=True)

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def groups(self) -> int:
        return self.nodes // self.replica_group_nodes

    @property
    def failure_rate(self) -> float:
        """Cluster-wide node failures per second: nodes / node MTTF = gpus / (1024 * MTTF at 1,024)."""
        return self.gpus / (1024 * self.mttf_hours_at_1024 * HOUR)

    @property
    def mttf_s(self) -> float:
        return math.inf if self.failure_rate == 0 else 1.0 / self.failure_rate

    @property
    def interval_s(self) -> float:
        """Work between checkpoints: as given, or Young/Daly's optimum sqrt(2 C MTTF), but at least a step."""
        if self.ckpt_interval_s is not None:
            return self.ckpt_interval_s
        return max(self.step_s, math.sqrt(2 * self.ckpt_cost_s * self.mttf_s))

    @property
    def swap_s(self) -> float:
        """Hot-swap cost of one failure: swap_cost_s if given, else the recovery phases plus replaying half a
        step on average."""
        if self.swap_cost_s is not None:
            return self.swap_cost_s
        return (self.detect_s + self.decide_s + self.report_s + self.rebuild_s + self.transfer_s + self.resend_s
                + self.restore_s + self.step_s / 2)

    @property
    def drop_stall_s(self) -> float:
        """Replica-drop stall of one failure: reconfiguration plus the discarded half step."""
        return self.reconfig_s + self.step_s / 2


# ---- closed form -------------------------------------------------------------------------------------------

def _segment_goodput(rate: float, work_s: float, stall_s: float, restart_s: float) -> float:
    """Work / expected wall time of work_s + stall_s seconds that a failure restarts after restart_s (itself
    restarted by a failure): exact for Poisson failures. Computed in logs: at 100k GPUs exp() overflows."""
    if rate == 0:
        return 1.0 if math.isinf(work_s) else work_s / (work_s + stall_s)
    x = rate * (work_s + stall_s)
    log_time = x + math.log(-math.expm1(-x)) + rate * restart_s - math.log(rate)
    return math.exp(math.log(work_s) - log_time)


def erlang_b(servers: int, load: float) -> float:
    """Probability that a Poisson arrival finds all `servers` busy in a loss system offered `load` Erlangs
    (the stable recursion B(k) = a B(k-1) / (k + a B(k-1)), B(0) = 1)."""
    blocked = 1.0
    for k in range(1, servers + 1):
        blocked = load * blocked / (k + load * blocked)
    return blocked


def spare_load(p: ClusterParams) -> float:
    """Erlangs offered to the spare pool: failures per second times how long each holds a spare."""
    return p.failure_rate * p.spare_replenish_s


def stalls_per_day(p: ClusterParams) -> float:
    """Expected failures per day that find no idle spare; an upper bound on P(a stall in a day)."""
    return p.failure_rate * DAY * erlang_b(p.spares, spare_load(p))


def spares_needed(p: ClusterParams, per_day: float = 1e-3) -> int:
    """The fewest spares for which stalls_per_day < per_day (B falls with every spare, so the first is least)."""
    require("per_day", per_day)
    per_failure = per_day / (p.failure_rate * DAY) if p.failure_rate else math.inf
    load, servers, blocked = spare_load(p), 0, 1.0
    while blocked >= per_failure:
        servers += 1
        blocked = load * blocked / (servers + load * blocked)
    return servers


def checkpoint_restart_goodput(p: ClusterParams) -> float:
    """Exact: every failure costs the segment in flight and a restart."""
    return _segment_goodput(p.failure_rate, p.interval_s, p.ckpt_cost_s, p.restart_s)


def replica_drop_goodput(p: ClusterParams) -> float:
    """Up fraction of the groups (exact) times the stall-free fraction (Poisson approximation)."""
    up = 1.0 / (1.0 + p.replica_group_nodes * p.failure_rate / p.nodes * p.spare_replenish_s)
    return up * math.exp(-p.failure_rate * up * p.drop_stall_s)


def _hot_swap_goodput(p: ClusterParams, blocked: float) -> float:
    return (math.exp(-p.failure_rate * (1 - blocked) * p.swap_s)
            * _segment_goodput(p.failure_rate * blocked, p.interval_s, 0.0, p.restart_s))


def hot_swap_goodput(p: ClusterParams) -> float:
    """Swap stalls times checkpoint-restart at the rate of failures that find no spare (see the docstring)."""
    return _hot_swap_goodput(p, erlang_b(p.spares, spare_load(p)))


def _paid(p: ClusterParams, spares: int, blocked: float) -> float:
    return _hot_swap_goodput(p, blocked) * p.gpus / (p.gpus + spares * p.gpus_per_node)


def paid_goodput(p: ClusterParams) -> float:
    """Hot-swap goodput per GPU paid for: an idle spare node is gpus_per_node GPUs that train nothing."""
    return _paid(p, p.spares, erlang_b(p.spares, spare_load(p)))


def spares_worth(p: ClusterParams) -> int:
    """The spare count with the highest paid_goodput (the first, on a tie). A spare saves the failures it turns
    from restarts into swaps, so the dearer a swap, the less it saves: unlike the stall target of
    spares_needed, this count never rises with the per-failure cost h (d log paid_goodput / dh = lambda B(s),
    which falls with s). Exact: with s spares paid_goodput is at most gpus / (gpus + s * gpus_per_node), so the
    search stops where that bound no longer beats the best."""
    load, blocked = spare_load(p), 1.0
    best, best_paid, spares = 0, _paid(p, 0, blocked), 0
    while p.gpus / (p.gpus + (spares + 1) * p.gpus_per_node) > best_paid:
        spares += 1
        blocked = load * blocked / (spares + load * blocked)
        paid = _paid(p, spares, blocked)
        if paid > best_paid:
            best, best_paid = spares, paid
    return best


def analytic_goodput(p: ClusterParams) -> dict[str, float]:
    """The closed-form goodput of each strategy (see the module docstring for what is exact)."""
    return {"checkpoint_restart": checkpoint_restart_goodput(p), "replica_drop": replica_drop_goodput(p),
            "hot_swap": hot_swap_goodput(p)}


# ---- Monte Carlo -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    """A Monte Carlo mean over independent runs and its standard error, so a check knows how close is close."""

    mean: float
    stderr: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Estimate:
        values = np.asarray(samples, dtype=float)
        return cls(float(values.mean()), float(values.std(ddof=1) / math.sqrt(values.size)))


@dataclass(frozen=True)
class SimResult:
    """One cluster's Monte Carlo: goodput per strategy, and what the hot-swap spare pool went through."""

    goodput: dict[str, Estimate]
    blocked: Estimate          # fraction of failures that found no idle spare (Erlang B)
    stalls_per_day: Estimate   # such failures per day
    stall_days: Estimate       # fraction of whole days with at least one
    failures: int              # all runs together
    days: float                # all runs together


def _work_by(x: float, work_s: float, cycle_s: float) -> float:
    """Work done after x seconds of running through repeated cycles of work_s work, then a checkpoint."""
    return (x // cycle_s) * work_s + min(x % cycle_s, work_s)


def _job_work(times: np.ndarray, swapped: np.ndarray, horizon: float, interval_s: float, ckpt_cost_s: float,
              restart_s: float, swap_s: float) -> float:
    """Seconds of training a job keeps by the horizon. It checkpoints after every interval_s of work (stalling
    ckpt_cost_s); a swapped failure stalls it swap_s, any other loses the work since the last finished
    checkpoint and restarts (restart_s, started over by a failure during it)."""
    cycle = interval_s + ckpt_cost_s
    work = pos = resume = 0.0   # work kept; position in the cycle; when the job runs again
    restarting = False
    for t, swap in zip(times.tolist(), swapped.tolist()):
        if t >= resume:
            work += _work_by(pos + t - resume, interval_s, cycle) - _work_by(pos, interval_s, cycle)
            pos, restarting = (pos + t - resume) % cycle, False
        if swap:
            if not restarting:  # a spare taking a node's place does not disturb a restart
                resume = t + swap_s
        else:
            work -= min(pos, interval_s)
            pos, resume, restarting = 0.0, t + restart_s, True
    if horizon > resume:
        work += _work_by(pos + horizon - resume, interval_s, cycle) - _work_by(pos, interval_s, cycle)
    return work


def _replica_drop_work(times: np.ndarray, groups: np.ndarray, p: ClusterParams, horizon: float) -> float:
    """Seconds of whole-cluster training a job does by the horizon when it drops a failed node's replica group
    until the node is replaced, and stalls everyone for reconfiguration at each drop."""
    down_until = [-1.0] * p.groups
    back: deque[float] = deque()   # when dropped groups return; all take as long, so in order
    up, now, stall_end, work = p.groups, 0.0, 0.0, 0.0
    for t, group in zip(times.tolist(), groups.tolist()):
        while back and back[0] <= t:
            work += up * max(0.0, back[0] - max(now, stall_end))
            now, up = back.popleft(), up + 1
        if down_until[group] > t:
            continue
        work += up * max(0.0, t - max(now, stall_end))
        now, up, stall_end = t, up - 1, t + p.drop_stall_s
        down_until[group] = t + p.spare_replenish_s
        back.append(down_until[group])
    for returned, t in enumerate([b for b in back if b < horizon] + [horizon]):
        work += (up + returned) * max(0.0, t - max(now, stall_end))
        now = t
    return work / p.groups


def _spare_pool(times: np.ndarray, spares: int, replenish_s: float) -> np.ndarray:
    """Which failures find an idle spare; the one taken is back replenish_s later (so spares return in order)."""
    busy: deque[float] = deque()
    found = np.zeros(times.size, dtype=bool)
    for i, t in enumerate(times.tolist()):
        while busy and busy[0] <= t:
            busy.popleft()
        if len(busy) < spares:
            busy.append(t + replenish_s)
            found[i] = True
    return found


def simulate(p: ClusterParams, days: float = 30.0, runs: int = 4, seed: int = 0) -> SimResult:
    """Monte Carlo over `runs` independent horizons of `days`, deterministic given `seed`. One failure stream
    per run drives all three strategies (common random numbers), so their differences are sharper than their
    values. Each run starts with every node up and every spare idle."""
    require("days", days)
    if days < 1:
        raise ValueError(f"days must be at least 1, got {days!r}")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 2:
        raise ValueError(f"runs must be an integer of at least 2 (for a standard error), got {runs!r}")
    rng = np.random.default_rng(seed)
    horizon, whole_days = days * DAY, int(days)
    goodput: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    blocked, per_day, stall_days, failures = [], [], [], 0
    for _ in range(runs):
        times = np.sort(rng.uniform(0.0, horizon, rng.poisson(p.failure_rate * horizon)))
        groups = rng.integers(0, p.nodes, times.size) // p.replica_group_nodes
        swapped = _spare_pool(times, p.spares, p.spare_replenish_s)
        never = np.zeros(times.size, dtype=bool)
        goodput["checkpoint_restart"].append(
            _job_work(times, never, horizon, p.interval_s, p.ckpt_cost_s, p.restart_s, 0.0) / horizon)
        goodput["replica_drop"].append(_replica_drop_work(times, groups, p, horizon) / horizon)
        goodput["hot_swap"].append(
            _job_work(times, swapped, horizon, p.interval_s, 0.0, p.restart_s, p.swap_s) / horizon)
        stalls = times[~swapped]
        blocked.append(stalls.size / times.size if times.size else 0.0)
        per_day.append(stalls.size / days)
        stall_days.append(np.unique(stalls[stalls < whole_days * DAY] // DAY).size / whole_days)
        failures += times.size
    return SimResult(goodput={name: Estimate.of(v) for name, v in goodput.items()}, blocked=Estimate.of(blocked),
                     stalls_per_day=Estimate.of(per_day), stall_days=Estimate.of(stall_days), failures=failures,
                     days=days * runs)
