"""Nodes: one agent per node (real processes, each node its own process group), a whole node SIGKILLed at
once (its agent and every rank on it), and one spare node taking over all of its ranks in one generation.
Every run must end on the failure-free run's exact state (the `reference` fixture: the same 4 ranks,
trained without nodes), with the same losses and the same samples."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deadpool.config import Fault
from deadpool.launcher.netns import available
from deadpool.protocol.secret import new_secret, write_secret
from tests.integration.conftest import REPO, SCRIPTS, SMALL, TRAIN, Background, Job, run_job

NODES = dict(workers=4, spares=2, nproc_per_node=2)  # 2 worker nodes of 2 ranks, 1 spare node of 2 spares


def assert_same_training(job: Job, reference: Job) -> None:
    assert job.code == 0, job.summary["error"]
    assert job.summary["final_state_sha256"] == reference.summary["final_state_sha256"]
    assert job.summary["losses"] == reference.summary["losses"]
    assert job.batches() == reference.batches()


def node_of(job: Job, proc: str) -> int:
    return next(e["node"] for e in job.named("process_spawned") if e["proc"] == proc)


@pytest.mark.parametrize("phase", ["snapshot_copy"])  # backward: test_sharded.py, and the netns tests
def test_a_whole_node_dies_and_one_spare_node_takes_all_its_ranks(tmp_path, reference, phase):
    job = run_job(tmp_path, faults=(Fault(kind="kill_node", rank=2, step=6, phase=phase),), **NODES)
    assert_same_training(job, reference)  # nodes train exactly as one machine does, failure or not
    [joined] = job.named("nodes_joined")
    assert joined["nodes"] == 3 and len(set(joined["agent_pids"])) == 3  # three real agents
    assert [node_of(job, p) for p in ("w0", "w1", "w2", "w3", "s0", "s1")] == [0, 0, 1, 1, 2, 2]
    [recovery] = job.summary["recoveries"]
    assert recovery["fault"] == "kill_node" and recovery["failed_ranks"] == [2, 3]
    assert recovery["replaced"] == {"2": "s0", "3": "s1"}  # both on spare node 2
    assert len(job.named("plan_published")) == 2  # one new generation for the whole node: one rebuild
    failures = job.named("failure_detected")
    assert {f["proc"] for f in failures} == {"w2", "w3"}
    assert all("lost with node 1" in f["exit"] for f in failures)


def test_one_rank_of_a_node_dies_and_a_spare_takes_it(tmp_path, reference, capfd):
    """Also what the agents print: each line prefixed with its node and process; a spare's only once it took a
    rank (its banner, held in its log till then, comes first), an idle spare's never (slow_steps.py prints a
    banner before init, pausing 0 s)."""
    job = run_job(tmp_path, faults=(Fault(kind="kill", rank=1, step=5, phase="backward"),), **NODES,
                  script=SCRIPTS / "slow_steps.py", script_prefix=("0",), echo=sys.stdout)
    assert_same_training(job, reference)
    [recovery] = job.summary["recoveries"]
    assert recovery["failed_ranks"] == [1] and recovery["replaced"] == {"1": "s1"}  # the spare holding its replica
    banner = "slow_steps: every forward pass of the GPT paused 0 s ({})"
    out = capfd.readouterr().out.splitlines()
    assert f"[n0:w0] {banner.format('w0')}" in out and f"[n1:w3] {banner.format('w3')}" in out
    assert not [line for line in out if line.startswith(("[n2:s0", "[n2:s1]"))]  # idle: never on the console
    assert [line for line in out if line.startswith("[n2:s1=r1] ")][0] == f"[n2:s1=r1] {banner.format('s1')}"
    assert banner.format("s0") in (tmp_path / "logs" / "s0.log").read_text()  # held in its log


def test_two_nodes_fail_apart_and_together_with_two_spare_nodes(tmp_path, reference):
    apart = run_job(tmp_path / "apart", workers=4, spares=4, nproc_per_node=2,
                    faults=(Fault(kind="kill_node", rank=0, step=3), Fault(kind="kill_node", rank=2, step=7)))
    assert_same_training(apart, reference)
    assert [r["replaced"] for r in apart.summary["recoveries"]] == [{"0": "s0", "1": "s1"}, {"2": "s2", "3": "s3"}]
    together = run_job(tmp_path / "together", workers=4, spares=4, nproc_per_node=2,
                       faults=(Fault(kind="kill_node", rank=0, step=5), Fault(kind="kill_node", rank=3, step=5)))
    assert_same_training(together, reference)
    [recovery] = together.summary["recoveries"]
    assert sorted(recovery["failed_ranks"]) == [0, 1, 2, 3]
    assert len(together.named("plan_published")) == 2


def test_a_spare_node_dies_then_a_worker_node_uses_the_other(tmp_path, reference):
    """The agent of spare node 2 alone is SIGKILLed while its spares receive replicas: they die with it (as
    with their machine); the workers roll back and re-place their replicas on spare node 3; a later
    whole-node failure moves to node 3."""
    job = Background(tmp_path, workers=4, spares=4, nproc_per_node=2,
                     faults=(Fault(kind="kill_node", rank=2, step=8),))
    events = job.wait_for(lambda e: e["event"] == "step" and e["step"] >= 3)
    [joined] = [e for e in events if e["event"] == "nodes_joined"]
    os.kill(joined["agent_pids"][2], signal.SIGKILL)
    done = job.join()
    assert_same_training(done, reference)
    spares = {e["proc"]: e["pid"] for e in done.named("process_start") if e["proc"] in ("s0", "s1")}
    for pid in spares.values():  # gone with their agent, not orphaned
        assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower()
    first, second = done.summary["recoveries"]
    assert first["replaced"] == {} and "lost with node 2" in first["cause"]
    assert second["replaced"] == {"2": "s2", "3": "s3"}  # spare node 3


# ---- the pool over time: spare nodes that join a running job ------------------------------------------------

def _join_as_spare(events: list[dict], run_dir: Path) -> subprocess.Popen:
    """Starts `deadpool agent --spare` against the job's coordinator, as a new machine would (with the job's
    secret, as its operator would give it)."""
    [start] = [e for e in events if e["event"] == "job_start"]
    return subprocess.Popen([sys.executable, "-m", "deadpool.launcher.cli", "agent", "--coordinator",
                             f"127.0.0.1:{start['port']}", "--spare", "--secret-file", str(run_dir / "secret")],
                            cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stopped(agent: subprocess.Popen) -> int | None:
    try:
        return agent.wait(30)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(10)


def test_a_spare_node_joins_after_the_pool_ran_empty_and_a_later_node_failure_uses_it(tmp_path, reference):
    """Node 1 dies and spare node 2 takes its ranks: the pool is empty. A new machine joins as spare node 3
    (`deadpool agent --spare`); the job places its replicas there in a new generation. Then node 0 dies as
    a whole, and node 3 takes ranks 0 and 1 from its replicas. Steps are slowed (a sleep in each forward
    pass, until node 0 is killed: same numbers) so that the join fits in the run."""
    killed = tmp_path / "killed"
    job = Background(tmp_path, **NODES, script=SCRIPTS / "slow_steps.py", script_prefix=("1.5", "--until", str(killed)),
                     faults=(Fault(kind="kill_node", rank=2, step=2),))
    events = job.wait_for(lambda e: e["event"] == "swap_complete")
    agent = _join_as_spare(events, tmp_path)
    try:
        events = job.wait_for(lambda e: e["event"] == "pool_refilled")
        [joined] = [e for e in events if e["event"] == "nodes_joined"]
        os.killpg(joined["agent_pids"][0], signal.SIGKILL)  # node 0: its agent and both of its ranks
        killed.touch()
        done = job.join()
    finally:
        code = _stopped(agent)
    assert_same_training(done, reference)
    assert code == 0  # the joined agent ends with the job
    [spare_node] = done.named("spare_node_joined")
    assert spare_node["node"] == 3 and spare_node["procs"] == ["s2", "s3"]
    [refill] = done.summary["pool_refills"]
    assert refill["nodes"] == [3] and refill["spares"] == ["s2", "s3"]
    first, second = done.summary["recoveries"]
    assert first["replaced"] == {"2": "s0", "3": "s1"} and second["replaced"] == {"0": "s2", "1": "s3"}
    assert {node_of(done, p) for p in ("s2", "s3")} == {3}


def test_with_no_spare_left_the_job_waits_for_a_spare_node_and_recovers_with_it(tmp_path, reference):
    """Two worker nodes and no spare node: node 1 dies, the coordinator waits (--spare-wait) and says how to
    add a machine; one joins, and its spares take ranks 2 and 3, streamed from the workers that held them."""
    job = Background(tmp_path, workers=4, spares=0, nproc_per_node=2, spare_wait_s=90.0,
                     faults=(Fault(kind="kill_node", rank=2, step=4),))
    events = job.wait_for(lambda e: e["event"] == "spare_awaited")
    agent = _join_as_spare(events, tmp_path)
    try:
        done = job.join()
    finally:
        code = _stopped(agent)
    assert_same_training(done, reference)
    assert code == 0
    [awaited] = done.named("spare_awaited")
    assert awaited["nodes"] == [1] and awaited["ranks"] == [2, 3]
    [recovery] = done.summary["recoveries"]
    assert recovery["replaced"] == {"2": "s0", "3": "s1"}
    assert {e["of_rank"]: e["proc"] for e in done.named("replica_handed_over")} == {2: "w0", 3: "w1"}


def test_with_no_spare_left_and_none_joining_the_job_stops_naming_the_node_ranks_and_step(tmp_path):
    job = run_job(tmp_path, workers=4, spares=0, nproc_per_node=2, spare_wait_s=1.0,
                  faults=(Fault(kind="kill_node", rank=2, step=4),))
    assert job.code == 1
    [stopped] = job.named("no_spare")
    committed = stopped["committed"]
    assert committed == job.named("commit")[-1]["step"] < 4  # the last commit before node 1 died in step 4
    assert 0.9 < stopped["waited_s"] < 10
    assert job.summary["error"].startswith(
        "node 1 (ranks 2, 3) was lost and no spare is left in the pool, and no spare node joined within "
        f"--spare-wait 1 s. Last committed step: {committed}. To go on from a lost node, start `deadpool agent "
        f"--coordinator 127.0.0.1:")
    assert "--spare` on a healthy machine within --spare-wait, or run with more --spare-nodes." in job.summary["error"]


def test_coordinator_and_agents_started_apart(tmp_path, reference):
    """The multi-host shape on one machine: `deadpool coordinator` alone, then one `deadpool agent` per node."""
    port = _free_port()
    out = tmp_path / "run"
    secret = str(write_secret(tmp_path / "secret", new_secret()))  # made by the operator, shared with every node
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "deadpool.launcher.cli", "coordinator", "--nnodes", "2", "--nproc-per-node", "2",
         "--spare-nodes", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--secret-file", secret, "--out", str(out),
         str(TRAIN),
         "--steps", "10", *SMALL], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    agents = []
    try:
        time.sleep(1.0)  # the agents may also start first: they wait for the coordinator
        agents = [subprocess.Popen([sys.executable, "-m", "deadpool.launcher.cli", "agent", "--coordinator",
                                    f"127.0.0.1:{port}", "--node-rank", str(n), "--secret-file", secret],
                                   start_new_session=True,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for n in range(3)]
        output, _ = coordinator.communicate(timeout=180)
        assert coordinator.returncode == 0, output[-3000:]
        assert all(agent.wait(30) == 0 for agent in agents)
        assert "waiting for 3 node agents" in output
        assert_same_training(Job(out, 0, _summary(out)), reference)
    finally:
        _kill_left(coordinator, *agents)


def test_of_two_agents_started_with_one_node_rank_one_is_refused(tmp_path):
    """Both connect at once to a coordinator waiting for 2 nodes: the claim of a node number is atomic, so
    exactly one of them becomes node 0 and the other exits 2 saying why (the job itself never starts)."""
    port = _free_port()
    secret = str(write_secret(tmp_path / "secret", new_secret()))
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "deadpool.launcher.cli", "coordinator", "--nnodes", "2", "--nproc-per-node", "1",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--secret-file", secret, "--out", str(tmp_path / "run"), str(TRAIN),
         "--steps", "2", *SMALL], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    agents = [subprocess.Popen([sys.executable, "-m", "deadpool.launcher.cli", "agent", "--coordinator",
                                f"127.0.0.1:{port}", "--node-rank", "0", "--secret-file", secret],
                               start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    try:
        deadline = time.monotonic() + 60
        while all(agent.poll() is None for agent in agents) and time.monotonic() < deadline:
            time.sleep(0.05)
        [refused] = [agent for agent in agents if agent.poll() is not None]
        assert refused.returncode == 2
        assert "node 0 has already joined this job: give each agent its own --node-rank" in refused.communicate(10)[1]
    finally:
        _kill_left(coordinator, *agents)


def test_an_agent_that_cannot_reach_its_coordinator_says_so(tmp_path):
    port = _free_port()
    secret = str(write_secret(tmp_path / "secret", new_secret()))
    done = subprocess.run([sys.executable, "-m", "deadpool.launcher.cli", "agent", "--coordinator",
                           f"127.0.0.1:{port}", "--node-rank", "0", "--connect-timeout", "1", "--secret-file", secret],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert f"cannot reach the coordinator at 127.0.0.1:{port}" in done.stderr
    assert "is `deadpool coordinator` running there?" in done.stderr


def _kill_left(*procs: subprocess.Popen) -> None:
    """SIGKILLs whichever of `procs` a failed test left running."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _summary(out):
    import json

    return json.loads((out / "summary.json").read_text())


# ---- nodes in network namespaces: every byte crosses a real interface ---------------------------------------

netns_missing = available()
in_namespaces = pytest.mark.skipif(bool(netns_missing), reason=netns_missing or "")


THREE_NODES = dict(workers=6, spares=2, nproc_per_node=2)  # 3 worker nodes of 2 ranks, 1 spare node of 2 spares
nft_missing = "" if shutil.which("nft") else "nft (nftables) is not installed: apt-get install nftables"


@pytest.fixture(scope="module")
def six_ranks(tmp_path_factory: pytest.TempPathFactory) -> Job:
    """The failure-free run of the 3-node jobs below (6 ranks, trained as on one machine)."""
    job = run_job(tmp_path_factory.mktemp("six-ranks"), workers=6, spares=1)
    assert job.code == 0 and job.summary["swaps"] == 0
    return job


@in_namespaces
def test_in_namespaces_a_killed_node_is_swapped(tmp_path, six_ranks):
    job = run_job(tmp_path, netns=True, faults=(Fault(kind="kill_node", rank=0, step=5),), **THREE_NODES)
    assert_same_training(job, six_ranks)
    [network] = job.named("network")
    assert len(set(network["addresses"])) == 4 and network["host_address"].endswith(".1")
    assert job.summary["recoveries"][0]["replaced"] == {"0": "s0", "1": "s1"}
    assert not [n for n in _namespaces() if n.startswith(network["bridge"][:6])]  # all removed


def _partition(network: dict, node: int, how: str, cut: bool) -> None:
    """Cuts node off (or heals it): its link down, or a firewall rule in its namespace that drops every
    packet in or out of its interface while the link stays up."""
    if how == "link":
        subprocess.run(["ip", "link", "set", network["links"][node], "down" if cut else "up"], check=True)
        return
    nft = ["ip", "netns", "exec", network["namespaces"][node], "nft"]
    if not cut:
        subprocess.run([*nft, "delete", "table", "inet", "partition"], check=True)
        return
    subprocess.run([*nft, "add", "table", "inet", "partition"], check=True)
    for chain, hook, match in (("in", "input", "iifname"), ("out", "output", "oifname")):
        subprocess.run([*nft, "add", "chain", "inet", "partition", chain,
                        f"{{ type filter hook {hook} priority 0; policy accept; }}"], check=True)
        subprocess.run([*nft, "add", "rule", "inet", "partition", chain, match, "eth0", "drop"], check=True)


@in_namespaces
@pytest.mark.parametrize("how", ["link", pytest.param("firewall", marks=pytest.mark.skipif(bool(nft_missing),
                                                                                          reason=nft_missing))])
def test_a_partitioned_node_is_detected_fenced_and_swapped_and_the_old_node_is_refused(tmp_path, six_ranks, how):
    """Node 1 is cut off mid-run (its link pulled, or its packets dropped by a firewall rule): its agent
    falls silent, the node is declared lost within the node timeout and spare node 3 takes ranks 2 and 3.
    When the partition heals, node 1's processes learn they were replaced and exit; nothing they write
    belongs to the new generation."""
    job = Background(tmp_path, netns=True, node_timeout_s=3.0, **THREE_NODES)
    events = job.wait_for(lambda e: e["event"] == "step" and e["step"] >= 4)
    [network] = [e for e in events if e["event"] == "network"]
    _partition(network, 1, how, cut=True)
    cut = time.monotonic()
    try:
        job.wait_for(lambda e: e["event"] == "swap_complete", timeout_s=60)
    finally:
        _partition(network, 1, how, cut=False)
    done = job.join()
    assert_same_training(done, six_ranks)
    [detected, *_] = done.named("failure_detected")
    assert "lost with node 1 (its agent was silent for" in detected["exit"]
    assert detected["t"] - cut < 3.0 + 3.0  # the node timeout, and scheduling on a busy machine
    assert done.summary["recoveries"][0]["replaced"] == {"2": "s0", "3": "s1"}
    old = [e for e in done.events if e["proc"] in ("w2", "w3")]
    assert old and all(e["gen"] == 0 for e in old)  # never acted in generation 1; none outlives the job


def _namespaces() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
