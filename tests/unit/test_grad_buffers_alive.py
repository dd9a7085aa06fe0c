"""[Note: full-size gradient buffers alive in backward] (engine/grad_reduce.py): at stages 2/3 the bucket filling and
the reductions in flight hold at most `max_in_flight` full-size gradient buffers together, and a buffer given back
is not kept once no bucket still to fill has its size (issue 44, item 12); told that a bucket's gradients are coming
(a stage-3 unit's backward begins), the reducer makes room before autograd allocates them (issue 51, item 5). One
rank, so a reduction is a copy; what is checked is which buffers are alive at each gradient's arrival, and which
reductions are in flight when a layer's backward begins. [Note: reductions in flight on gloo] picks the bound."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from accelerate_zero.engine.buckets import BucketState, GradBucket, GradScaling, ReduceMode
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.grad_reduce import GradReducer, reductions_in_flight
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.scratch import ScratchBuffers
from accelerate_zero.engine.shard_plan import plan_group


CPU = torch.device("cpu")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    # Backward meets the three 8x8 layers first, then the 5x8 one: two bucket sizes, the odd one last. Each layer is a
    # bucket of two parameters, so a bucket fills over two gradient hooks.
    return nn.Sequential(nn.Linear(5, 8), *[nn.Linear(8, 8) for _ in range(3)])


def _run(max_in_flight: int, announce: bool = False) -> list[tuple[int, int, set[int]]]:
    model = _model()
    params = list(model.parameters())  # plan_group lays the buckets out in the order backward fills them
    plan = plan_group([tuple(p.shape) for p in params], 72, 1)
    scratch = ScratchBuffers(CPU)
    mode = ReduceMode.SCATTER_TO_SHARD
    buckets = [
        GradBucket(b, mode, 0, torch.float32, torch.float32, CPU, None, params, None, scratch) for b in plan.buckets
    ]
    locations = {params[s.param_index]: (i, s) for i, b in enumerate(plan.buckets) for s in b.slots}
    reducer = GradReducer(
        buckets,
        locations,
        DataParallelGroup(group=None, rank=0, world_size=1),
        CommStats(),
        GradScaling(1, False, 1.0, torch.float32),
        use_reduce_scatter=True,
        max_in_flight=max_in_flight,
        scratch=scratch,
    )
    reducer.register_hooks()
    seen: list[tuple[int, int, set[int]]] = []  # (bucket, full-size buffers alive, sizes kept for reuse)

    def record(param: torch.Tensor) -> None:  # runs after the reducer's hook on the same parameter
        alive = sum(bucket.grad is not None for bucket in buckets)
        seen.append((locations[param][0], alive, {t.numel() for t in scratch.cached_tensors()}))

    for param in params:
        param.register_post_accumulate_grad_hook(record)
    layers = [m for m in model if isinstance(m, nn.Linear)]
    bucket_of = {id(layer): locations[layer.weight][0] for layer in layers}

    def coming(layer: nn.Module) -> None:  # the layer's backward begins: its gradients are not computed yet
        if announce:
            reducer.gradients_coming(buckets[bucket_of[id(layer)]])
        in_flight = sum(bucket.state is BucketState.REDUCING for bucket in buckets)
        seen.append((-1, in_flight, set()))

    def hook_output(layer: nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: coming(layer))  # as stage 3 hooks a unit's backward: its output's gradient

    for layer in layers:
        layer.register_forward_hook(hook_output)
    # Hold every reduction in flight until it is finished by the reducer (one rank completes them at once).
    for _ in range(2):
        reducer.begin_backward(boundary=True)
        model(torch.randn(3, 5)).pow(2).sum().backward()
        reducer.end_backward()
        reducer.finish_step()
        reducer.zero_grad()
    assert [b.plan.numel for b in buckets] == [72, 72, 72, 48]
    return seen


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_the_bucket_filling_counts_against_the_reductions_in_flight(max_in_flight: int) -> None:
    seen = _run(max_in_flight)
    assert max(alive for bucket, alive, _ in seen if bucket >= 0) == max_in_flight, seen


@pytest.mark.parametrize("max_in_flight", [1, 2])
def test_gradients_coming_make_room_before_autograd_allocates_them(max_in_flight: int) -> None:
    unannounced = [in_flight for bucket, in_flight, _ in _run(max_in_flight) if bucket < 0]
    announced = [in_flight for bucket, in_flight, _ in _run(max_in_flight, announce=True) if bucket < 0]
    # Without the announcement the reductions of the layers before are still in flight while the next layer's
    # gradients are computed, one more full-size gradient than the bound.
    assert max(unannounced) == max_in_flight, unannounced
    assert max(announced) == max_in_flight - 1, announced


class _Group:
    def __init__(self, backend: str, world_size: int) -> None:
        self.backend, self.world_size = backend, world_size


def test_one_reduction_in_flight_on_gloo_at_stage_3() -> None:
    def bucket(mode: ReduceMode) -> GradBucket:
        (plan,) = plan_group([(8,)], 8, 1).buckets
        return GradBucket(plan, mode, 0, torch.float32, torch.float32, CPU, None, [nn.Parameter(torch.zeros(8))])

    partitioned, kept_full = [bucket(ReduceMode.SCATTER_TO_SHARD)], [bucket(ReduceMode.SCATTER_IN_PLACE)]
    gloo, nccl = _Group("gloo", 4), _Group("nccl", 4)
    in_flight: Any = reductions_in_flight  # the groups are stand-ins
    assert in_flight(True, partitioned, gloo, use_reduce_scatter=True, units=True) == 1
    assert in_flight(True, partitioned, nccl, use_reduce_scatter=True, units=True) == 2
    assert in_flight(True, kept_full, gloo, use_reduce_scatter=True, units=True) == 2
    assert in_flight(True, partitioned, gloo, use_reduce_scatter=False, units=True) == 2
    assert in_flight(False, partitioned, gloo, use_reduce_scatter=True, units=True) == 0
    assert in_flight(True, partitioned, gloo, use_reduce_scatter=True, units=False) == 2


def test_a_size_no_bucket_still_needs_is_not_kept() -> None:
    for bucket, _, kept in _run(2):
        if bucket == 3:  # the 5x8 layer fills: every 8x8 layer is done
            assert 72 not in kept, kept
