"""GradBucket, GradScaling and the host gradient slices on a one-rank group: accumulation (first write copied, later
ones added, unwritten slots zero), the late-gradient path, the state machine, and the staging ring.

One rank reduces by copying, so every expected value is a plain sum; the distributed tests check the same code
against a one-process reference at 2-4 ranks."""

from __future__ import annotations

import pytest
import torch

from accelerate_zero.engine.buckets import BucketState, GradBucket, GradScaling, ReduceMode
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.host_copies import HostCopies
from accelerate_zero.engine.host_grads import HostGradient, HostStaging
from accelerate_zero.engine.kept_grads import ArenaSlot, GradArena
from accelerate_zero.engine.shard_plan import plan_group


DP = DataParallelGroup(group=None, rank=0, world_size=1)
SHAPES = [(3,), (2, 2)]


def _bucket(mode: ReduceMode, storage: ArenaSlot | None = None) -> GradBucket:
    (plan,) = plan_group(SHAPES, 100, 1).buckets
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]
    return GradBucket(plan, mode, 0, torch.float32, torch.float32, torch.device("cpu"), storage, params)


def _slot(bucket: GradBucket, param_index: int):  # noqa: ANN202
    return next(s for s in bucket.plan.slots if s.param_index == param_index)


def _reduce(bucket: GradBucket) -> None:
    bucket.start_reduce(DP, CommStats(), GradScaling(1, False, 1.0, torch.float32), True, async_op=True)
    bucket.finish_reduce()


def _grads(bucket: GradBucket) -> dict[int, torch.Tensor]:
    shard = bucket.reduced_shard()
    return {s.param_index: shard[s.offset : s.offset + s.numel].clone() for s in bucket.plan.slots}


def test_stage_2_accumulates_micro_steps_and_reads_unwritten_slots_as_zero() -> None:
    bucket = _bucket(ReduceMode.SCATTER_TO_SHARD)
    a, b = torch.randn(3), torch.randn(4)
    bucket.add_grad(_slot(bucket, 0), a)
    _reduce(bucket)  # micro-step 1: only parameter 0
    assert bucket.state is BucketState.EMPTY and bucket.grad is None  # the full buffer is released
    bucket.add_grad(_slot(bucket, 0), a)
    bucket.add_grad(_slot(bucket, 1), b.reshape(2, 2))
    _reduce(bucket)  # micro-step 2: both
    grads = _grads(bucket)
    assert torch.equal(grads[0], 2 * a) and torch.equal(grads[1], b)
    padding = bucket.reduced_shard()[bucket.plan.numel - bucket.plan.padding :]
    assert padding.numel() > 0 and not padding.any()


@pytest.mark.parametrize("mode", [ReduceMode.ALL_REDUCE, ReduceMode.SCATTER_IN_PLACE])
def test_a_cycle_allocates_its_buffer_and_reads_zero_where_no_gradient_came(mode: ReduceMode) -> None:
    """Stages 0/1 with `contiguous_gradients`: the full-size buffer is cut from an arena by the first gradient of a
    cycle and released after the step ([Note: gradients live from the first backward to the optimizer step])."""
    arena = GradArena(plan_group(SHAPES, 100, 1).buckets[0].numel, torch.float32, torch.device("cpu"))
    bucket = _bucket(mode, ArenaSlot(arena, 0))
    assert not arena.allocated  # nothing before the first backward
    bucket.add_grad(_slot(bucket, 0), torch.ones(3))
    bucket.add_grad(_slot(bucket, 1), torch.ones(2, 2))
    _reduce(bucket)
    assert arena.allocated and _grads(bucket)[1].eq(1).all()
    bucket.zero()
    assert not arena.allocated and bucket.gradient_tensors() == []  # nothing between steps
    bucket.add_grad(_slot(bucket, 0), torch.full((3,), 2.0))
    bucket.add_grad(_slot(bucket, 0), torch.full((3,), 3.0))  # the second gradient of a slot is added
    _reduce(bucket)
    grads = _grads(bucket)
    assert grads[0].eq(5).all() and not grads[1].any()  # the slot no gradient came to reads zero


def test_a_late_gradient_is_reduced_again_and_added() -> None:
    bucket = _bucket(ReduceMode.ALL_REDUCE)
    bucket.add_grad(_slot(bucket, 0), torch.ones(3))
    bucket.add_grad(_slot(bucket, 1), torch.ones(2, 2))
    _reduce(bucket)
    assert bucket.state is BucketState.REDUCED
    late = bucket.add_grad(_slot(bucket, 1), torch.full((2, 2), 4.0))  # e.g. reentrant checkpointing
    assert late and bucket.state is BucketState.ACCUMULATING
    _reduce(bucket)
    grads = _grads(bucket)
    assert grads[0].eq(1).all() and grads[1].eq(5).all()


def test_the_state_machine_refuses_out_of_order_calls() -> None:
    bucket = _bucket(ReduceMode.SCATTER_TO_SHARD)
    bucket.add_grad(_slot(bucket, 0), torch.ones(3))
    scaling = GradScaling(1, False, 1.0, torch.float32)
    bucket.start_reduce(DP, CommStats(), scaling, True, async_op=True)
    with pytest.raises(RuntimeError, match="already has a reduction in flight"):
        bucket.start_reduce(DP, CommStats(), scaling, True, async_op=True)
    with pytest.raises(RuntimeError, match="finish_reduce"):
        bucket.reduced_shard()
    bucket.finish_reduce()
    bucket.finish_reduce()  # nothing in flight: nothing to do
    assert bucket.state is BucketState.EMPTY


@pytest.mark.parametrize(
    ("world", "prescale", "factor", "dtype", "expected"),
    [
        (4, False, 1.0, torch.float32, (1.0, 0.25)),  # fp32: divide after the sum, on the kept slice
        (4, False, 1.0, torch.bfloat16, (0.25, 1.0)),  # 16-bit: divide before, so the sum stays in range
        (4, True, 2.0, torch.float32, (0.5, 0.5)),  # prescale_gradients with gradient_predivide_factor
    ],
)
def test_grad_scaling_always_averages(world: int, prescale: bool, factor: float, dtype: torch.dtype, expected) -> None:  # noqa: ANN001
    scaling = GradScaling(world, prescale, factor, dtype)
    assert (scaling.pre, scaling.post) == expected and scaling.pre * scaling.post == pytest.approx(1 / world)


class _SeparateMemoryCopies(HostCopies):
    @property
    def host_is_device(self) -> bool:
        return False  # as on a GPU: slices go through copies and the staging ring


@pytest.mark.parametrize("separate_memory", [True, False], ids=["staged", "in_place"])
def test_host_gradients_fold_staged_micro_steps_through_a_two_slot_ring(separate_memory: bool) -> None:
    copies = (_SeparateMemoryCopies if separate_memory else HostCopies)(torch.device("cpu"))
    allocated = []

    def allocate(numel: int) -> torch.Tensor:
        allocated.append(numel)
        return torch.zeros(numel)

    staging = HostStaging(allocate)
    grads = [HostGradient(n, staging, copies, torch.zeros) for n in (4, 3, 2)]
    expected = [torch.zeros(n) for n in (4, 3, 2)]
    torch.manual_seed(0)
    for micro in range(3):
        for index in (2, 0, 1) if micro % 2 else (0, 1, 2):  # interleaved: a slot is taken back from another
            value = torch.randn(grads[index].numel)
            grads[index].add(value, 1.0, fresh=micro == 0)
            expected[index] = value.clone() if micro == 0 else expected[index] + value
    if separate_memory:
        assert allocated == [4, 4], "two staging buffers, allocated on first use"
    else:
        assert allocated == [], "on a CPU device slices are folded in place: no staging"
    for grad, want in zip(grads, expected, strict=True):
        assert torch.allclose(grad.read(0, grad.numel), want)
    assert copies.copies == 9  # one copy per bucket per micro-step
