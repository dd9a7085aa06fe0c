"""The flat layout: buckets hold whole parameters, pad to the shard count, and every element has one owner."""

from __future__ import annotations

import math

import pytest

from accelerate_zero.engine.shard_plan import plan_group


SHAPES = [(15, 7), (15,), (15,), (15,), (15, 15), (15,), (3, 15), (3,)]


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
@pytest.mark.parametrize("bucket_numel", [0, 30, 64, 10**9])
def test_every_element_has_exactly_one_owner(num_shards: int, bucket_numel: int) -> None:
    plan = plan_group(SHAPES, bucket_numel, num_shards)
    owners: dict[tuple[int, int], int] = {}
    for bucket in plan.buckets:
        assert bucket.numel % num_shards == 0
        for slot in bucket.slots:
            for shard in range(num_shards):
                part = bucket.slot_overlap(slot, shard)
                if part is None:
                    continue
                for element in range(*part):
                    assert (slot.param_index, element) not in owners
                    owners[(slot.param_index, element)] = shard
    assert len(owners) == sum(math.prod(s) for s in SHAPES)
    assert plan.shard_numel * num_shards == plan.numel


def test_buckets_follow_reverse_parameter_order_and_size_limit() -> None:
    plan = plan_group(SHAPES, 64, 2)
    order = [slot.param_index for bucket in plan.buckets for slot in bucket.slots]
    assert order == list(reversed(range(len(SHAPES))))
    for bucket in plan.buckets:
        real = sum(slot.numel for slot in bucket.slots)
        assert real <= 64 or len(bucket.slots) == 1
    # (15, 15) = 225 elements is larger than a bucket: it travels alone.
    assert any(len(b.slots) == 1 and b.slots[0].numel == 225 for b in plan.buckets)


def test_padding_and_offsets() -> None:
    # [Note: shard alignment]: every slice is a multiple of SHARD_ALIGNMENT (8) elements.
    plan = plan_group([(7,)], 100, 4)
    (bucket,) = plan.buckets
    assert (bucket.numel, bucket.padding, bucket.shard_numel) == (32, 25, 8)
    assert bucket.shard_range(3) == (24, 32)
    assert bucket.slot_overlap(bucket.slots[0], 0) == (0, 7)
    assert bucket.slot_overlap(bucket.slots[0], 3) is None  # a slice of padding only
    assert plan_group([(5,), (6,)], 5, 3).shard_offsets() == [0, 8]
    assert plan_group([(49,)], 100, 3).buckets[0].numel == 72  # the next multiple of 3 * 8


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4, 7])
def test_every_slice_starts_on_16_bytes(num_shards: int) -> None:
    plan = plan_group([(13,), (8, 5), (1,), (300,), (3, 3)], 64, num_shards)
    offsets = plan.shard_offsets()
    for bucket, offset in zip(plan.buckets, offsets, strict=True):
        for element_size in (2, 4):
            assert (bucket.offset * element_size) % 16 == 0
            assert all((bucket.shard_range(r)[0] * element_size) % 16 == 0 for r in range(num_shards))
            assert (offset * element_size) % 16 == 0
        assert bucket.padding < 8 * num_shards


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_shards"):
        plan_group(SHAPES, 10, 0)
    assert plan_group([], 10, 2).buckets == ()
