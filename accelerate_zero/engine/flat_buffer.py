"""GroupShard: one optimizer param group flattened into buckets, and this rank's shard of it.

The parameters become views into one flat buffer (the layout of `shard_plan`), so the all-gather after the
optimizer step writes straight into the model's weights, and each bucket's slice owned by this rank is a view too.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch import nn

from accelerate_zero.engine import collectives
from accelerate_zero.engine.buckets import GradBucket, KeptFor, ReduceMode
from accelerate_zero.engine.collectives import CommStats, Pending
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.kept_grads import ArenaSlot, GradArena
from accelerate_zero.engine.scratch import ScratchBuffers
from accelerate_zero.engine.shard_plan import GroupPlan
from accelerate_zero.engine.shard_slice import ShardSlice


@dataclass
class GroupShard:
    """The flat storage of one param group and the fp32 master weights of this rank's shard."""

    plan: GroupPlan
    rank: int
    params: list[nn.Parameter]
    """Trainable parameters, in the optimizer group's order (`ParamSlot.param_index` indexes this list)."""
    param_buffer: torch.Tensor  # 1D, plan.numel, compute dtype; every param is a view into it
    buckets: list[GradBucket]  # plan.buckets order
    master: list[torch.Tensor]  # per bucket: fp32, bucket.shard_numel; views of param_buffer when it is fp32
    master_aliases_params: bool
    """True when `master` are views of `param_buffer` (fp32 training): no copy back after the step."""
    group: DataParallelGroup | None = None
    """The ranks this shard is cut over when they are not the engine's (a split layer's experts: [Note: expert
    parallelism in the engine] in engine/experts/partition.py); None: the engine's."""

    def bucket_params(self, index: int) -> torch.Tensor:
        bucket = self.plan.buckets[index]
        return self.param_buffer[bucket.offset : bucket.offset + bucket.numel]

    def param_shard(self, index: int) -> torch.Tensor:
        """This rank's slice of bucket `index`'s parameters."""
        lo, hi = self.plan.buckets[index].shard_range(self.rank)
        return self.bucket_params(index)[lo:hi]


def flatten_params(
    params: list[nn.Parameter], plan: GroupPlan, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Copies `params` into a new flat buffer laid out by `plan` and makes each parameter a view into it."""
    for param in params:
        if param.device.type == "meta":
            raise ValueError(
                f"a parameter of shape {tuple(param.shape)} is on the meta device: at stages 0-2 every rank holds "
                "the whole model, so every rank must load real weights; only stage 3 builds from rank 0's weights "
                "while the other ranks hold the model on the meta device"
            )
    buffer = torch.zeros(plan.numel, dtype=dtype, device=device)
    for bucket in plan.buckets:
        for slot in bucket.slots:
            param = params[slot.param_index]
            view = buffer[bucket.offset + slot.offset : bucket.offset + slot.offset + slot.numel]
            view.copy_(param.detach().reshape(-1))
            # Re-pointing .data keeps the Parameter object (and every reference to it) while moving its storage.
            param.data = view.view(slot.shape)
    return buffer


def build_group_shard(
    params: list[nn.Parameter],
    plan: GroupPlan,
    *,
    rank: int,
    mode: ReduceMode,
    compute_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    comm_dtype: torch.dtype,
    device: torch.device,
    contiguous_gradients: bool,
    kept_for: KeptFor | None = None,
    scratch: ScratchBuffers | None = None,
    fp32_master: bool = True,
) -> GroupShard:
    """Flattens one param group and creates its buckets (their temporaries from `scratch`) and fp32 master
    shard. `fp32_master` False: no master on the device (under optimizer offload the policy makes them in host
    memory; [Note: no device masters under optimizer offload] in engine/assemble.py)."""
    param_buffer = flatten_params(params, plan, compute_dtype, device)
    to_shard = mode is ReduceMode.SCATTER_TO_SHARD
    arena = None
    if contiguous_gradients:
        # [Note: gradients live from the first backward to the optimizer step] in engine/kept_grads.py
        arena = GradArena(plan.shard_numel if to_shard else plan.numel, grad_dtype, device)
    offsets = plan.shard_offsets() if to_shard else [b.offset for b in plan.buckets]
    buckets = []
    for bucket, offset in zip(plan.buckets, offsets, strict=True):
        storage = ArenaSlot(arena, offset) if arena is not None else None
        kept = kept_for(bucket, mode) if kept_for is not None else None
        buckets.append(GradBucket(bucket, mode, rank, grad_dtype, comm_dtype, device, storage, params, kept, scratch))
    shard = GroupShard(
        plan=plan,
        rank=rank,
        params=params,
        param_buffer=param_buffer,
        buckets=buckets,
        master=[],
        master_aliases_params=compute_dtype == torch.float32 or not fp32_master,
    )
    shard.master = _make_master(shard)
    return shard


def _make_master(shard: GroupShard) -> list[torch.Tensor]:
    views = [shard.param_shard(i) for i in range(len(shard.plan.buckets))]
    if shard.master_aliases_params:
        return views
    flat = torch.cat([v.float() for v in views]) if views else torch.zeros(0)
    return list(flat.split([v.numel() for v in views]))


def group_slices(shard: GroupShard) -> list[ShardSlice]:
    """One optimizer tensor per bucket: the bucket's whole slice of this rank."""
    return [
        ShardSlice(
            bucket=bucket,
            start=0,
            end=bucket.plan.shard_numel,
            master=shard.master[index],
            params=shard.master[index] if shard.master_aliases_params else shard.param_shard(index),
        )
        for index, bucket in enumerate(shard.buckets)
    ]


def all_gather_params(
    groups: list[GroupShard],
    dp: DataParallelGroup,
    stats: CommStats,
    *,
    max_numel_in_flight: int,
    use_all_gather: bool,
) -> None:
    """Rebuilds every bucket's full parameters from the ranks' updated slices (after the optimizer step).

    Args:
        max_numel_in_flight: `allgather_bucket_size`: the most elements being gathered at once.
        use_all_gather: `allgather_partitions`; False uses one broadcast per owner instead, as DeepSpeed does.

    Every collective writes in place into the flat parameter buffer and reads this rank's slice of it: no temporary
    exists, so the bound costs no memory either way. Under gloo `wait()` blocks the host, so at most
    `max_numel_in_flight` elements are being moved at once; under NCCL it only makes the compute stream wait, so every
    bucket is queued at once and NCCL runs them in order on its stream (the same result, with no host stall).
    """
    in_flight: collections.deque[tuple[Pending, int]] = collections.deque()
    live = 0
    for shard in groups:
        group = shard.group if shard.group is not None else dp
        if group.world_size == 1:
            continue  # nothing cut: this rank stepped the whole buffer
        for index, bucket in enumerate(shard.plan.buckets):
            full = shard.bucket_params(index)
            if use_all_gather:
                pendings = [collectives.all_gather(full, shard.param_shard(index), group, stats, async_op=True)]
            else:
                pendings = [
                    collectives.broadcast(full[slice(*bucket.shard_range(owner))], owner, group, stats, async_op=True)
                    for owner in range(group.world_size)
                ]
            for pending in pendings:
                in_flight.append((pending, bucket.numel))
                live += bucket.numel
            while live > max_numel_in_flight and len(in_flight) > 1:
                pending, numel = in_flight.popleft()
                pending.wait()
                live -= numel
    for pending, _ in in_flight:
        pending.wait()
