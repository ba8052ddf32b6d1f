"""Pure decisions of the coordinator: each returns what to do and why. No I/O, no threads, no torch.

The coordinator's loop (server.py) gathers the inputs, calls these, applies the decision and logs its
reason: how a process ended (classify_exit), who replaces whom (plan_after_failures), which step is
committed (commit_step), which step to restore (choose_restore_step), how spares that join enter the pool
(plan_after_join) and whether to wait for one (wait_for_spare); and, for the launcher, which GPU each process
gets (place_devices). Who is hung: hangs.py; whether data-parallel replicas still agree: divergence.py.
"""

from __future__ import annotations

import signal
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Callable, Generic, Mapping, TypeVar

from deadpool.protocol.kinds import ExitKind
from deadpool.protocol.plan import Plan

T = TypeVar("T")


@dataclass(frozen=True)
class Decision(Generic[T]):
    """A policy's answer: `value` is None when there is nothing that can be done, and `reason` says why."""

    value: T | None
    reason: str

    @property
    def ok(self) -> bool:
        return self.value is not None


def describe_exit(returncode: int) -> str:
    """Says how a process ended, the way a user reads it (Popen gives -N for signal N)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


# ---- how a process ended -------------------------------------------------------------------

FINISHED, SCRIPT_ERROR, FAILURE = ExitKind.FINISHED, ExitKind.SCRIPT_ERROR, ExitKind.FAILURE


def classify_exit(returncode: int, *, fenced: bool, started: bool, script_error: str | None,
                  lost_with_node: str | None = None) -> Decision[str]:
    """A node failure is what a spare can fix; a bug in the script would only be replayed into again.

    - exit code 0: the process finished;
    - an error the runtime reported as the script's own (an exception outside the communication layer),
      or a non-zero exit before deadpool.init() (syntax error, bad import, bad arguments): script error;
    - death by a signal, a fence after a hang, or any other non-zero exit: a failure of that process;
    - no exit at all, because its node was lost (its agent stopped): a failure.
    """
    if lost_with_node is not None:
        return Decision(FAILURE, f"lost with {lost_with_node}")
    if returncode == 0:
        return Decision(FINISHED, "exited with code 0")
    if script_error is not None and not fenced:
        return Decision(SCRIPT_ERROR, f"the training script raised {script_error}")
    if returncode > 0 and not started:
        return Decision(SCRIPT_ERROR, f"the training script {describe_exit(returncode)} before deadpool.init()")
    if fenced:
        return Decision(FAILURE, "hung, and fenced (SIGKILL)")
    return Decision(FAILURE, describe_exit(returncode))


# ---- who replaces whom ---------------------------------------------------------------------

Placement = tuple[tuple[str, ...], ...]  # rank -> the processes holding its replica


def place_replicas(ranks: tuple[str, ...], spares: tuple[str, ...], replicas: int, nodes: Mapping[str, int],
                   previous: Placement = ()) -> Decision[Placement]:
    """Who holds each rank's snapshots: `replicas` processes, none on the rank's own node (a node
    failure takes all of its processes at once). Spares first, since they have nothing else to do; peer
    workers when spares run short (the pool ran empty), paying host memory and some of their cores.
    Holders on nodes not used yet for the rank come before a second one on the same node.

    With no `previous` placement (job start), rank r starts from the r-th candidate off its node within
    each kind, so the load spreads evenly (rank r -> spare r mod S; two ranks of a lost node go to two
    different peers). After a change of membership (`previous`: the holders of the steady plan, by
    rank), every previous holder that these rules still allow stays, because a new one must first be sent
    the restored snapshot, on the recovery's critical path; only the missing holders are filled, the
    least loaded candidates first.

    `nodes` maps a process to its node; a process not in it is a machine of its own (one host)."""
    def node(proc: str) -> object:
        return nodes.get(proc, proc)

    def rotate(procs: tuple[str, ...], k: int) -> list[str]:
        return [procs[(k + j) % len(procs)] for j in range(len(procs))]

    kept = ([_still_valid(owner, old, ranks, spares, replicas, node) for owner, old in zip(ranks, previous)]
            if previous else [()] * len(ranks))
    load = Counter(h for held in kept for h in held)
    holders, short = [], []
    for r, owner in enumerate(ranks):
        chosen = list(kept[r])
        peers = tuple(p for p in ranks if node(p) != node(owner))
        for kind in (rotate(spares, r), rotate(peers, r)):
            if previous:
                kind.sort(key=load.__getitem__)  # stable: among equals, the rotation decides
            for distinct in (True, False):
                for proc in kind:
                    used = {node(c) for c in chosen}
                    if (len(chosen) < replicas and proc not in chosen and node(proc) != node(owner)
                            and not (distinct and node(proc) in used)):
                        chosen.append(proc)
                        load[proc] += 1
        holders.append(tuple(chosen))
        if len(chosen) < replicas:
            short.append(r)
    shortage = (f"ranks {short} have fewer than {replicas} holder(s): no more processes off their nodes"
                if short else "")
    if not previous:
        return Decision(tuple(holders), shortage or f"{replicas} holder(s) per rank, spares first")
    new = {r: [h for h in held if h not in old] for r, (held, old) in enumerate(zip(holders, previous))}
    moved = {r: held for r, held in new.items() if held}
    kept_text = ("holders kept for every rank" if not moved else
                 f"holders kept for {len(ranks) - len(moved)} of {len(ranks)} ranks; "
                 + ", ".join(f"rank {r} gets {' and '.join(held)}" for r, held in moved.items()))
    return Decision(tuple(holders), "; ".join(filter(None, (kept_text, shortage))))


def _still_valid(owner: str, old: tuple[str, ...], ranks: tuple[str, ...], spares: tuple[str, ...], replicas: int,
                 node: Callable[[str], object]) -> tuple[str, ...]:
    """The holders in `old` that place_replicas' rules still allow for the rank now run by `owner`: alive
    (an idle spare, or a rank), never on the owner's node (nor the owner itself: a spare that took the
    rank it held), and a peer worker only as far as the idle spares off that node cannot provide the
    copies (a spare that took another rank is such a peer now)."""
    peer_room = replicas - sum(1 for s in spares if node(s) != node(owner))
    valid: list[str] = []
    for h in old:
        if node(h) == node(owner) or (h not in spares and h not in ranks):
            continue
        if h in ranks:
            if peer_room <= 0:
                continue
            peer_room -= 1
        valid.append(h)
    return tuple(valid)


def place_devices(workers: int, spares: int, gpus: int) -> Decision[tuple[int | None, ...]]:
    """The GPU of each process on a node (workers first, then spares, in spawn order); None: no GPU.

    NCCL allows one rank per GPU, so every worker needs its own. Spares take the GPUs left over, so a
    spare that is called uses its own device and never lands on the failed one (which may be broken).
    A spare left without one holds replicas in host memory only and, when called, takes the GPU of the
    rank it replaces, which that rank's dead process has freed (the same host: runtime/session.py)."""
    if gpus == 0:
        return Decision(tuple([None] * (workers + spares)), "no GPU: every process trains on the CPU (gloo)")
    if gpus < workers:
        return Decision(None, f"{workers} workers need {workers} GPUs (NCCL runs one rank per GPU) but the node has "
                              f"{gpus}: use --workers {gpus}, --gpus-per-node, or --backend gloo")
    own = min(spares, gpus - workers)
    devices = (*range(workers), *range(workers, workers + own), *[None] * (spares - own))
    if own == spares:
        return Decision(devices, f"one GPU per process: workers on 0..{workers - 1}, spares on their own")
    return Decision(devices, f"{spares - own} of {spares} spares have no GPU of their own: they hold replicas in "
                             "host memory and take over the GPU of the rank they replace")


def initial_plan(world_size: int, spares: tuple[str, ...], replicate: bool = True, replicas: int = 1,
                 nodes: Mapping[str, int] | None = None) -> Plan:
    """Worker r is rank r; with snapshots off (replicate=False) nobody holds anything."""
    ranks = tuple(f"w{r}" for r in range(world_size))
    nodes = dict(nodes or {})
    holders = place_replicas(ranks, spares, replicas, nodes).value if replicate else ((),) * world_size
    assert holders is not None
    return Plan(generation=0, ranks=ranks, holders=holders, spares=spares, replicate=replicate, replicas=replicas,
                nodes=nodes)


def node_map(workers: int, spares: int, nproc_per_node: int) -> dict[str, int]:
    """Which node each process starts on: worker r on node r // R, spare i on the i // R-th spare node
    (after the worker nodes). Empty on one machine (nproc_per_node 0)."""
    if not nproc_per_node:
        return {}
    worker_nodes = workers // nproc_per_node
    return {**{f"w{r}": r // nproc_per_node for r in range(workers)},
            **{f"s{i}": worker_nodes + i // nproc_per_node for i in range(spares)}}


def plan_after_failures(steady: Plan, generation: int, lost: frozenset[str],
                        disk_step: int | None = None) -> Decision[Plan]:
    """The next plan after every process in `lost` is gone, or None and why the job cannot go on.

    `steady` is the last plan that finished recovering: its holders are the ones that really hold
    replicas (a plan still recovering has placed nothing yet), so failures that pile up during a
    recovery are planned from it, as one set. Each lost rank goes to a live spare, preferably one
    that holds its replica; otherwise a live holder streams the replica to the taker (`sources`).
    A lost idle spare shrinks the pool; it needs a new generation (everyone rolls back to the last
    commit) only if it held replicas, which are then placed anew. `generation` is the newest one
    published; the new plan gets the next number, or the same one when nothing needs rebuilding.
    A lost rank with no live holder is taken over all the same when checkpoint `disk_step` is on disk:
    every rank then restores it, in place (machine._choose_target).
    """
    pool = [s for s in steady.spares if s not in lost]
    dead = [r for r, p in enumerate(steady.ranks) if p in lost]
    ranks, moves = list(steady.ranks), []
    sources: list[str | None] = [None] * steady.world_size
    orphans = [r for r in dead if not any(h not in lost for h in steady.holders[r])]
    if orphans and (disk_step is None or not steady.replicate):
        who = ", ".join(f"{steady.ranks[r]} (rank {r})" for r in orphans)
        held = sorted({h for r in orphans for h in steady.holders[r]})
        its, replica = ("its", "replica") if len(orphans) == 1 else ("their", "replicas")
        why = f"snapshots are off (--snapshot-every 0), so nobody holds {its} state" if not steady.replicate else (
            f"every holder of {its} {replica} ({', '.join(held) or 'none'}) is lost too; "
            f"--replicas {steady.replicas + 1} keeps one more copy of each rank, on another node")
        return Decision(None, f"{who} failed and {why}")
    for rank in dead:
        live = [h for h in steady.holders[rank] if h not in lost]
        if not pool:
            return Decision(None, f"{steady.ranks[rank]} (rank {rank}) failed and no spare is left in the pool")
        taker = next((h for h in live if h in pool), pool[0])
        pool.remove(taker)
        ranks[rank] = taker
        sources[rank] = live[0] if live and taker not in live else None  # no live holder: it restores from disk
        moves.append(f"{taker} takes rank {rank}" + ("" if sources[rank] is None else f" (from {live[0]}'s replica)"))
    lost_spares = [s for s in steady.spares if s in lost]
    if dead:
        failed = ", ".join(f"{steady.ranks[r]} (rank {r})" for r in dead)
        reason = f"{failed} failed; {', '.join(moves)}"
        if orphans:
            reason += (f"; no live holder of rank{'s' if len(orphans) > 1 else ''} {', '.join(map(str, orphans))}: "
                       f"every rank restores step {disk_step} from disk")
    else:
        reason = f"spare {', '.join(lost_spares)} lost; {len(pool)} left"
    rebuild = bool(dead) or generation != steady.generation or any(steady.held_by(s) for s in lost_spares)
    holders = steady.holders  # without a new generation (an idle spare lost), nothing moves
    if rebuild and steady.replicate:  # valid holders stay; the reason names the ranks that get new ones
        placed = place_replicas(tuple(ranks), tuple(pool), steady.replicas, steady.nodes, steady.holders)
        assert placed.value is not None
        holders, reason = placed.value, f"{reason}; {placed.reason}"
    new = Plan(generation=generation + rebuild, ranks=tuple(ranks), holders=holders,
               spares=tuple(pool), reason=reason, replicate=steady.replicate, sources=tuple(sources) if dead else (),
               replicas=steady.replicas, nodes=steady.nodes, fresh=fresh_holders(steady, holders))
    return Decision(new, reason)


def fresh_holders(steady: Plan, holders: Placement) -> Placement:
    """Per rank, its holders in `holders` that did not hold it under `steady`: they hold nothing of it
    yet. The old holders drop their copies once the new generation runs, so the restored snapshot must
    reach these first (Plan.fresh)."""
    fresh = tuple(tuple(h for h in new if h not in old) for new, old in zip(holders, steady.holders))
    return fresh if any(fresh) else ()


# ---- the pool over time --------------------------------------------------------------------

def node_spares(node: int, workers: int, nproc_per_node: int) -> dict[str, int]:
    """The spares of spare node `node`, named as node_map names them (spare i runs on node workers / R +
    i // R), each with the placeholder rank it starts as (world size + i: RemoteNodes runs rank r on node
    r // R). A node that joins a running job gets the next number, hence the next names."""
    first = (node - workers // nproc_per_node) * nproc_per_node
    return {f"s{i}": workers + i for i in range(first, first + nproc_per_node)}


def extend_pool(plan: Plan, new_spares: Mapping[str, int]) -> Plan:
    """`plan` with spares that hold nothing yet (process -> node) at the end of its pool: what failures
    are planned from while they join (its holders are still the ones that hold replicas)."""
    return replace(plan, spares=(*plan.spares, *new_spares), nodes={**plan.nodes, **new_spares})


def plan_after_join(steady: Plan, generation: int, new_spares: Mapping[str, int]) -> Decision[Plan]:
    """The next plan once the spares of nodes that joined the running job have started (`new_spares`:
    process -> node): the same ranks, the pool extended. Spares that hold replicas keep them (moving
    them would only cost resends); replicas that peer workers held because the pool had run short move
    to the newcomers, which gives the workers their memory and cores back. Holders are fixed for a
    generation, so this takes a new one, in which everyone restores the last commit, as after a lost
    holder; it is published even when no holder moves, since the newcomers learn from the plan that they
    are in the pool (spare.py). With snapshots off nobody holds anything: the pool grows in place, in the
    same one."""
    if not new_spares:
        return Decision(None, "no spare joined")
    pool = extend_pool(steady, new_spares)
    nodes = sorted(set(new_spares.values()))
    joined = (f"spare node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))} joined "
              f"({', '.join(new_spares)}); {len(pool.spares)} spare(s) in the pool")
    if not steady.replicate:
        return Decision(replace(pool, sources=(), reason=joined), f"{joined}; snapshots are off, nothing to place")
    holders = place_replicas(pool.ranks, pool.spares, steady.replicas, pool.nodes, steady.holders)
    assert holders.value is not None  # placement always answers; `reason` says when holders run short
    reason = f"{joined}; {holders.reason}"
    return Decision(replace(pool, generation=generation + 1, holders=holders.value, sources=(), reason=reason,
                            fresh=fresh_holders(steady, holders.value)), reason)


def lost_by_node(steady: Plan, lost: frozenset[str]) -> dict[int | None, list[int]]:
    """The lost ranks of `steady`, grouped by node (None: no nodes, one machine)."""
    found: dict[int | None, list[int]] = {}
    for rank, proc in enumerate(steady.ranks):
        if proc in lost:
            found.setdefault(steady.nodes.get(proc), []).append(rank)
    return found


SPARE_AWAITED, NO_SPARE = "spare_awaited", "no_spare"


def wait_for_spare(steady: Plan, lost: frozenset[str], waited_s: float, spare_wait_s: float) -> Decision[str]:
    """When lost ranks outnumber the live spares: wait for a spare node to join (SPARE_AWAITED) for up to
    --spare-wait, or stop (NO_SPARE); the reason names the lost ranks by node. None when waiting is not
    the question: the pool suffices, or a lost rank has no live holder of its replica, which a newcomer,
    holding nothing, could not restore (stop at once, with plan_after_failures' reason)."""
    dead = [r for r, p in enumerate(steady.ranks) if p in lost]
    orphans = [r for r in dead if not any(h not in lost for h in steady.holders[r])]
    if orphans:
        return Decision(None, f"ranks {orphans} have no live holder of their replica: a spare that joins could "
                              "not restore them")
    pool = [s for s in steady.spares if s not in lost]
    if len(dead) <= len(pool):
        return Decision(None, "the pool has a spare for every lost rank")
    groups = [f"{'node ' + str(node) if node is not None else 'this machine'} "
              f"(rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
              for node, ranks in lost_by_node(steady, lost).items()]
    left = f"only {len(pool)} spare(s) are" if pool else "no spare is"
    short = f"{' and '.join(groups)} {'were' if len(groups) > 1 else 'was'} lost and {left} left in the pool"
    if spare_wait_s <= 0:
        return Decision(NO_SPARE, f"{short} (--spare-wait 0: no spare node is awaited)")
    if waited_s >= spare_wait_s:
        return Decision(NO_SPARE, f"{short}, and no spare node joined within --spare-wait {spare_wait_s:g} s")
    return Decision(SPARE_AWAITED, f"{short}: waiting up to {spare_wait_s - waited_s:.1f} s for a spare node to join")


# ---- commits -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Durable:
    """One rank's report as the commit rule sees it (the wire record is protocol/records.Durable): the snapshot
    steps it holds durably (local copy + every holder's ack), and the ones it skipped (--backlog-policy skip),
    which can therefore never be committed."""

    steps: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()
    fingerprints: Mapping[int, int] = field(default_factory=dict)  # data parallel: step -> replicated state's hash
    audits: Mapping[int, tuple[int, int]] = field(default_factory=dict)  # sliced: step -> (rank, its piece's hash)


def commit_step(committed: int | None, reports: Mapping[int, Durable]) -> Decision[int]:
    """The newest step every rank holds durably, if newer than the last commit."""
    if not reports:
        return Decision(None, "no ranks report")
    common = set.intersection(*(set(r.steps) for r in reports.values()))
    newer = [s for s in common if committed is None or s > committed]
    if not newer:
        return Decision(None, "no newer step is durable on every rank")
    return Decision(max(newer), f"step {max(newer)} is durable on all {len(reports)} ranks")


def awaited_reports(reports: Mapping[int, Durable], world: int) -> frozenset[int]:
    """The ranks that must report again before a newer step can be committed or its replicas compared (both
    need a step every rank holds): those lacking the newest step any rank holds, else every rank. The shell
    wakes for a durable report only once all of these have written one (coordinator/server.py)."""
    held = {rank: set(reports[rank].steps) if rank in reports else set() for rank in range(world)}
    newest = max((step for steps in held.values() for step in steps), default=None)
    return frozenset(rank for rank, steps in held.items() if newest not in steps) or frozenset(range(world))


def abandoned_steps(committed: int | None, reports: Mapping[int, Durable]) -> list[int]:
    """Steps some rank skipped: no rank needs to keep them, since they can never be committed."""
    return sorted({s for r in reports.values() for s in r.skipped if committed is None or s > committed})


# ---- restore -------------------------------------------------------------------------------

def choose_restore_step(committed: int | None, holdings: Mapping[int, list[int]]) -> Decision[int]:
    """The newest step, no newer than the last commit, that every rank holds intact.

    `holdings` maps each rank of the new generation to the snapshot steps it can restore
    (a survivor's local slots, or a taker's replica slots, received from their holder).
    """
    if committed is None:
        return Decision(None, "no snapshot was committed yet")
    common = set.intersection(*(set(steps) for steps in holdings.values())) if holdings else set()
    usable = sorted(s for s in common if s <= committed)
    if not usable:
        listing = ", ".join(f"rank {r}: {sorted(s)}" for r, s in sorted(holdings.items()))
        return Decision(None, f"no snapshot at or before committed step {committed} is intact on every rank "
                              f"({listing})")
    step = usable[-1]
    why = f"restore committed step {step}" if step == committed else (
        f"committed step {committed} is not intact everywhere; fall back to step {step}")
    return Decision(step, why)
