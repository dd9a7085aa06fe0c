"""Shard gradients live from the first reduction of a step to the step ([Note: gradients live from the first backward
to the optimizer step] in engine/kept_grads.py), cut from one arena under `contiguous_gradients`; and a
bucket that is one whole parameter reduces autograd's gradient itself ([Note: a single-tensor bucket reduces
autograd's gradient itself] in engine/buckets.py). One rank: the reduction is a copy, so values are plain sums."""

from __future__ import annotations

import pytest
import torch

from accelerate_zero.engine.buckets import GradBucket, GradScaling, ReduceMode
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.kept_grads import ArenaSlot, GradArena
from accelerate_zero.engine.shard_plan import plan_group


DP = DataParallelGroup(group=None, rank=0, world_size=1)
CPU = torch.device("cpu")


def _bucket(shapes: list[tuple[int, ...]], storage: ArenaSlot | None = None) -> GradBucket:
    (plan,) = plan_group(shapes, 10**6, 1).buckets
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    return GradBucket(plan, ReduceMode.SCATTER_TO_SHARD, 0, torch.float32, torch.float32, CPU, storage, params)


def _reduce(bucket: GradBucket) -> None:
    bucket.start_reduce(DP, CommStats(), GradScaling(1, False, 1.0, torch.float32), True, async_op=False)
    bucket.finish_reduce()


def test_the_arena_is_allocated_while_a_slot_is_held_and_freed_with_the_last() -> None:
    arena = GradArena(10, torch.float32, CPU)
    assert not arena.allocated
    first, second = arena.take(0, 4), arena.take(4, 6)
    assert arena.allocated and second.data_ptr() == first.data_ptr() + 4 * 4  # one buffer, cut in two
    arena.give()
    assert arena.allocated  # the second slot is still held
    arena.give()
    assert not arena.allocated
    with pytest.raises(AssertionError, match="not taken"):
        arena.give()


@pytest.mark.parametrize("contiguous", [True, False])
def test_the_shard_gradient_is_released_after_the_step_and_reads_right_again(contiguous: bool) -> None:
    shapes = [(8,), (6,)]
    arena = GradArena(2 * 16, torch.float32, CPU) if contiguous else None
    buckets = [_bucket(shapes, ArenaSlot(arena, 16 * i) if arena else None) for i in range(2)]
    for step in range(2):
        grads = [torch.randn(8), torch.randn(6)]
        for bucket in buckets:
            for slot in bucket.plan.slots:
                bucket.add_grad(slot, grads[slot.param_index] * (step + 1))
            _reduce(bucket)
        for bucket in buckets:
            shard = bucket.reduced_shard()
            for slot in bucket.plan.slots:
                got = shard[slot.offset : slot.offset + slot.numel]
                assert torch.equal(got, grads[slot.param_index] * (step + 1)), step
            assert bucket.gradient_tensors()  # held until the step
        if arena is not None:
            assert arena.allocated
        for bucket in buckets:
            bucket.zero()  # what the engine does after its step
            assert bucket.gradient_tensors() == []
        if arena is not None:
            assert not arena.allocated


def test_a_single_parameter_bucket_reduces_autograds_gradient_without_a_copy() -> None:
    bucket = _bucket([(4, 8)])  # 32 elements: no padding on one rank
    grad = torch.randn(4, 8)
    bucket.add_grad(bucket.plan.slots[0], grad)
    assert bucket.grad is not None and bucket.grad.data_ptr() == grad.data_ptr()  # adopted, not copied
    expected = grad.reshape(-1).clone()
    bucket.add_grad(bucket.plan.slots[0], grad)  # a second gradient in the same micro-step is added to it
    _reduce(bucket)
    assert torch.equal(bucket.reduced_shard(), 2 * expected)
    bucket.zero()
    # a gradient that is not contiguous (or of another dtype) is copied as before
    bucket.add_grad(bucket.plan.slots[0], torch.randn(8, 4).t())
    assert bucket.grad is not None and bucket.grad.is_contiguous()


def test_a_padded_or_multi_parameter_bucket_copies() -> None:
    for shapes in ([(3,)], [(4,), (4,)]):  # 3 elements get padding; two parameters share one buffer
        bucket = _bucket(shapes)
        grad = torch.randn(shapes[0])
        bucket.add_grad(bucket.plan.slots[0], grad)
        assert bucket.grad is not None and bucket.grad.data_ptr() != grad.data_ptr(), shapes
