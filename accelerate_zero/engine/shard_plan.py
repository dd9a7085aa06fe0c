"""Pure planning of flat buffers, buckets and shards; no torch.distributed here.

[Note: bucket-granular sharding]
A parameter group is laid out in one flat buffer made of buckets. Each bucket holds whole parameters (at most
`bucket_numel` elements unless one parameter alone is larger) and is padded to a multiple of `num_shards`, so
every bucket splits into `num_shards` equal slices and rank r owns slice r of *every* bucket. This lets each
bucket be reduced with one `reduce_scatter` and rebuilt with one `all_gather` directly on views of the flat
buffers (no copy-in or copy-out), at the price of a rank's shard being the concatenation of its slices. Stage 0
plans with `num_shards=1`: the single slice is the whole bucket. Stage 3 uses the same plan with one bucket per
gather unit.

[Note: shard alignment]
Each bucket is padded to a multiple of `num_shards * SHARD_ALIGNMENT` elements, so every slice (and every bucket in
the flat buffer) starts on a 16-byte boundary for any element size of 2 bytes or more: NCCL and the copy kernels take
slower paths for chunks that are not 16-byte aligned. The cost is at most `8 * num_shards - 1` padding elements per
bucket (DeepSpeed aligns its partitions the same way; FSDP2 pads to the world size only).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


SHARD_ALIGNMENT = 8
"""Elements each slice is a multiple of: 16 bytes of a 2-byte dtype, 32 of a 4-byte one."""


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives inside its bucket."""

    param_index: int
    """Position of the parameter in the list the plan was made from."""
    offset: int
    """First element of the parameter inside the bucket."""
    numel: int
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BucketPlan:
    """One unit of communication: a contiguous range of the group's flat buffer."""

    index: int
    """Position of the bucket in the group; buckets are reduced in this order."""
    offset: int
    """First element of the bucket inside the group's flat buffer."""
    numel: int
    """Padded number of elements, a multiple of `num_shards * SHARD_ALIGNMENT`."""
    num_shards: int
    slots: tuple[ParamSlot, ...]

    @property
    def shard_numel(self) -> int:
        return self.numel // self.num_shards

    @property
    def padding(self) -> int:
        return self.numel - sum(slot.numel for slot in self.slots)

    def shard_range(self, shard: int) -> tuple[int, int]:
        """The [start, end) range of `shard`'s slice, relative to the bucket."""
        start = shard * self.shard_numel
        return start, start + self.shard_numel

    def slot_overlap(self, slot: ParamSlot, shard: int) -> tuple[int, int] | None:
        """The [start, end) part of `slot` (relative to the parameter) that falls into `shard`'s slice."""
        lo, hi = self.shard_range(shard)
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start >= end:
            return None
        return start - slot.offset, end - slot.offset


@dataclass(frozen=True)
class GroupPlan:
    """The flat layout of one parameter group, split into buckets."""

    buckets: tuple[BucketPlan, ...]
    num_shards: int

    @property
    def numel(self) -> int:
        return sum(bucket.numel for bucket in self.buckets)

    @property
    def shard_numel(self) -> int:
        """Elements one rank owns in this group (the sum of its slice of every bucket)."""
        return sum(bucket.shard_numel for bucket in self.buckets)

    @property
    def padding(self) -> int:
        return sum(bucket.padding for bucket in self.buckets)

    def shard_offsets(self) -> list[int]:
        """Where each bucket's slice starts inside a rank's concatenated shard."""
        offsets, total = [], 0
        for bucket in self.buckets:
            offsets.append(total)
            total += bucket.shard_numel
        return offsets


def plan_group(shapes: Sequence[tuple[int, ...]], bucket_numel: int, num_shards: int) -> GroupPlan:
    """Lays out parameters of the given shapes into padded buckets.

    Parameters are taken in reverse order, the order in which backward usually produces their gradients, so the
    first bucket fills first and its reduction can start while backward still runs.

    Args:
        shapes: the parameters' shapes, in the order of the optimizer's param group.
        bucket_numel: the most elements one bucket holds; a larger parameter gets a bucket of its own.
            0 means one parameter per bucket.
        num_shards: how many slices each bucket is split into (the data-parallel world size; 1 for stage 0).

    Returns:
        The plan; an empty plan (no buckets) for an empty list of shapes.

    Raises:
        ValueError: if `num_shards` < 1 or `bucket_numel` < 0.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards=}")
    if bucket_numel < 0:
        raise ValueError(f"bucket_numel must be >= 0, got {bucket_numel=}")
    groups: list[list[int]] = []
    current: list[int] = []
    current_numel = 0
    for index in reversed(range(len(shapes))):
        numel = math.prod(shapes[index])
        if current and current_numel + numel > bucket_numel:
            groups.append(current)
            current, current_numel = [], 0
        current.append(index)
        current_numel += numel
    if current:
        groups.append(current)
    return GroupPlan(buckets=_lay_out(groups, shapes, num_shards), num_shards=num_shards)


def _lay_out(groups: list[list[int]], shapes: Sequence[tuple[int, ...]], num_shards: int) -> tuple[BucketPlan, ...]:
    buckets, group_offset = [], 0
    for bucket_index, indices in enumerate(groups):
        slots, offset = [], 0
        for index in indices:
            numel = math.prod(shapes[index])
            slots.append(ParamSlot(param_index=index, offset=offset, numel=numel, shape=tuple(shapes[index])))
            offset += numel
        multiple = num_shards * SHARD_ALIGNMENT  # [Note: shard alignment]
        padded = max(multiple, math.ceil(offset / multiple) * multiple)
        buckets.append(
            BucketPlan(
                index=bucket_index, offset=group_offset, numel=padded, num_shards=num_shards, slots=tuple(slots)
            )
        )
        group_offset += padded
    return tuple(buckets)
