"""GradReducer on a one-rank group: hooks feed buckets, reductions launch in the fixed bucket order as buckets fill,
sessions decide when a backward reduces, unused parameters are zeros or an error naming them, and a plain
`loss.backward()` outside a session is reduced at the step. One rank reduces by copying, so the averaged gradient
is the gradient autograd computed (compared with the same model's `.grad` without hooks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_zero.engine.buckets import BucketState, GradBucket, GradScaling, ReduceMode
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.grad_reduce import GradReducer
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.shard_plan import plan_group


DP = DataParallelGroup(group=None, rank=0, world_size=1)


class TwoBranches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.use_b:
            h = h + torch.tanh(self.b(h))
        return self.c(h)


def _reducer(model: nn.Module, mode: ReduceMode, **kwargs: object) -> tuple[GradReducer, list[GradBucket]]:
    params = list(model.parameters())
    plan = plan_group([tuple(p.shape) for p in params], 20, 1)  # about one parameter per bucket
    buckets = [
        GradBucket(b, mode, 0, torch.float32, torch.float32, torch.device("cpu"), None, params) for b in plan.buckets
    ]
    locations = {params[s.param_index]: (i, s) for i, b in enumerate(plan.buckets) for s in b.slots}
    names = {p: n for n, p in model.named_parameters()}
    reducer = GradReducer(
        buckets,
        locations,
        DP,
        CommStats(),
        GradScaling(1, False, 1.0, torch.float32),
        use_reduce_scatter=True,
        max_in_flight=2,
        param_names=names,
        **kwargs,  # type: ignore[arg-type]
    )
    reducer.register_hooks()
    return reducer, buckets


def _reference_grads(model: nn.Module, x: torch.Tensor, micro_steps: int = 1) -> dict[str, torch.Tensor]:
    clone = TwoBranches()
    clone.load_state_dict(model.state_dict())
    clone.use_b = model.use_b
    for _ in range(micro_steps):
        clone(x).sum().backward()
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in clone.named_parameters()}


def _reduced(model: nn.Module, reducer: GradReducer) -> dict[str, torch.Tensor]:
    out = {}
    for param, (index, slot) in reducer.locations.items():
        name = reducer.param_names[param]
        flat = reducer.buckets[index].reduced_shard()
        out[name] = flat[slot.offset : slot.offset + slot.numel].reshape(slot.shape)
    return out


@pytest.mark.parametrize("mode", list(ReduceMode))
def test_a_session_reduces_what_autograd_computed(mode: ReduceMode) -> None:
    torch.manual_seed(0)
    model, x = TwoBranches(), torch.randn(3, 4)
    reducer, buckets = _reducer(model, mode)
    launched: list[int] = []
    for index, bucket in enumerate(buckets):
        original = bucket.start_reduce

        def start(*args: object, _index: int = index, _original=original, **kwargs: object) -> None:  # noqa: ANN001
            launched.append(_index)
            _original(*args, **kwargs)

        bucket.start_reduce = start  # type: ignore[method-assign]
    reducer.begin_backward(boundary=True)
    model(x).sum().backward()
    reducer.end_backward()
    reducer.finish_step()
    assert launched == sorted(launched), "buckets launch in their fixed order"
    assert all(p.grad is None for p in model.parameters()), "the hooks take the gradient out of .grad"
    expected = _reference_grads(model, x)
    for name, grad in _reduced(model, reducer).items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=0)


def test_stage_0_and_1_reduce_only_on_the_boundary_stage_2_on_every_micro_step() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    for mode, reduces_early in ((ReduceMode.ALL_REDUCE, False), (ReduceMode.SCATTER_TO_SHARD, True)):
        model = TwoBranches()
        reducer, buckets = _reducer(model, mode)
        reducer.begin_backward(boundary=False)
        model(x).sum().backward()
        reducer.end_backward()
        states = {b.state for b in buckets}
        assert states == ({BucketState.EMPTY} if reduces_early else {BucketState.ACCUMULATING}), mode
        reducer.begin_backward(boundary=True)
        model(x).sum().backward()
        reducer.finish_step()
        expected = _reference_grads(model, x, micro_steps=2)
        for name, grad in _reduced(model, reducer).items():
            torch.testing.assert_close(grad, expected[name])


def test_an_unused_parameter_is_zero_or_an_error_naming_it() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    model = TwoBranches()
    model.use_b = False
    reducer, _ = _reducer(model, ReduceMode.SCATTER_TO_SHARD)
    reducer.begin_backward(boundary=True)
    model(x).sum().backward()
    reducer.finish_step()
    reduced = _reduced(model, reducer)
    assert not reduced["b.weight"].any() and not reduced["b.bias"].any()
    strict = TwoBranches()
    strict.use_b = False
    reducer, _ = _reducer(strict, ReduceMode.SCATTER_TO_SHARD, ignore_unused_parameters=False)
    reducer.begin_backward(boundary=True)
    strict(x).sum().backward()
    with pytest.raises(RuntimeError, match=r"\['b.bias', 'b.weight'\].*ignore_unused_parameters"):
        reducer.end_backward()


def test_a_plain_backward_outside_a_session_is_reduced_at_the_step() -> None:
    torch.manual_seed(0)
    model, x = TwoBranches(), torch.randn(3, 4)
    reducer, buckets = _reducer(model, ReduceMode.SCATTER_TO_SHARD)
    model(x).sum().backward()  # no begin_backward: e.g. a user's own loss.backward()
    assert {b.state for b in buckets} == {BucketState.ACCUMULATING}
    reducer.finish_step()
    expected = _reference_grads(model, x)
    for name, grad in _reduced(model, reducer).items():
        torch.testing.assert_close(grad, expected[name])


def test_begin_backward_twice_is_refused() -> None:
    reducer, _ = _reducer(TwoBranches(), ReduceMode.ALL_REDUCE)
    reducer.begin_backward(boundary=True)
    with pytest.raises(RuntimeError, match="begin_backward\\(\\) called twice"):
        reducer.begin_backward(boundary=True)
