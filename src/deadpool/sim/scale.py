"""What one hot swap costs at a given world size and state size: a cost model per phase, fitted to our runs and
to published figures, each coefficient marked measured, fitted, published or assumed.

Phases of a swap (runtime/recovery.py; README.md, "How it works": Recovery), with N the world size in ranks
(GPUs) and S the state of the failed node that the spare takes over, in bytes:

    detect    crash: exit_notice_s (the node's agent sees the process exit);
              hang: the hang timeout the coordinator's own policy sets, max(3 s, 8 steps)
    decide    decide_s (the settle window that gathers a failure set, and the swap policy)
    report    report_s + report_per_rank_s * N (every rank stops and reports the snapshots it holds; the
              coordinator takes N records and reads them back)
    rebuild   rebuild_s + rebuild_per_doubling_s * log2 N + rebuild_per_rank_s * N (one new communicator)
    transfer  transfer_s + 2 S / link_bytes_per_s (the node's replicas, streamed from their holder to the spare:
              send_replica streams every snapshot the holder keeps of a rank, both slots once two are sealed)
    resend    transfer_s + S / link_bytes_per_s * fabric (ranks whose holder is gone send their restored
              snapshot to a new one before the generation runs; see below)
    restore   (S / ranks per node) / restore_bytes_per_s (each rank loads its share, all in parallel)
    + half a step of lost work on average, redone after the swap (ClusterParams.swap_s adds it)

Holders are taken to be peer worker nodes, each holding one other node's replicas (one copy each): a spare's
host memory holds the replicas of a few nodes only, so at scale most replicas sit on workers. Placement:

- sticky (the coordinator's policy, coordinator/policy.place_replicas): holders that are still valid stay.
  The lost node's own replicas stay with their holder, which streams them to the taker (transfer); the
  replicas the lost node held are orphaned, and their owner resends its state, one node's worth over one
  link (resend, fabric = 1).
- placed anew (`sticky=False`, what the coordinator did before): every rank gets a holder of a new plan and
  every node resends at once. Each link still carries one node's state, but the fabric carries all of them:
  the share that crosses pods, 1 - pod_gpus / N, goes through uplinks oversubscribed pod_oversubscription
  times, so fabric = max(1, pod_oversubscription * (1 - pod_gpus / N)).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from deadpool.coordinator.hangs import hang_timeout
from deadpool.sim.model import require

MARKS = ("measured", "fitted", "published", "assumed")
SLOTS_STREAMED = 2  # snapshots of a rank a holder streams to its taker (runtime/replica.send_replica)


@dataclass(frozen=True, kw_only=True)
class SwapCoefficients:
    """The coefficients of the phase costs above (seconds, bytes per second), validated when built; `marks`
    says of each whether we measured it, fitted it to our runs, took it from a publication or assumed it."""

    source: str                    # where the numbers come from, in a line printed with the results
    exit_notice_s: float
    decide_s: float
    report_s: float
    report_per_rank_s: float
    rebuild_s: float
    rebuild_per_doubling_s: float
    rebuild_per_rank_s: float
    transfer_s: float
    link_bytes_per_s: float
    restore_bytes_per_s: float
    pod_gpus: float
    pod_oversubscription: float
    marks: Mapping[str, str]

    def __post_init__(self) -> None:
        for name in ("exit_notice_s", "decide_s", "report_s", "report_per_rank_s", "rebuild_s",
                     "rebuild_per_doubling_s", "rebuild_per_rank_s", "transfer_s"):
            require(name, getattr(self, name), zero_ok=True)
        for name in ("link_bytes_per_s", "restore_bytes_per_s", "pod_gpus", "pod_oversubscription"):
            require(name, getattr(self, name))
        unmarked = [name for name in COEFFICIENTS if self.marks.get(name) not in MARKS]
        if unmarked:
            raise ValueError(f"{', '.join(unmarked)} must be marked one of {', '.join(MARKS)}")


COEFFICIENTS = tuple(f.name for f in fields(SwapCoefficients) if f.name not in ("source", "marks"))

# Our runs of 2026-12-02 (docs/benchmarks.md, "Goodput at cluster scale", "The coefficients, measured"):
# `python scripts/bench_sim_fit.py`, whole-node SIGKILLs at 2-16 nodes in network namespaces, fitted by
# sim/fit.py; coordinator_per_rank_s is the store benchmark of the same script (the server's CPU per put + the poll
# per key, median of 3 at load 4-5, 67-84 µs). `--fit FILE` replaces them.
FIT_2026_12_02 = {"exit_notice_s": 0.0169, "decide_s": 0.0651, "report_s": 0.0332, "report_per_rank_s": 0.00889,
                  "rebuild_s": 0.0, "rebuild_per_rank_s": 0.0457, "transfer_s": 0.00710, "link_bytes_per_s": 3.94e8,
                  "restore_bytes_per_s": 4.74e8, "coordinator_per_rank_s": 7.2e-5}
# ncclCommShrink, published: 1.5 s at 32 GPUs and 2.0 s at 1,024 (quoted in our design notes, which are not in
# this repository, without the measurement's source; we have not reproduced them): 1.0 s + 0.1 s per doubling.
_SHRINK_PER_DOUBLING_S = (2.0 - 1.5) / (math.log2(1024) - math.log2(32))
_SHRINK_S = 1.5 - _SHRINK_PER_DOUBLING_S * math.log2(32)
# A full NCCL initialization at 96K GPUs took about 265 s (stock NCCL, reported with NCCLX, arXiv 2510.20171;
# read in a summary of the paper, not checked against its text). Modelled as the shrink's cost plus a bootstrap
# term linear in N, calibrated to that one point: 2.67 ms per rank.
_INIT_CALIBRATION_N, _INIT_CALIBRATION_S = 96 * 1024, 265.0
_INIT_PER_RANK_S = (_INIT_CALIBRATION_S - _SHRINK_S - _SHRINK_PER_DOUBLING_S * math.log2(_INIT_CALIBRATION_N)) \
    / _INIT_CALIBRATION_N
# Llama 3's training fabric (arXiv 2407.21783, section 3.3.1, quoted from memory, not checked in its text
# here): pods of 3,072 GPUs with full bisection bandwidth, joined by an aggregation layer oversubscribed 1:7.
_POD_GPUS, _POD_OVERSUBSCRIPTION = 3072.0, 7.0


def swap_models(fit: Mapping[str, float]) -> dict[str, SwapCoefficients]:
    """The three models priced with a fit's coefficients (FIT_2026_12_02 or a --fit file). The NCCL models keep
    the published rebuild, and assumed link and PCIe rates: loopback between namespaces on one machine cannot
    stand in for a 200 Gb/s NIC or a host-to-device copy, only for our protocol's fixed costs and for the
    coordinator's cost per rank. `gloo-here` takes every term from the fit: our protocol on this machine."""
    ours = {"exit_notice_s": "measured", "decide_s": "measured", "report_s": "fitted", "transfer_s": "fitted",
            "pod_gpus": "published", "pod_oversubscription": "published"}
    shrink = SwapCoefficients(
        source="our control plane (fitted and measured in network namespaces); ncclCommShrink fit to published "
               "figures; link and PCIe assumed",
        exit_notice_s=fit["exit_notice_s"], decide_s=fit["decide_s"], report_s=fit["report_s"],
        report_per_rank_s=fit["coordinator_per_rank_s"],  # the coordinator's serial share: one process at scale too
        rebuild_s=_SHRINK_S, rebuild_per_doubling_s=_SHRINK_PER_DOUBLING_S, rebuild_per_rank_s=0.0,
        transfer_s=fit["transfer_s"],
        link_bytes_per_s=12.5e9,        # assumed: one 200 Gb/s NIC at half its line rate (TCP through host memory)
        restore_bytes_per_s=25e9,       # assumed: pinned host-to-device copies over PCIe 4.0 x16 (32 GB/s line rate)
        pod_gpus=_POD_GPUS, pod_oversubscription=_POD_OVERSUBSCRIPTION,
        marks=ours | {"report_per_rank_s": "measured", "rebuild_s": "published", "rebuild_per_doubling_s":
                      "published", "rebuild_per_rank_s": "published", "link_bytes_per_s": "assumed",
                      "restore_bytes_per_s": "assumed"})
    init = replace(shrink, source="our control plane; full NCCL init (shrink fit + a bootstrap term linear in N, "
                                  "calibrated to 265 s at 96K GPUs); link and PCIe assumed",
                   rebuild_per_rank_s=_INIT_PER_RANK_S)
    gloo = SwapCoefficients(
        source="every term fitted to our gloo runs in network namespaces on 2 loaded CPU cores",
        exit_notice_s=fit["exit_notice_s"], decide_s=fit["decide_s"], report_s=fit["report_s"],
        report_per_rank_s=fit["report_per_rank_s"], rebuild_s=fit["rebuild_s"], rebuild_per_doubling_s=0.0,
        rebuild_per_rank_s=fit["rebuild_per_rank_s"], transfer_s=fit["transfer_s"],
        link_bytes_per_s=fit["link_bytes_per_s"], restore_bytes_per_s=fit["restore_bytes_per_s"],
        pod_gpus=_POD_GPUS, pod_oversubscription=_POD_OVERSUBSCRIPTION,
        marks=ours | dict.fromkeys(("report_per_rank_s", "rebuild_s", "rebuild_per_rank_s", "link_bytes_per_s",
                                    "restore_bytes_per_s"), "fitted") | {"rebuild_per_doubling_s": "assumed"})
    return {"nccl-shrink": shrink, "nccl-init": init, "gloo-here": gloo}


SWAP_MODELS = swap_models(FIT_2026_12_02)

# 65B parameters (the paper's largest model) x 14 bytes (bf16 weights, fp32 master weights, two fp32 Adam
# moments) over 64 nodes of 8 GPUs (its largest cluster, 512 GPUs): 14.2 GB per node. Held as N grows: a larger
# job trains a larger model, and a node's state is bounded by its memory.
DEFAULT_NODE_STATE_BYTES = 65e9 * 14 / 64


def detect_s(c: SwapCoefficients, step_s: float, hang_fraction: float) -> float:
    """A crash is seen at once; a hang only when the coordinator's hang timeout for this step time runs out
    (the very policy function the coordinator calls). The mean over a fraction of hangs."""
    timeout = hang_timeout(None, [step_s]).value
    assert timeout is not None, "hang_timeout always answers once a step is timed"
    return (1 - hang_fraction) * c.exit_notice_s + hang_fraction * timeout


def report_s(c: SwapCoefficients, ranks: int) -> float:
    """The coordinator waits to hear from every rank, one request each."""
    return c.report_s + c.report_per_rank_s * ranks


def rebuild_s(c: SwapCoefficients, ranks: int) -> float:
    """Trees and rings set up in log N rounds; a bootstrap all-gather or gloo's full mesh costs each rank N."""
    return c.rebuild_s + c.rebuild_per_doubling_s * math.log2(ranks) + c.rebuild_per_rank_s * ranks


def transfer_s(c: SwapCoefficients, node_state_bytes: float) -> float:
    """The whole node's state, both slots of it, crosses the spare's link."""
    return c.transfer_s + SLOTS_STREAMED * node_state_bytes / c.link_bytes_per_s


def fabric_factor(c: SwapCoefficients, ranks: int) -> float:
    """How much slower than one link every node resending at once goes: the cross-pod share through the
    oversubscribed uplinks, never faster than a link."""
    return max(1.0, c.pod_oversubscription * (1.0 - c.pod_gpus / ranks))


def resend_s(c: SwapCoefficients, node_state_bytes: float, ranks: int, sticky: bool = True) -> float:
    """Restored snapshots sent to new holders: the orphans of the lost node (sticky), or every node's (anew)."""
    fabric = 1.0 if sticky else fabric_factor(c, ranks)
    return c.transfer_s + node_state_bytes / c.link_bytes_per_s * fabric


def restore_s(c: SwapCoefficients, node_state_bytes: float, ranks_per_node: int) -> float:
    """Each rank loads its own share onto its device, all at once."""
    return node_state_bytes / ranks_per_node / c.restore_bytes_per_s


def swap_phases(c: SwapCoefficients, *, ranks: int, ranks_per_node: int, node_state_bytes: float, step_s: float,
                hang_fraction: float = 0.0, sticky: bool = True) -> dict[str, float]:
    """The phases of one swap in ClusterParams' field names (the half step of lost work is added there)."""
    require("node_state_bytes", node_state_bytes, zero_ok=True)
    if not 0 <= hang_fraction <= 1:
        raise ValueError(f"hang_fraction must lie in [0, 1], got {hang_fraction!r}")
    return {"detect_s": detect_s(c, step_s, hang_fraction), "decide_s": c.decide_s,
            "report_s": report_s(c, ranks), "rebuild_s": rebuild_s(c, ranks),
            "transfer_s": transfer_s(c, node_state_bytes),
            "resend_s": resend_s(c, node_state_bytes, ranks, sticky),
            "restore_s": restore_s(c, node_state_bytes, ranks_per_node)}
