"""Gradient buckets: a fixed layout (a pure function), and their all-reduces launched while backward runs.

DDP's reducer overlaps the reduction with backward: a bucket's all-reduce starts as soon as the last of its
gradients is accumulated, while autograd computes the earlier layers' gradients. DeadPool does the same
with two rules that keep a replayed step bit for bit:

- The layout is fixed, a function of the parameters alone (DDP rebuilds its buckets after the first step in
  the order gradients happened to become ready). Where an element falls in a bucket decides where it falls
  in gloo's ring, and so the order in which the ranks' values are summed (more than 2 ranks).
- Buckets are launched in the layout's order, each once all earlier ones are launched (as DDP's reducer
  does), so every rank issues the same collectives in the same order whatever order its gradients became
  ready in; a bucket holding a parameter that got no gradient in this pass waits for the end of backward.

    backward:  grads of bucket 0 ready -> launch 0 | grads of bucket 1 ready -> launch 1 | ... end of backward
    end:       launch the rest (missing gradients count as zero), wait for all, gradients := views of buckets
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

FIRST_BUCKET_BYTES = 1024 * 1024  # torch's dist._DEFAULT_FIRST_BUCKET_BYTES: the first reduction starts early
BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


def bucket_layout(params: Sequence[tuple[int, Hashable]], first_bytes: int, bytes_cap: int) -> list[list[int]]:
    """(bytes, dtype) of each parameter in the module's order -> buckets of parameter indices, in launch order.

    DDP's assignment (`_compute_bucket_assignment_by_size`) over the parameters in reverse, the order in
    which backward produces their gradients for a model used in the order it is defined: one open bucket
    per dtype (a bucket is one flat tensor), closed once it holds at least its limit, `first_bytes` for the
    first bucket of a dtype and `bytes_cap` after it; buckets ordered by their first parameter in that walk."""
    closed: list[list[int]] = []
    open_: dict[Hashable, list[int]] = {}
    filled: dict[Hashable, int] = {}
    limits: dict[Hashable, int] = {}
    for index in reversed(range(len(params))):
        size, dtype = params[index]
        bucket = open_.setdefault(dtype, [])
        bucket.append(index)
        filled[dtype] = filled.get(dtype, 0) + size
        if filled[dtype] >= limits.setdefault(dtype, first_bytes):
            closed.append(bucket)
            del open_[dtype]
            filled[dtype], limits[dtype] = 0, bytes_cap
    closed.extend(open_.values())
    return sorted(closed, key=lambda bucket: -bucket[0])


@dataclass
class _Pass:
    """One backward pass's reduction: gradients still missing per bucket, and the buckets launched so far."""
    task: int  # autograd's id of the pass (a new id: a new pass, even after one that an exception cut short)
    missing: list[int]
    copied: set[int] = field(default_factory=set)  # parameters whose gradient is in its bucket already
    launched: list[tuple[Any, torch.Tensor]] = field(default_factory=list)  # (work, flat bucket), in order


class Reducer:
    """Averages the gradients of `params` over the group in the buckets of `layout`, overlapped with backward.

    `ready(index)` is called by parameter `index`'s post-accumulate-grad hook; the first call of a pass
    queues the end-of-pass step with autograd. `all_reduce(flat)` issues an async sum and returns its work;
    `wait(works)` waits for them (DataParallel gives up when the generation is aborted, see comms.finish).
    An abort mid-pass leaves no wait behind: launched works are only waited for at the end of the pass,
    and a pass that an exception cut short is forgotten (its group is abandoned with its generation)."""

    def __init__(self, params: list[torch.nn.Parameter], layout: list[list[int]],
                 all_reduce: Callable[[torch.Tensor], Any], wait: Callable[[list[Any]], None]) -> None:
        self.params, self.layout = params, layout
        self.all_reduce, self.wait = all_reduce, wait
        self.bucket_of = {index: b for b, members in enumerate(layout) for index in members}
        self.offset_of = {index: sum(params[i].numel() for i in members[:k])
                          for members in layout for k, index in enumerate(members)}
        self.world_size = 1  # set by DataParallel.attach: the divisor
        self.current: _Pass | None = None
        # one flat tensor per bucket, made at its first launch and reused by every pass after (as DDP keeps its
        # buckets): a fresh one each pass cost a page fault per 4 KiB of gradients, about as much as the copy
        self.flats: list[torch.Tensor | None] = [None] * len(layout)

    def ready(self, index: int) -> None:
        """Parameter `index` has its gradient for this pass: launches every bucket now complete, in order."""
        task = torch._C._current_graph_task_id()
        if self.current is None or self.current.task != task:
            self.current = _Pass(task, [len(members) for members in self.layout])
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_pass)
        now = self.current
        self._copy_in(index, now)
        now.missing[self.bucket_of[index]] -= 1
        while len(now.launched) < len(self.layout) and now.missing[len(now.launched)] == 0:
            self._launch(now)

    def forget(self) -> None:
        """Drops a pass in flight (its generation is over: its works belong to an abandoned group), and the
        buckets with it: an abandoned all-reduce may still write into them, so the next pass gets new ones."""
        self.current = None
        self.flats = [None] * len(self.layout)

    def _flat(self, b: int) -> torch.Tensor:
        flat = self.flats[b]
        if flat is None:
            first = self.params[self.layout[b][0]]
            flat = self.flats[b] = torch.empty(sum(self.params[i].numel() for i in self.layout[b]),
                                               dtype=first.dtype, device=first.device)
        return flat

    def _view(self, index: int) -> torch.Tensor:
        param, offset = self.params[index], self.offset_of[index]
        return self._flat(self.bucket_of[index])[offset: offset + param.numel()].view_as(param)

    def _copy_in(self, index: int, now: _Pass) -> None:
        """Parameter `index`'s gradient, just accumulated, times 1 / world size into its place in its bucket
        (DDP's arithmetic, the same single rounding as DDP's `mul_out` into its bucket view); the gradient
        then *is* that place (DDP's gradient_as_bucket_view). So autograd's own gradient tensor is freed at
        once and the next gradient of the pass reuses its memory: held until the end of backward, the
        pass's gradients were freed together with its activations, and the allocator handed the lot back to
        the system to fault it in again at the next pass (measured: ~2 % of the workers' CPU, 10M x 4).
        The gradient may be this very place already (zero_grad(set_to_none=False)): scaled in place then."""
        view = self._view(index)
        grad = self.params[index].grad
        if grad is not None:
            torch.mul(grad, 1.0 / self.world_size, out=view)
            self.params[index].grad = view
            now.copied.add(index)

    def _launch(self, now: _Pass) -> None:
        """The next bucket, its gradients copied in: an async sum. A member whose gradient did not come in
        this pass counts as zero if it has none (as in the one-shot reduction before), and is scaled in
        from what it holds if it has one (a gradient the script kept from an earlier pass)."""
        b = len(now.launched)
        for i in self.layout[b]:
            if i not in now.copied:
                if self.params[i].grad is None:
                    self._view(i).zero_()
                else:
                    self._copy_in(i, now)
        flat = self._flat(b)
        now.launched.append((self.all_reduce(flat), flat))

    def _end_of_pass(self) -> None:
        """Autograd's last callback of the pass: the buckets still waiting (missing gradients) go now, in order;
        once all are reduced, each parameter's gradient becomes its view of its bucket (DDP's
        gradient_as_bucket_view: the next pass reduces into the same bucket, so keep no gradient across passes
        that you do not want overwritten)."""
        now = self.current
        if now is None:  # forgotten meanwhile
            return
        while len(now.launched) < len(self.layout):
            self._launch(now)
        self.current = None
        self.wait([work for work, _ in now.launched])
        for members, (_, flat) in zip(self.layout, now.launched):
            offset = 0
            for i in members:
                param = self.params[i]
                param.grad = flat[offset: offset + param.numel()].view_as(param)
                offset += param.numel()
