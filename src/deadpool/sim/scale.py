"""What one hot swap costs at a given world size and state size: a cost model per phase, fitted to our runs and
to published figures.

Phases of a swap (runtime/recovery.py; README.md, "How it works": Recovery), with N the world size in ranks
(GPUs) and S the state of the failed node that the spare takes over, in bytes:

    detect    crash: exit_notice_s (the node's agent sees the process exit);
              hang: the hang timeout the coordinator's own policy sets, max(3 s, 8 steps)
    decide    decide_s (the settle window that gathers a failure set, and the swap policy)
    report    report_s + report_per_rank_s * N (every rank stops and reports the snapshots it holds)
    rebuild   rebuild_s + rebuild_per_doubling_s * log2 N + rebuild_per_rank_s * N (one new communicator)
    transfer  S / link_bytes_per_s (the node's replicas, streamed from their holders to the spare)
    restore   (S / ranks per node) / restore_bytes_per_s (each rank loads its share, all in parallel)
    + half a step of lost work on average, redone after the swap (ClusterParams.swap_s adds it)

The transfer is counted in full: a spare's host memory holds the replicas of a few nodes only, so at scale most
replicas sit on peer worker nodes and must cross the network when a node dies. (In our single-kill runs the
taker held the replica and nothing was streamed; in our two-kill runs the stream is inside the report phase.)

Our own figures come from one 2-core machine running gloo over loopback (docs/benchmarks.md); we have no
multi-node measurement yet, so every coefficient that makes a phase grow with N or S at cluster scale is either
a published figure or an assumption, and says which.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace

from deadpool.coordinator.hangs import hang_timeout
from deadpool.sim.model import require

_SNAPSHOT_BYTES = 38.5e6  # one rank of the example GPT, the state our measured phases moved (docs/benchmarks.md)


@dataclass(frozen=True, kw_only=True)
class SwapCoefficients:
    """The coefficients of the phase costs above (seconds, bytes per second), validated when built."""

    source: str                    # where the numbers come from, in a line printed with the results
    exit_notice_s: float
    decide_s: float
    report_s: float
    report_per_rank_s: float
    rebuild_s: float
    rebuild_per_doubling_s: float
    rebuild_per_rank_s: float
    link_bytes_per_s: float
    restore_bytes_per_s: float

    def __post_init__(self) -> None:
        for name in ("exit_notice_s", "decide_s", "report_s", "report_per_rank_s", "rebuild_s",
                     "rebuild_per_doubling_s", "rebuild_per_rank_s"):
            require(name, getattr(self, name), zero_ok=True)
        for name in ("link_bytes_per_s", "restore_bytes_per_s"):
            require(name, getattr(self, name))


# Our control plane, medians of three SIGKILLs at 4 ranks (docs/benchmarks.md, "Recovery against the
# alternatives", 2026-12-01): detect 0.054 s, decide 0.061 s (0.05 s of it the settle window), report 0.104 s,
# rebuild 0.110 s, restore 0.046 s for one 38.5 MB snapshot.
_EXIT_NOTICE_S, _DECIDE_S, _REPORT_S, _GLOO_REBUILD_AT_4_S, _RESTORE_S = 0.054, 0.061, 0.104, 0.110, 0.046
# Kill -> next step at 2, 4 and 8 ranks, smallest model (same file, "Recovery against world size and state
# size", 2026-12-01): the least-squares slope, 0.0236 s per rank, is an upper bound on what the rebuild adds
# per rank, since it also holds the longer steps of more ranks sharing two cores.
_GLOO_PER_RANK_S = statistics.linear_regression([2, 4, 8], [0.22, 0.26, 0.36]).slope
# Two ranks killed at once, rank 2's replica streamed from spare s0 to s1 (same file, "Failure sets"): report
# took 0.168 s and 0.208 s against 0.104 s for a single kill, so 38.5 MB crossed loopback in 0.084 s on average.
_LOOPBACK_BYTES_PER_S = _SNAPSHOT_BYTES / ((0.168 + 0.208) / 2 - _REPORT_S)
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

NCCL_SHRINK = SwapCoefficients(
    source="ncclCommShrink fit to published figures; our control plane; links and PCIe assumed",
    exit_notice_s=_EXIT_NOTICE_S, decide_s=_DECIDE_S, report_s=_REPORT_S,
    report_per_rank_s=20e-6,        # assumed: one store request per rank, one coordinator thread at 50,000/s
    rebuild_s=_SHRINK_S, rebuild_per_doubling_s=_SHRINK_PER_DOUBLING_S, rebuild_per_rank_s=0.0,
    link_bytes_per_s=12.5e9,        # assumed: one 200 Gb/s NIC at half its line rate (TCP through host memory)
    restore_bytes_per_s=25e9,       # assumed: pinned host-to-device copies over PCIe 4.0 x16 (32 GB/s line rate)
)
NCCL_INIT = replace(NCCL_SHRINK, source="full NCCL init (shrink fit + a bootstrap term linear in N, calibrated "
                                        "to 265 s at 96K GPUs); our control plane; links and PCIe assumed",
                    rebuild_per_rank_s=_INIT_PER_RANK_S)
GLOO_HERE = SwapCoefficients(
    source="our gloo runs on 2 CPU cores: 4-rank phases, the rank-count slope, loopback streams",
    exit_notice_s=_EXIT_NOTICE_S, decide_s=_DECIDE_S, report_s=_REPORT_S,
    report_per_rank_s=0.0,          # inside the rank-count slope, which the rebuild carries
    rebuild_s=_GLOO_REBUILD_AT_4_S - 4 * _GLOO_PER_RANK_S, rebuild_per_doubling_s=0.0,
    rebuild_per_rank_s=_GLOO_PER_RANK_S,
    link_bytes_per_s=_LOOPBACK_BYTES_PER_S, restore_bytes_per_s=_SNAPSHOT_BYTES / _RESTORE_S,
)
SWAP_MODELS = {"nccl-shrink": NCCL_SHRINK, "nccl-init": NCCL_INIT, "gloo-here": GLOO_HERE}

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
    """The whole node's state crosses the spare's link."""
    return node_state_bytes / c.link_bytes_per_s


def restore_s(c: SwapCoefficients, node_state_bytes: float, ranks_per_node: int) -> float:
    """Each rank loads its own share onto its device, all at once."""
    return node_state_bytes / ranks_per_node / c.restore_bytes_per_s


def swap_phases(c: SwapCoefficients, *, ranks: int, ranks_per_node: int, node_state_bytes: float, step_s: float,
                hang_fraction: float = 0.0) -> dict[str, float]:
    """The phases of one swap in ClusterParams' field names (the half step of lost work is added there)."""
    require("node_state_bytes", node_state_bytes, zero_ok=True)
    if not 0 <= hang_fraction <= 1:
        raise ValueError(f"hang_fraction must lie in [0, 1], got {hang_fraction!r}")
    return {"detect_s": detect_s(c, step_s, hang_fraction), "decide_s": c.decide_s,
            "report_s": report_s(c, ranks), "rebuild_s": rebuild_s(c, ranks),
            "transfer_s": transfer_s(c, node_state_bytes),
            "restore_s": restore_s(c, node_state_bytes, ranks_per_node)}
