"""Turns a tree of Stateful objects into a JSON skeleton plus a flat list of tensors, and back.

The skeleton keeps every non-tensor value (step counters, learning rates, sampler positions) as
plain JSON, so a snapshot can cross the network without pickle. Tensors are marked *stable* when
they only change inside an optimizer step (parameters and optimizer state): those may be copied
in the background while the next forward and backward run. Everything else (buffers, RNG states,
data positions) is copied at once, at the step boundary. A tensor that appears twice (tied weights: the
embedding and the output layer share one) is taken once, and both places refer to it.

Sharded state (FSDP2's DTensors) is taken as this rank's local shard plus its placements and global shape;
it is rebuilt on the device mesh of the live state it is loaded into, so a snapshot never names a process
group (each generation has a fresh one).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from deadpool.errors import ConfigError

ALIGN = 64  # every tensor starts on a 64-byte boundary, so byte views can be re-viewed as any dtype


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass
class Flat:
    """One rank's state, taken apart: `skeleton` is JSON-ready, `tensors[i]` fills placeholder i."""

    skeleton: Any
    tensors: list[torch.Tensor]
    stable: list[bool]
    numpy: list[bool]
    cuda: list[bool]  # lived on the GPU: restored onto the device, the rest stays in host memory
    meshes: list[DeviceMesh]  # the device meshes of the sharded tensors (FSDP2), each once


@dataclass(frozen=True)
class Layout:
    """Where each tensor lives inside a slot's byte buffer."""

    specs: tuple[tuple[str, tuple[int, ...], int, int], ...]  # (dtype name, shape, offset, nbytes)
    nbytes: int
    lead_nbytes: int = 0  # the leading bytes that hold the `lead` tensors (and zeroed padding) only

    @classmethod
    def of(cls, tensors: list[torch.Tensor], lead: list[bool] | None = None) -> "Layout":
        """Tensors keep their index; the `lead` ones are placed first, so that their bytes form one
        region whose checksum is the data-parallel replicas' fingerprint (snapshot_thread.py). Computed once per
        shape of the state (a snapshot every step asks for the same one each time)."""
        return _layout(tuple((t.dtype, t.shape) for t in tensors), tuple(lead or [False] * len(tensors)))

    def to_json(self) -> list:
        return [list(s) for s in self.specs]

    @classmethod
    def from_json(cls, raw: list, nbytes: int) -> "Layout":
        return cls(tuple((d, tuple(shape), off, n) for d, shape, off, n in raw), nbytes)


@functools.lru_cache(maxsize=8)
def _layout(shapes: tuple[tuple[torch.dtype, torch.Size], ...], lead: tuple[bool, ...]) -> Layout:
    offsets: dict[int, int] = {}
    offset = lead_nbytes = 0
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in shapes]
    for i in [*(i for i, x in enumerate(lead) if x), *(i for i, x in enumerate(lead) if not x)]:
        offsets[i] = offset
        offset += -(-sizes[i] // ALIGN) * ALIGN
        if lead[i]:
            lead_nbytes = offset
    specs = tuple((str(dtype).removeprefix("torch."), tuple(shape), offsets[i], sizes[i])
                  for i, (dtype, shape) in enumerate(shapes))
    return Layout(specs, offset, lead_nbytes)


def _state_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, torch.nn.Module):
        return obj.state_dict(keep_vars=True)  # keep Parameters, so they can be told from buffers
    return obj.state_dict()


class _Unsupported(Exception):
    """A value flatten cannot take; each level it passes through on its way out adds where it was, so
    a path is only built for an error, never for every value of every snapshot."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what, self.where = what, [""]

    def at(self, part: str) -> "_Unsupported":
        self.where.insert(0, part)
        return self


_PLAIN = (str, int, float, bool, type(None))  # kept as they are (bool is listed: type(True) is not int)


def flatten(tree: dict[str, Stateful]) -> Flat:
    """Takes every registered object's state_dict apart (training thread, at a step boundary: it runs before
    every snapshot, so its walk looks at each value's exact type first)."""
    flat = Flat(skeleton=None, tensors=[], stable=[], numpy=[], cuda=[], meshes=[])
    seen: dict[tuple, int] = {}  # the same view of the same storage -> its index

    def add(tensor: torch.Tensor, stable: bool, numpy: bool) -> int:
        flat.tensors.append(tensor)
        flat.stable.append(stable)
        flat.numpy.append(numpy)
        flat.cuda.append(tensor.is_cuda)
        return len(flat.tensors) - 1

    def take(value: torch.Tensor, stable: bool) -> dict[str, Any]:
        sharded: dict[str, Any] = {}
        if type(value) is torch.nn.Parameter:
            stable = True
        elif type(value) is not torch.Tensor:  # a subclass: of Parameter, or a DTensor
            stable = stable or isinstance(value, torch.nn.Parameter)
            if isinstance(value, DTensor):
                sharded = {"D": _placement(value)}
                if value.device_mesh not in flat.meshes:
                    flat.meshes.append(value.device_mesh)
                value = value.to_local().detach()  # this rank's shard: a view of the live local tensor
        key = _view_key(value)
        if key is not None and key in seen:
            return {"T": seen[key], **sharded}
        # detached only where autograd tracks it (parameters): a detach per tensor cost ~1 us, an optimizer's
        # three tensors a parameter included
        index = add(value.detach() if value.requires_grad else value, stable, False)
        if key is not None:
            seen[key] = index
        return {"T": index, **sharded}

    def walk(value: Any, stable: bool) -> Any:
        if type(value) in _PLAIN:
            return value
        if isinstance(value, torch.Tensor):
            return take(value, stable)
        if isinstance(value, dict):
            try:
                return {"d": [[k if type(k) in _PLAIN else walk(k, stable), walk(v, stable)]
                              for k, v in value.items()]}
            except _Unsupported as error:
                raise error.at(f".{_failing(value.items(), stable, walk)}") from None
        if isinstance(value, (list, tuple)):
            if all(type(v) in _PLAIN for v in value):  # Python's RNG state: 625 ints; a param group's indices
                return {"l" if isinstance(value, list) else "t": list(value)}
            try:
                items = [walk(v, stable) for v in value]
            except _Unsupported as error:
                raise error.at(f"[{_failing(enumerate(value), stable, walk)}]") from None
            return {"l" if isinstance(value, list) else "t": items}
        if isinstance(value, np.ndarray):
            return {"T": add(torch.from_numpy(np.ascontiguousarray(value)).clone(), False, True)}
        if value is None or isinstance(value, (bool, int, float, str)):  # subclasses (an IntEnum, say)
            return value
        if isinstance(value, (np.integer, np.floating)):
            return value.item()
        raise _Unsupported(f"values of type {type(value).__name__} are not supported (use tensors, numpy arrays, "
                           "numbers, strings, lists, tuples and dicts)")

    skeleton = []
    with _collector_paused():
        for name, obj in tree.items():
            try:
                skeleton.append([name, walk(_state_dict(obj), isinstance(obj, torch.optim.Optimizer))])
            except _Unsupported as error:
                raise ConfigError(f"cannot snapshot {name}{''.join(error.where)}: {error.what}") from None
    flat.skeleton = {"d": skeleton}
    return flat


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic collector held off while a walk allocates its few small containers per tensor: it
    would run every 700 of them and scan the training process's young (and at times older) objects each time
    (a model of 1,169 tensors: 6 ms a walk, 2.7 ms with it paused). Nothing a walk builds is cyclic."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _failing(items: Any, stable: bool, walk: Callable[[Any, bool], Any]) -> Any:
    """Which key (or index) of a container holds the value flatten cannot take: the error's path only."""
    for key, value in items:
        try:
            walk(key, stable)
            walk(value, stable)
        except _Unsupported:
            return key
    raise AssertionError("the walk of these items failed, so one of them fails again")


def _placement(tensor: DTensor) -> dict[str, Any]:
    """How a shard sits in its global tensor, as JSON: the dimension each mesh dimension shards
    (or "R": replicated), and the global shape and strides."""
    placements: list[int | str] = []
    for p in tensor.placements:
        if type(p) is Shard:
            placements.append(p.dim)
        elif type(p) is Replicate:
            placements.append("R")
        else:
            raise _Unsupported(f"DTensor placement {p} is not supported (Shard and Replicate are)")
    return {"placements": placements, "shape": list(tensor.shape), "stride": list(tensor.stride())}


def _view_key(tensor: torch.Tensor) -> tuple | None:
    """What makes two tensors the same bytes: where they start, dtype, shape and strides. None for tensors
    that are never shared this way (empty ones, and subclasses such as DTensor, which own no storage)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or not tensor.numel():
        return None
    # the address of the first element stands for (storage, offset): two live tensors that start at one address
    # share a storage (asked for every tensor at every snapshot: cheaper than making a storage object)
    return tensor.device, tensor.data_ptr(), tensor.dtype, tensor.shape, tensor.stride()


def unflatten(skeleton: Any, tensors: list[torch.Tensor], numpy_flags: list[bool],
              mesh: DeviceMesh | None = None) -> Any:
    """Rebuilds the state dicts; tensors are used as given, so pass copies that nothing else owns.
    Shards become DTensors again on `mesh`: the live state's (one_mesh), this generation's group."""

    def walk(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if "D" in node:
            if mesh is None:
                raise ConfigError("the snapshot holds sharded tensors (FSDP) but the live state has no device mesh: "
                                  "shard the model with fully_shard before session.run(), as before the failure")
            sharded = node["D"]
            placements = [Replicate() if p == "R" else Shard(p) for p in sharded["placements"]]
            return DTensor.from_local(tensors[node["T"]], mesh, placements, run_check=False,
                                      shape=torch.Size(sharded["shape"]), stride=tuple(sharded["stride"]))
        if "T" in node:
            i = node["T"]
            return tensors[i].numpy() if numpy_flags[i] else tensors[i]
        if "d" in node:
            return {walk(k): walk(v) for k, v in node["d"]}
        if "l" in node:
            return [walk(v) for v in node["l"]]
        return tuple(walk(v) for v in node["t"])

    return walk(skeleton)


def one_mesh(tree: dict[str, Stateful]) -> DeviceMesh | None:
    """The device mesh the live state's shards live on (None: nothing is sharded). One 1-D mesh only: a
    model sharded over several, or over a mesh of two dimensions (HSDP, tensor parallelism), is not
    supported yet (session.run refuses it at its start, not at a recovery)."""
    meshes = flatten(tree).meshes
    if len(meshes) > 1:
        raise ConfigError(f"the registered state is sharded over {len(meshes)} device meshes; DeadPool restores "
                          "shards onto one mesh (FSDP over the whole job) only")
    if meshes and meshes[0].ndim != 1:
        raise ConfigError(f"the registered state is sharded over a {meshes[0].ndim}-D device mesh "
                          f"{tuple(meshes[0].shape)}; DeadPool restores shards onto a 1-D mesh (FSDP over the whole "
                          "job) only: HSDP and tensor parallelism are not supported yet")
    return meshes[0] if meshes else None


def load_into(tree: dict[str, Stateful], state: dict[str, Any]) -> None:
    for name, obj in tree.items():
        if name not in state:
            raise ConfigError(f"the snapshot has no entry {name!r}; registered state must match across ranks")
        obj.load_state_dict(state[name])


def state_sha256(tree: dict[str, Stateful]) -> dict[str, str]:
    """Fingerprints of each entry's state (values and structure): equal on two runs only if bit-identical."""
    digests = {}
    for name, obj in tree.items():
        flat = flatten({name: obj})
        h = hashlib.sha256(json.dumps(flat.skeleton).encode())
        for t in flat.tensors:
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        digests[name] = h.hexdigest()
    return digests
