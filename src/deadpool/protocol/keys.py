"""The names processes share: every store key of a job, and the environment that carries a process's identity.

Recovery, as the store sees it (a set F of ranks fails in generation g; g+1 replaces it):

    coordinator                        survivors / takers / holders
    -----------                        ----------------------------
    exits or hang verdicts, settled
    set plan/{g+1}, gen=g+1,
    set abort/{g}            ------->  collective fails or abort/{g} seen; generation g torn down
                                       holders stream each taken rank's replica to its taker
                                       (g{g+1}/xfer/{rank}/), when they are not the same process
                             <-------  g{g+1}/ready/{rank} = intact snapshot steps
    choose restore step C
    set g{g+1}/committed, target -->   join group g{g+1}, restore C, agree on (C, checksum)
                             <-------  g{g+1}/resumed/{rank}
    set running/{g+1}                  (holders drop replicas of ranks they no longer hold)

In steady state each rank reports g{g}/durable/{rank} (its durable snapshot steps) and the coordinator
alone writes g{g}/committed. Every key of a generation carries its number, so nothing of g can be
mistaken for g+1; every key carries the job's secret token in its prefix.
"""

from __future__ import annotations

import re

# Process identity travels in the environment; everything else is in the config file it names.
ENV_CONFIG, ENV_PROC, ENV_ROLE = "DEADPOOL_CONFIG", "DEADPOOL_PROC", "DEADPOOL_ROLE"
CONFIG_KEY = "deadpool/job"  # the job's config as JSON, unprefixed: what an agent reads first (launcher/node.py)
ENV_DEVICE = "DEADPOOL_DEVICE"  # this process's GPU index, empty for none (coordinator/policy.place_devices)


def torchrun_env(rank: int, world_size: int, nproc_per_node: int = 0, gpu: int | None = None) -> dict[str, str]:
    """The identity torchrun gives a process, which scripts read from the environment. On nodes of
    `nproc_per_node` processes the local rank is the place on the node (rank r runs on node r // nproc, and
    the spare that takes r over has the same place on its own node); on one machine local = global. A
    spare starts with a placeholder rank >= world_size; deadpool.init() sets the rank it takes.

    A process that trains on a GPU gets that GPU's index (`gpu`, as CUDA_VISIBLE_DEVICES orders them) as its
    LOCAL_RANK instead, so that a script's `device = f"cuda:{LOCAL_RANK}"` names the GPU the process uses,
    which for a spare that took a rank on a GPU of its own is not the failed rank's (README "Devices").
    Workers are unaffected: worker r's GPU is its place on the node (coordinator/policy.place_devices).
    LOCAL_WORLD_SIZE stays the number of ranks per node, so such a taker's LOCAL_RANK may exceed it."""
    local, local_world = (rank % nproc_per_node, nproc_per_node) if nproc_per_node else (rank, world_size)
    return {"RANK": str(rank), "LOCAL_RANK": str(local if gpu is None else gpu), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world)}


# The reports the coordinator waits on, by name under the job's prefix: a rank's durable steps, ready or resumed;
# a process's start, script error or exit (its own, or its node agent's report); a node joining; a checkpoint
# writer's part. Each wakes the coordinator as it is written (coordinator/server.py).
REPORTS = re.compile(r"g\d+/(durable|ready|resumed)/|(started|error|exited)/|node/\d+/exit/|nodes/joined$"
                     r"|persist/report/")


class Keys:
    """Every store key of a job, under a prefix that carries the job's secret token."""

    def __init__(self, token: str) -> None:
        self.prefix = f"deadpool/{token}/"

    def _k(self, name: str) -> str:
        return self.prefix + name

    def is_report(self, key: str) -> bool:
        """Whether `key` is a report the coordinator waits on (REPORTS), not a heartbeat, a replica stream's
        address or anything else it reads at its own pace."""
        return key.startswith(self.prefix) and REPORTS.match(key, len(self.prefix)) is not None

    # membership
    def generation(self) -> str:
        return self._k("gen")

    def plan(self, gen: int) -> str:
        return self._k(f"plan/{gen}")

    def abort(self, gen: int) -> str:
        return self._k(f"abort/{gen}")

    def running(self, gen: int) -> str:
        """Set when generation `gen` finished recovering: its replica placement is now the live one."""
        return self._k(f"running/{gen}")

    def shutdown(self) -> str:
        return self._k("shutdown")

    def status(self) -> str:
        """The job-status record (protocol/status.py), rewritten by the coordinator whenever it changes."""
        return self._k("status")

    # per process, across generations
    def started(self, proc: str) -> str:
        """Set by deadpool.init(): a process that exits without it failed before DeadPool ran."""
        return self._k(f"started/{proc}")

    def heartbeat(self, proc: str) -> str:
        return self._k(f"hb/{proc}")

    def alive(self, proc: str) -> str:
        """A counter the process's beacon adds to (runtime/watch.Beacon); absent until it first beats."""
        return self._k(f"alive/{proc}")

    def device(self, proc: str) -> str:
        """The GPU a process trains on: a spare without one of its own takes the device of the rank it replaces."""
        return self._k(f"device/{proc}")

    def fence(self, proc: str) -> str:
        """Set by the coordinator: the agent running `proc` SIGKILLs it."""
        return self._k(f"fence/{proc}")

    # node agents (launcher/node.py, coordinator/nodes.py)
    def node(self, node: int) -> str:
        return self._k(f"node/{node}")

    def node_claim(self, node: int) -> str:
        """A counter: the agent that adds the first one is node `node`'s; any other with that number is refused."""
        return self._k(f"node/{node}/claim")

    def nodes_joined(self) -> str:
        """A counter: each agent that joins a running job as a spare node (`--spare`) adds one and takes the
        next node number after the job's own nodes."""
        return self._k("nodes/joined")

    def node_beat(self, node: int) -> str:
        """A counter the node's agent adds to while it lives."""
        return self._k(f"node/{node}/beat")

    def node_spawn(self, node: int, index: int) -> str:
        """The agent's `index`-th order (from 1, without gaps): it reads the next until it is absent."""
        return self._k(f"node/{node}/spawn/{index}")

    def node_exit(self, node: int, proc: str) -> str:
        return self._k(f"node/{node}/exit/{proc}")

    def node_pid(self, proc: str) -> str:
        return self._k(f"pid/{proc}")

    def exited(self, proc: str) -> str:
        """Set by a process that no launcher started as it exits (runtime/standalone.py): its exit code and pid."""
        return self._k(f"exited/{proc}")

    def script_error(self, proc: str) -> str:
        return self._k(f"error/{proc}")

    # data planes get their own prefixes, one per generation, so stale peers never meet new ones
    def group_prefix(self, gen: int) -> str:
        return self._k(f"g{gen}/pg/")

    def pair_prefix(self, gen: int, rank: int, holder: str) -> str:
        return self._k(f"g{gen}/rep/{rank}/{holder}/")

    def transfer_prefix(self, gen: int, rank: int) -> str:
        return self._k(f"g{gen}/xfer/{rank}/")

    @staticmethod
    def listening(stream: str) -> str:
        """Where a replica stream's sender listens, under the stream's prefix (pair or transfer)."""
        return f"{stream}addr"

    @staticmethod
    def handover(stream: str) -> str:
        """How many snapshots a transfer stream carries (recovery: holder -> taker)."""
        return f"{stream}count"

    # commit tracking: ranks report, the coordinator alone commits
    def durable(self, gen: int, rank: int) -> str:
        return self._k(f"g{gen}/durable/{rank}")

    def committed(self, gen: int) -> str:
        return self._k(f"g{gen}/committed")

    # recovery
    def ready(self, gen: int, rank: int) -> str:
        return self._k(f"g{gen}/ready/{rank}")

    def target(self, gen: int) -> str:
        return self._k(f"g{gen}/target")

    def resumed(self, gen: int, rank: int) -> str:
        return self._k(f"g{gen}/resumed/{rank}")

    # the disk tier (protocol/records.py): the coordinator orders, each writer reports its part
    def persist_order(self) -> str:
        return self._k("persist/order")

    def persisted(self, proc: str) -> str:
        """A writer's report on the latest order it took, rewritten in place (its step is in the record): a
        key per checkpoint would pile up in the store over a month of them."""
        return self._k(f"persist/report/{proc}")

    # faults fire once per job, whoever runs the rank
    def fault_fired(self, index: int) -> str:
        return self._k(f"fault/{index}")

