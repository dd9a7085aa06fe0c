"""FlatUnitBuffer: one flat buffer of a stage-3 unit, its full storage freed while sharded and this rank's shard
([Note: what a parameter points at while its unit is sharded] in engine/stage3/param_unit.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from accelerate_zero.engine.flat_buffer import flatten_params
from accelerate_zero.engine.shard_plan import BucketPlan, plan_group


@dataclass(repr=False)
class FlatUnitBuffer:
    """One flat buffer of a unit (its trainable or its frozen parameters)."""

    plan: BucketPlan
    rank: int
    """Whose slice `shard` is."""
    params: list[nn.Parameter]  # `ParamSlot.param_index` indexes this list
    views: list[torch.Tensor]  # per param: its view into `full` (what `.data` is while gathered)
    full: torch.Tensor  # 1D, plan.numel; storage freed while sharded
    shard: torch.Tensor  # 1D, plan.shard_numel: this rank's slice, always resident

    # The generated repr would print the parameters' views, whose storage is freed while the unit is sharded (and
    # printing freed storage crashes the interpreter): say what the buffer is instead.
    def __repr__(self) -> str:
        return f"FlatUnitBuffer({len(self.params)} params, {self.plan.shard_numel} elements per rank)"

    def allocate(self) -> None:
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.plan.numel * self.full.element_size())

    def expose(self) -> None:
        for param, view in zip(self.params, self.views, strict=True):
            param.data = view

    def free(self) -> None:
        placeholder = self.full.new_empty(0)
        for param in self.params:
            param.data = placeholder
        self.full.untyped_storage().resize_(0)


def build_flat(
    params: list[nn.Parameter],
    rank: int,
    num_shards: int,
    dtype: torch.dtype,
    device: torch.device,
    broadcast: Callable[[torch.Tensor], None] | None = None,
) -> FlatUnitBuffer:
    """Flattens `params` into one padded bucket on `device` (`broadcast` makes it rank 0's, in one collective),
    keeps this rank's slice, and frees the full buffer."""
    plan = plan_group([tuple(p.shape) for p in params], sys.maxsize, num_shards)
    full = flatten_params(params, plan, dtype, device)
    if broadcast is not None:
        broadcast(full)
    (bucket,) = plan.buckets
    lo, hi = bucket.shard_range(rank)
    views = [param.data for param in params]
    flat = FlatUnitBuffer(plan=bucket, rank=rank, params=params, views=views, full=full, shard=full[lo:hi].clone())
    flat.free()
    return flat
