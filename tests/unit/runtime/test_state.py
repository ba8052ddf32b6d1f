"""Tests for deadpool/runtime/state.py: flatten/unflatten, stable flags, Layout, and state fingerprints."""

import json
import random

import numpy as np
import pytest
import torch
from tests.box import Box

from deadpool.errors import ConfigError
from deadpool.runtime.state import ALIGN, Layout, flatten, load_into, state_sha256, unflatten


class Rngs:
    """A Stateful holding a Python and a legacy numpy generator, the way a data sampler might."""

    def __init__(self, seed: int) -> None:
        self.py = random.Random(seed)
        self.np = np.random.RandomState(seed)

    def state_dict(self):
        return {"python": self.py.getstate(), "numpy": self.np.get_state(), "counts": {3: 30, 7: 70},
                "position": np.int64(12), "scale": np.float32(0.5)}

    def load_state_dict(self, state):
        self.py.setstate(state["python"])
        self.np.set_state(state["numpy"])


def make_tree(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(5, 3)).square().mean().backward()
    optimizer.step()
    rngs = Rngs(seed)
    rngs.py.random(), rngs.np.rand(3)  # move both generators off their seed state
    return {"model": model, "optim": optimizer, "rngs": rngs}


def round_trip(tree):
    """flatten, send the skeleton through JSON as a snapshot does, then unflatten with private copies."""
    flat = flatten(tree)
    skeleton = json.loads(json.dumps(flat.skeleton))
    return flat, unflatten(skeleton, [t.clone() for t in flat.tensors], flat.numpy)


def assert_same(a, b, path="state"):
    """Equal values of identical types all the way down (tensors bitwise, numpy arrays with dtype)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        assert [type(k) for k in a] == [type(k) for k in b], path
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


def test_round_trip_restores_every_value_and_type():
    tree = make_tree()
    _, state = round_trip(tree)
    assert list(state) == ["model", "optim", "rngs"]
    expected_model = {k: v.detach() for k, v in tree["model"].state_dict().items()}
    assert_same(state["model"], expected_model, "model")
    assert_same(state["optim"], tree["optim"].state_dict(), "optim")
    rng = tree["rngs"].state_dict()
    rng["position"], rng["scale"] = 12, 0.5  # numpy scalars come back as Python numbers
    assert_same(state["rngs"], rng, "rngs")


def test_round_trip_keeps_tuples_int_keys_and_numpy_arrays():
    _, state = round_trip(make_tree())
    assert state["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert type(state["optim"]["param_groups"][0]["betas"]) is tuple
    assert list(state["optim"]["state"]) == [0, 1, 2, 3]
    assert type(state["rngs"]["python"]) is tuple and type(state["rngs"]["python"][1]) is tuple
    numpy_state = state["rngs"]["numpy"]
    assert type(numpy_state) is tuple and numpy_state[0] == "MT19937"
    assert type(numpy_state[1]) is np.ndarray and numpy_state[1].dtype == np.uint32 and numpy_state[1].shape == (624,)
    assert state["rngs"]["counts"] == {3: 30, 7: 70} and all(type(k) is int for k in state["rngs"]["counts"])


def test_loaded_state_continues_bit_identically():
    source, target = make_tree(seed=0), make_tree(seed=1)
    assert state_sha256(source) != state_sha256(target)
    _, state = round_trip(source)
    load_into(target, state)
    assert state_sha256(target) == state_sha256(source)
    assert target["rngs"].py.random() == source["rngs"].py.random()
    assert np.array_equal(target["rngs"].np.rand(4), source["rngs"].np.rand(4))
    batch = torch.randn(5, 3)
    for tree in (source, target):
        tree["optim"].zero_grad()
        tree["model"](batch).square().mean().backward()
        tree["optim"].step()
    assert state_sha256(target) == state_sha256(source)


def test_stable_flags():
    flat = flatten(make_tree())
    # model: 4 parameters (stable), then 3 BatchNorm buffers (not stable);
    # optimizer: 4 parameters x (step, exp_avg, exp_avg_sq), all stable; rngs: the numpy key array.
    assert flat.stable == [True] * 4 + [False] * 3 + [True] * 12 + [False]
    assert flat.numpy == [False] * 19 + [True]
    assert [tuple(t.shape) for t in flat.tensors[:7]] == [(4, 3), (4,), (4,), (4,), (4,), (4,), ()]
    assert not any(t.requires_grad for t in flat.tensors)


def test_a_parameter_of_a_subclass_is_stable_and_detached():
    """The walk takes Parameter and Tensor by their exact type first; a subclass (quantized weights, say)
    must still count as a parameter."""
    class Scaled(torch.nn.Parameter):
        pass

    module = torch.nn.Linear(2, 2)
    module.weight = Scaled(module.weight.detach().clone())
    flat = flatten({"model": module})
    assert type(module.weight) is Scaled and flat.stable == [True, True]
    assert not any(t.requires_grad for t in flat.tensors)
    assert flat.tensors[0].data_ptr() == module.weight.data_ptr()


def test_tensors_are_shared_not_copied():
    tree = make_tree()
    flat = flatten(tree)
    assert flat.tensors[0].data_ptr() == tree["model"][0].weight.data_ptr()


def test_tied_weights_are_taken_once_and_restored_to_both_places():
    """An embedding and an output layer sharing one weight (GPT's tie): one tensor in the snapshot, both
    state-dict entries point at it, and loading it back keeps the tie."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    flat = flatten({"model": model})
    assert len(flat.tensors) == 1 and Layout.of(flat.tensors).nbytes == 64  # 15 floats, once
    state = unflatten(json.loads(json.dumps(flat.skeleton)), [t.clone() for t in flat.tensors], flat.numpy)
    assert state["model"]["0.weight"] is state["model"]["1.weight"]
    other = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    other[1].weight = other[0].weight
    other.load_state_dict(state["model"])
    assert torch.equal(other[0].weight, model[0].weight) and other[1].weight is other[0].weight


def test_different_views_of_one_storage_are_kept_apart():
    base = torch.arange(6.0)
    flat = flatten({"box": Box({"a": base[:3], "b": base[3:], "again": base[:3], "empty": base[:0],
                                "empty2": base[:0]})})
    assert [t.tolist() for t in flat.tensors] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [], []]


def test_numpy_array_is_copied_at_flatten():
    array = np.arange(4, dtype=np.int16)
    flat = flatten({"box": Box({"a": array})})
    array[0] = 99
    assert flat.tensors[0].tolist() == [0, 1, 2, 3] and flat.tensors[0].dtype == torch.int16


def test_skeleton_is_json_and_plain_values_pass_through():
    state = {"step": 3, "lr": 0.5, "name": "x", "flag": True, "none": None, "nested": [1, (2, {"k": [3]})]}
    flat = flatten({"box": Box(state)})
    assert flat.tensors == []
    assert json.loads(json.dumps(flat.skeleton)) == flat.skeleton
    assert unflatten(flat.skeleton, [], []) == {"box": state}


@pytest.mark.parametrize("state, path, kind", [
    ({"when": object()}, "box.when", "object"),
    ({"outer": {"inner": [1, {2, 3}]}}, "box.outer.inner[1]", "set"),
    ({"b": b"bytes"}, "box.b", "bytes"),
])
def test_unsupported_value_names_its_path(state, path, kind):
    with pytest.raises(ConfigError) as info:
        flatten({"box": Box(state)})
    assert str(info.value).startswith(f"cannot snapshot {path}: values of type {kind} are not supported")


def test_load_into_requires_every_entry():
    with pytest.raises(ConfigError, match="^the snapshot has no entry 'b'; registered state must match across ranks$"):
        load_into({"a": Box({}), "b": Box({})}, {"a": {}})


# ---- Layout ---------------------------------------------------------------------------------

def test_layout_offsets_are_aligned():
    tensors = [torch.zeros(3, dtype=torch.uint8), torch.zeros(5, dtype=torch.float64), torch.zeros(0),
               torch.zeros(16, dtype=torch.float32), torch.zeros((), dtype=torch.int64), torch.zeros(2, 3)]
    layout = Layout.of(tensors)
    assert layout.specs == (("uint8", (3,), 0, 3), ("float64", (5,), 64, 40), ("float32", (0,), 128, 0),
                            ("float32", (16,), 128, 64), ("int64", (), 192, 8), ("float32", (2, 3), 256, 24))
    assert layout.nbytes == 320
    assert all(offset % ALIGN == 0 for _, _, offset, _ in layout.specs) and ALIGN == 64


def test_layout_of_real_state_is_aligned_and_sized():
    flat = flatten(make_tree())
    layout = Layout.of(flat.tensors)
    assert all(offset % 64 == 0 for _, _, offset, _ in layout.specs)
    assert [n for *_, n in layout.specs] == [t.numel() * t.element_size() for t in flat.tensors]
    ends = [offset + n for _, _, offset, n in layout.specs]
    assert all(end <= nxt for end, (_, _, nxt, _) in zip(ends, layout.specs[1:]))
    assert layout.nbytes == -(-ends[-1] // 64) * 64


def test_layout_json_round_trip():
    layout = Layout.of([torch.zeros(2, 3), torch.zeros(7, dtype=torch.int8)])
    assert Layout.from_json(json.loads(json.dumps(layout.to_json())), layout.nbytes) == layout


# ---- state_sha256 ---------------------------------------------------------------------------

def test_sha256_equal_for_equal_states():
    a, b = make_tree(), make_tree()
    digests = state_sha256(a)
    assert digests == state_sha256(b)
    assert list(digests) == ["model", "optim", "rngs"] and all(len(d) == 64 for d in digests.values())


def test_sha256_changes_when_one_parameter_bit_flips():
    a, b = make_tree(), make_tree()
    with torch.no_grad():
        bits = b["model"][0].weight.view(torch.int32)
        bits[1, 2] ^= 1  # the lowest mantissa bit of one weight
    assert not torch.equal(a["model"][0].weight, b["model"][0].weight)
    da, db = state_sha256(a), state_sha256(b)
    assert da["model"] != db["model"]
    assert da["optim"] == db["optim"] and da["rngs"] == db["rngs"]


def test_sha256_sees_dtype_and_plain_values():
    base = state_sha256({"x": Box({"t": torch.zeros(2, dtype=torch.int32), "step": 1})})
    assert base != state_sha256({"x": Box({"t": torch.zeros(2, dtype=torch.float32), "step": 1})})
    assert base != state_sha256({"x": Box({"t": torch.zeros(2, dtype=torch.int32), "step": 2})})


def test_sha256_sees_tensor_shape():
    a = state_sha256({"x": Box({"t": torch.arange(6.0).reshape(2, 3)})})
    b = state_sha256({"x": Box({"t": torch.arange(6.0).reshape(3, 2)})})
    assert a != b


def test_layout_places_lead_tensors_first_and_keeps_their_index():
    tensors = [torch.zeros(3), torch.zeros(5, dtype=torch.float64), torch.zeros(2), torch.zeros(7, dtype=torch.int8)]
    layout = Layout.of(tensors, lead=[False, True, False, True])
    offsets = [spec[2] for spec in layout.specs]
    assert offsets[1] == 0 and offsets[3] == ALIGN  # the lead ones, in order, from the start
    assert layout.lead_nbytes == 2 * ALIGN  # both fit in one aligned block each
    assert min(offsets[0], offsets[2]) == layout.lead_nbytes
    assert [spec[1] for spec in layout.specs] == [(3,), (5,), (2,), (7,)]  # index i is still tensor i


def test_layout_without_lead_has_an_empty_lead_region():
    assert Layout.of([torch.zeros(3)]).lead_nbytes == 0


def test_flatten_leaves_the_cyclic_collector_as_it_found_it():
    """flatten pauses the collector while it walks (state._collector_paused), and must not turn it on for a
    script that keeps it off, nor leave it off for one that does not, not even when the walk fails."""
    import gc
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            (gc.enable if enabled else gc.disable)()
            flatten(make_tree())
            assert gc.isenabled() is enabled
            with pytest.raises(ConfigError):
                flatten({"box": Box({"when": object()})})
            assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_layout_follows_a_change_of_shape():
    """Layouts are remembered per shape of the state: a tensor that grows (the optimizer's state appears
    after the first step) gets a new layout, and the old shapes their old one."""
    small, grown = [torch.zeros(3), torch.zeros(2)], [torch.zeros(3), torch.zeros(20)]
    assert Layout.of(small).specs == (("float32", (3,), 0, 12), ("float32", (2,), 64, 8))
    assert Layout.of(grown).specs == (("float32", (3,), 0, 12), ("float32", (20,), 64, 80))
    assert Layout.of(grown, lead=[False, True]).specs == (("float32", (3,), 128, 12), ("float32", (20,), 0, 80))
    assert Layout.of(small).nbytes == 128 and Layout.of(grown, lead=[False, True]).lead_nbytes == 128
