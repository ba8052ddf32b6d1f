"""FSDP2 (`fully_shard`) kept alive across generations.

A sharded model needs no wrapper of ours: FSDP2 all-gathers and reduce-scatters over the process group of
its device mesh. Two things tie it to one generation, and this module undoes both:

- FSDP keeps the group it was built with (each parameter group's mesh info caches it). The mesh itself
  names its group by name, and every generation's default group gets the same name ("0": torch numbers
  groups from zero again once they are all destroyed), so rebinding recomputes the cached group from
  the mesh (`attach`).
- A failure mid-forward or mid-backward leaves FSDP's per-step state half done (unsharded parameters,
  a pending all-gather, gradients not yet reduce-scattered). `detach` resets it with FSDP's own
  `reset_iter_state()`, after dropping the pending all-gathers of the abandoned group (their results are
  garbage and waiting on them could block), and then drops the gradients left on the unsharded
  parameters: reset_iter_state (torch 2.13) keeps them, and the replayed step would add its own to them
  (measured: the losses part from the failure-free run's one step after the swap).

The snapshot needs nothing from here: the model's state_dict() holds DTensors, whose local shards
runtime/state.py takes apart like any tensor.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.distributed.fsdp import FSDPModule


def is_sharded(model: torch.nn.Module) -> bool:
    """True for a model sharded with FSDP2's fully_shard (the root, or any module inside it)."""
    return any(isinstance(m, FSDPModule) for m in model.modules())


class ShardedModel:
    """Session's handle on a fully_shard model: the same attach/detach as comms.DataParallel."""

    def __init__(self, module: torch.nn.Module) -> None:
        if not isinstance(module, FSDPModule):
            raise TypeError("session.wrap() of a sharded model takes the root: call fully_shard(model) on it last")
        self.module: torch.nn.Module = module
        self.attached = False

    def attach(self, sync: bool, interrupted: Callable[[], bool],
               waiting: Callable[[str], ContextManager[None]], timeout_s: float) -> None:
        """Rebinds every parameter group to this generation's group. There is nothing to broadcast at the
        start (`sync`): each rank built the same model from the same seed and keeps its own shard of it."""
        for group in self._param_groups():
            for info in {id(i): i for i in (group.mesh_info, group.post_forward_mesh_info) if i is not None}.values():
                info.__post_init__()  # recomputes the group (and this rank's place in it) from the mesh
        self.attached = True

    def detach(self) -> None:
        """Leaves FSDP as after a completed step: sharded, nothing pending (the step's gradients are lost)."""
        self.attached = False
        assert isinstance(self.module, FSDPModule)
        if not self.module._get_fsdp_state()._is_root:  # FSDP initialises at the first forward: nothing ran yet
            return
        for group in self._param_groups():
            group._all_gather_result = None  # an all-gather of the abandoned group: never waited on
        self.module.reset_iter_state()
        for group in self._param_groups():
            for param in group.fsdp_params:
                if hasattr(param, "_unsharded_param"):  # allocated at the first all-gather
                    param._unsharded_param.grad = None
                param.unsharded_accumulated_grad = None

    def middle(self) -> torch.nn.Module:
        """The sharded module in the middle of the model: its output's gradient arrives mid-backward."""
        sharded = [m for m in self.module.modules() if isinstance(m, FSDPModule)]
        return sharded[len(sharded) // 2]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)

    def _param_groups(self) -> Iterator[Any]:
        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                yield from m._get_fsdp_state()._fsdp_param_groups
