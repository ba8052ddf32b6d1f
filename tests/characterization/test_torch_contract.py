"""Pins the torch 2.13 behaviour DeadPool is built on; an upgrade that changes it fails here first, saying why."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield server
    del server


def _pair(store, prefix: str) -> list[dist.ProcessGroup]:
    """A two-rank gloo group built from two threads of this process."""
    groups: list = [None, None]

    def build(rank: int) -> None:  # each thread its own client: a blocking call would hold a shared one
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), rank, 2, timedelta(seconds=10))

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(10) for t in threads]
    return groups


def test_gloo_point_to_point_work_reports_completion_only_through_wait(store):
    """Why replica transfers use work.wait(timeout) and announce snapshots through the store."""
    sender, receiver = _pair(store, "p2p/")
    buffer = torch.zeros(4)
    recv = receiver.recv([buffer], 0, 0)
    send = sender.send([torch.arange(4.0)], 1, 0)
    time.sleep(0.3)
    assert not recv.is_completed() and not send.is_completed()
    send.wait(timedelta(seconds=5))
    recv.wait(timedelta(seconds=5))
    assert torch.equal(buffer, torch.arange(4.0))


def test_gloo_collective_future_completes_without_wait(store):
    """Why an abortable wait (comms.finish) can watch a collective's future instead of blocking in wait()."""
    groups = _pair(store, "ar/")
    tensors = [torch.ones(3), torch.ones(3)]
    done = [threading.Event(), threading.Event()]
    works = [g.allreduce([t]) for g, t in zip(groups, tensors)]
    for work, event in zip(works, done):
        work.get_future().add_done_callback(lambda _, e=event: e.set())
    assert all(e.wait(5) for e in done)
    assert torch.equal(tensors[0], torch.full((3,), 2.0))


def test_prefix_store_keeps_generations_apart(store):
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=5))
    dist.PrefixStore("g0", client).set("k", "old")
    assert dist.PrefixStore("g0", client).get("k") == b"old"
    assert not dist.PrefixStore("g1", client).check(["k"])
    assert client.check(["g0/k"])  # the prefix and the key are joined with "/"


def test_optimizer_step_pre_hook_must_return_none():
    """Why the session's pre-hook wraps wait_copied() instead of returning its wait time."""
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    opt.register_step_pre_hook(lambda *_: 0.5)
    param.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="must return None"):
        opt.step()


def test_backward_callback_runs_once_after_all_gradients():
    """Why buckets.Reducer ends a pass (last buckets, waits) in one callback queued by its first gradient hook."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    seen: list[list[bool]] = []
    queued = []

    def on_grad(_param: torch.Tensor) -> None:
        if not queued:
            queued.append(True)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: seen.append([p.grad is not None for p in model.parameters()]))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(on_grad)
    model(torch.ones(2, 3)).sum().backward()
    assert seen == [[True, True, True, True]]


def test_each_backward_pass_has_its_own_graph_task_id_and_a_tied_weight_one_hook_call():
    """Why buckets.Reducer tells passes apart by torch._C._current_graph_task_id() (a pass an exception cut
    short leaves no flag behind) and counts one post-accumulate call per parameter: a weight used twice
    (GPT's tied embedding) has its gradients summed before one accumulation."""
    weight = torch.nn.Parameter(torch.ones(3, 3))
    calls: list[int] = []
    weight.register_post_accumulate_grad_hook(lambda _: calls.append(torch._C._current_graph_task_id()))
    for _ in range(2):
        (weight @ (weight @ torch.ones(3))).sum().backward()
    assert len(calls) == 2 and calls[0] != calls[1] and -1 not in calls
    assert torch._C._current_graph_task_id() == -1  # outside backward


def test_creating_adamw_imports_dynamo():
    """Why a spare imports torch._dynamo while idle: otherwise ~1 s of the swap is this import."""
    code = ("import sys, torch; torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr


RING = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist
    from datetime import timedelta
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    group = dist.ProcessGroupGloo(dist.PrefixStore("ring/", store), rank, 4, timedelta(seconds=4))
    tensor, steps = torch.ones(1_000_000), 0
    try:
        while True:
            group.allreduce([tensor]).wait()
            steps += 1
            if rank == 2 and steps == 20:
                os.kill(os.getpid(), 9)
    except RuntimeError:
        print(f"{time.time():.3f}", flush=True)
        time.sleep(6)  # a survivor stays alive, its group still open, as DeadPool's survivors do
""")


def test_gloo_sigkill_reaches_some_peers_at_once_and_others_only_at_timeout(store, tmp_path):
    """Why survivors are released by the coordinator's abort: with a 4-rank ring, a killed rank's
    neighbours fail at once, but a rank that only waits on a surviving neighbour blocks until
    gloo's timeout (4 s here)."""
    script = tmp_path / "ring.py"
    script.write_text(RING)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(store.port)], stdout=subprocess.PIPE, text=True)
             for r in range(4)]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert outs[2] == ""  # the killed one
    first, second, last = sorted(float(outs[r]) for r in (0, 1, 3))
    assert second - first < 1.0, outs  # both neighbours of the dead rank notice at once
    assert last - first >= 3.0, outs  # the third waits for the timeout: it must be released another way


COMPILE_REUSE = textwrap.dedent("""
    import sys
    import torch
    from torch._dynamo import callback
    sys.path.insert(0, sys.argv[1])
    from model import GPT, GPTConfig

    compiles = []
    callback.on_compile_start(lambda _: compiles.append(1))
    config = GPTConfig(vocab_size=50, block_size=16, n_layer=1, n_head=2, n_embd=32)
    x = torch.zeros(2, 16, dtype=torch.long)
    torch.compile(GPT(config))(x, x)[1].backward()  # a spare's warm-up: a throwaway model
    warm = len(compiles)
    model = torch.compile(GPT(config))  # the model the script builds once the spare is called
    optimizer = torch.optim.AdamW(model.parameters())
    model(x, x)[1].backward()
    optimizer.step()
    print(warm, len(compiles) - warm)
""")


def test_a_fresh_model_of_a_compiled_class_reuses_its_compiled_code(tmp_path) -> None:
    """deadpool.init(warmup=...) relies on it: torch.compile's code is cached on the model class's forward,
    with guards a new instance of the same class at the same shapes passes, so a spare that compiled a
    throwaway model while waiting runs the real one without compiling again."""
    script = tmp_path / "reuse.py"
    script.write_text(COMPILE_REUSE)
    example = Path(__file__).resolve().parents[2] / "examples" / "gpt"
    done = subprocess.run([sys.executable, str(script), str(example)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    warm, again = map(int, done.stdout.split())
    assert warm >= 1 and again == 0, f"warm-up compiled {warm} frame(s), the real model {again} more"
