"""Tests for deadpool/runtime/sharded.py and the sharded side of state.py, on a real FSDP2 model.

One process is a job of one rank (gloo): its shards are whole tensors, but they are real DTensors with
real placements, and FSDP runs its real all-gathers and reduce-scatters. Sharding over several ranks,
and failures between processes, are tested in tests/integration/test_sharded.py."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from deadpool.errors import ConfigError
from deadpool.runtime.sharded import ShardedModel, is_sharded
from deadpool.runtime.state import flatten, load_into, one_mesh, state_sha256, unflatten


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield
    dist.destroy_process_group()


def sharded_model(seed: int = 0) -> torch.nn.Module:
    """Two layers sharded on their own; the last one's parameters belong to the root's group, which
    reduce-scatters only when the whole backward is done (as the GPT's tied embedding does)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    return fully_shard(model, mesh=mesh)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_sharded_state_is_taken_as_local_shards_and_rebuilt_as_dtensors(group):
    model = sharded_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_step(model, optimizer, seed=1)
    tree = {"model": model, "optim": optimizer}
    flat = flatten(tree)
    assert all(type(t) is torch.Tensor for t in flat.tensors)  # plain tensors: slots copy bytes
    assert len(flat.meshes) == 1 and one_mesh(tree) is flat.meshes[0]
    skeleton = json.loads(json.dumps(flat.skeleton))  # crosses the network as JSON
    assert '"D": {"placements": [0], "shape": [8, 4], "stride": [4, 1]}' in json.dumps(flat.skeleton)

    fresh = sharded_model(seed=7)  # other weights, no optimizer state yet
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    fresh_tree = {"model": fresh, "optim": fresh_optimizer}
    load_into(fresh_tree, unflatten(skeleton, [t.clone() for t in flat.tensors], flat.numpy, one_mesh(fresh_tree)))
    assert state_sha256(fresh_tree) == state_sha256(tree)
    state = fresh_optimizer.state[next(iter(fresh.parameters()))]
    assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].placements == (Shard(0),)
    train_step(model, optimizer, seed=2)
    train_step(fresh, fresh_optimizer, seed=2)
    assert state_sha256(fresh_tree) == state_sha256(tree)  # the restored copy trains on identically


def test_a_backward_cut_short_leaves_nothing_behind_after_detach(group):
    """A failure in the middle of backward (here: an exception from a gradient hook, as a dead peer's
    error would surface) must not leak into the replayed step: after detach, the step gives the same
    bits as on a model that never failed."""
    failed, clean = sharded_model(), sharded_model()
    failed_opt = torch.optim.AdamW(failed.parameters(), lr=0.01)
    clean_opt = torch.optim.AdamW(clean.parameters(), lr=0.01)
    wrapper = ShardedModel(failed)
    wrapper.attach(sync=True, interrupted=lambda: False, waiting=lambda _: None, timeout_s=10)  # type: ignore[arg-type]

    def peer_died(_grad: torch.Tensor) -> None:
        raise RuntimeError("Connection closed by peer")

    def hook(_module: torch.nn.Module, _inputs: object, output: torch.Tensor) -> None:
        output.register_hook(peer_died)

    # The last layer's gradients are computed (the root's: not reduce-scattered yet), then a hook fails.
    handle = failed[2].register_forward_hook(hook)
    with pytest.raises(RuntimeError, match="Connection closed"):
        failed(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).square().mean().backward()
    handle.remove()
    wrapper.detach()
    wrapper.zero_grad()
    wrapper.attach(sync=False, interrupted=lambda: False, waiting=lambda _: None, timeout_s=10)  # type: ignore[arg-type]
    train_step(failed, failed_opt, seed=5)
    train_step(clean, clean_opt, seed=5)
    assert state_sha256({"m": failed, "o": failed_opt}) == state_sha256({"m": clean, "o": clean_opt})


def test_detach_before_the_first_forward_has_nothing_to_reset(group):
    model = sharded_model()
    ShardedModel(model).detach()  # a failure before step 1 (while snapshot 0 commits)
    assert all(isinstance(p, DTensor) for p in model.parameters())


def test_is_sharded_tells_fsdp_models_from_plain_ones(group):
    assert is_sharded(sharded_model())
    assert not is_sharded(torch.nn.Linear(2, 2))


def test_a_state_sharded_over_a_2d_mesh_is_refused_naming_it(group):
    """HSDP or tensor parallelism (a mesh of two dimensions): refused at session.run()'s start, in one line."""
    class Held:
        def __init__(self) -> None:
            self.weight = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1, 1)), [Replicate(), Shard(0)])

        def state_dict(self) -> dict:
            return {"weight": self.weight}

        def load_state_dict(self, state: dict) -> None:
            self.weight = state["weight"]

    with pytest.raises(ConfigError, match=r"^the registered state is sharded over a 2-D device mesh \(1, 1\); DeadPool "
                                          r"restores shards onto a 1-D mesh \(FSDP over the whole job\) only: HSDP and "
                                          r"tensor parallelism are not supported yet$"):
        one_mesh({"held": Held()})
    assert one_mesh({"model": sharded_model()}) is not None
