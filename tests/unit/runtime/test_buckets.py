"""Tests for deadpool/runtime/buckets.py: the fixed bucket layout (DDP's assignment over the parameters in
reverse) and the reducer's launches during backward, in layout order, with DDP's arithmetic."""

import random

import pytest
import torch
import torch.distributed as dist

from deadpool.runtime.buckets import Reducer, bucket_layout

MB = 1024 * 1024


def test_the_layout_walks_the_parameters_backwards_with_a_small_first_bucket():
    # 4-byte floats: 0.75 MB, 0.5 MB, 0.5 MB, 0.25 MB, 2 MB in the module's order
    params = [(n * MB // 4 * 4, torch.float32) for n in (0.75, 0.5, 0.5, 0.25, 2)]
    # backwards: 2 MB fills the 1 MB first bucket alone; then 0.25 + 0.5 + 0.5 + 0.75 stay under 3 MB
    assert bucket_layout(params, first_bytes=MB, bytes_cap=3 * MB) == [[4], [3, 2, 1, 0]]
    assert bucket_layout(params, first_bytes=MB, bytes_cap=MB) == [[4], [3, 2, 1], [0]]


def test_each_dtype_has_its_own_buckets_in_the_order_their_first_gradient_comes():
    params = [(MB, torch.float32), (10, torch.float16), (10, torch.float32), (10, torch.float16)]
    assert bucket_layout(params, first_bytes=MB, bytes_cap=MB) == [[3, 1], [2, 0]]


def test_the_layout_is_ddps_assignment_over_the_parameters_in_reverse():
    """What DDP's reducer builds after its first step when gradients become ready in reverse parameter order
    (the usual case), here fixed from the start."""
    rng = random.Random(0)
    for _ in range(100):
        dtypes = [torch.float32, torch.float16]
        tensors = [torch.empty(rng.choice([10, 1000, 100_000, 300_000]), dtype=rng.choice(dtypes))
                   for _ in range(rng.randint(1, 30))]
        last = len(tensors) - 1
        theirs, _ = dist._compute_bucket_assignment_by_size(tensors[::-1], [MB, 4 * MB], [False] * len(tensors))
        ours = bucket_layout([(t.numel() * t.element_size(), t.dtype) for t in tensors], MB, 4 * MB)
        assert ours == [[last - i for i in bucket] for bucket in theirs]


class Done:
    """A finished collective on one rank: the sum over a group of one."""

    def wait(self) -> bool:
        return True


class Recorder:
    """The reducer's collectives, recorded: which bucket went when, and how many gradients were ready then."""

    def __init__(self, reducer_params: list[torch.nn.Parameter]) -> None:
        self.params = reducer_params
        self.launches: list[tuple[torch.Tensor, int]] = []
        self.waited: list[int] = []

    def all_reduce(self, flat: torch.Tensor) -> Done:
        self.launches.append((flat.clone(), sum(p.grad is not None for p in self.params)))
        return Done()

    def wait(self, works: list[Done]) -> None:
        self.waited.append(len(works))


def _layers() -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(8, 8, bias=False) for _ in range(3))


def _model(*used: bool) -> tuple[torch.nn.Module, list[torch.nn.Parameter], Reducer, Recorder]:
    """Three linear layers in a row (bias-free, 64 floats each), one bucket per layer; a layer not `used`
    is left out of the forward pass."""
    layers = _layers()
    params = list(layers.parameters())
    recorder = Recorder(params)
    reducer = Reducer(params, bucket_layout([(256, torch.float32)] * 3, 256, 256), recorder.all_reduce, recorder.wait)
    reducer.world_size = 2
    for index, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda _p, index=index: reducer.ready(index))

    class Net(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer, use in zip(layers, used):
                x = layer(x) if use else x
            return x

    return Net(), params, reducer, recorder


def test_buckets_are_launched_during_backward_in_layout_order_with_ddps_arithmetic():
    net, params, reducer, recorder = _model(True, True, True)
    x = torch.randn(4, 8)
    net(x).square().sum().backward()
    # launched as soon as their layer's gradient came, while the earlier layers' were still being computed
    assert [ready for _, ready in recorder.launches] == [1, 2, 3]
    assert recorder.waited == [3]
    local = [flat for flat, _ in recorder.launches]
    for index, p in enumerate(params):
        # each gradient multiplied by 1 / world size once, and then the bucket's sum (one rank here)
        bucket = local[2 - index]
        assert p.grad is not None and torch.equal(p.grad.reshape(-1), bucket)
    # the same bits as the one-shot reduction it replaced: torch.cat(grads).mul_(1 / world size)
    plain = _layers()
    plain[2](plain[1](plain[0](x))).square().sum().backward()
    expected = torch.cat([p.grad.reshape(-1) for p in plain.parameters()]).mul_(0.5)
    assert torch.equal(torch.cat([p.grad.reshape(-1) for p in params]), expected)


def test_an_unused_parameter_holds_its_bucket_and_the_later_ones_until_backward_ends():
    net, params, reducer, recorder = _model(True, False, True)
    net(torch.randn(4, 8)).square().sum().backward()
    # bucket 0 (layer 2) went at once; bucket 1 (layer 1, unused) waits, and bucket 2 behind it, though ready
    assert [ready for _, ready in recorder.launches] == [1, 2, 2]
    assert torch.equal(params[1].grad, torch.zeros(8, 8))


def test_a_pass_cut_short_by_an_exception_does_not_swallow_the_next_one():
    net, params, reducer, recorder = _model(True, True, True)
    boom = params[0].register_hook(lambda grad: (_ for _ in ()).throw(KeyError("the script's own error")))
    with pytest.raises(KeyError):
        net(torch.randn(4, 8)).square().sum().backward()
    assert len(recorder.launches) == 2 and recorder.waited == []
    boom.remove()
    for p in params:
        p.grad = None
    net(torch.randn(4, 8)).square().sum().backward()  # a new pass: all three buckets, and the end-of-pass wait
    assert len(recorder.launches) == 5 and recorder.waited == [3]


def test_buckets_are_reused_pass_after_pass_and_made_anew_after_forget():
    """Each pass reduces into the same bucket tensors (no fresh memory per step), with the same bits whether
    the script drops its gradients between passes or zeroes them in place (then they are the buckets' views);
    after `forget` (an abandoned generation, whose all-reduces may still write) the buckets are new."""
    x = torch.randn(4, 8)
    results = []
    for set_to_none in (True, False):
        net, params, reducer, recorder = _model(True, True, True)
        for _ in range(3):
            for p in params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
            net(x).square().sum().backward()
        first_pass, last_pass = recorder.launches[:3], recorder.launches[-3:]
        assert all(torch.equal(a, b) for (a, _), (b, _) in zip(first_pass, last_pass))
        flats = [f for f in reducer.flats if f is not None]
        assert len(flats) == 3 and all(p.grad.untyped_storage().data_ptr() in
                                       {f.untyped_storage().data_ptr() for f in flats} for p in params)
        results.append(torch.cat([p.grad.reshape(-1) for p in params]).clone())
        reducer.forget()
        assert reducer.flats == [None, None, None]
        for p in params:
            p.grad = None
        net(x).square().sum().backward()
        assert all(f is not None and f.untyped_storage().data_ptr() not in {g.untyped_storage().data_ptr()
                                                                           for g in flats} for f in reducer.flats)
    assert torch.equal(results[0], results[1])
