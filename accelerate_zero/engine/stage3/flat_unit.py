"""FlatUnitBuffer: one flat buffer of a stage-3 unit, its full storage freed while sharded and this rank's shard
([Note: what a parameter points at while its unit is sharded] in engine/stage3/param_unit.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

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


Scatter = Callable[[torch.Tensor, "list[torch.Tensor] | None"], None]
"""Rank 0's list of W shards into each rank's output (None on the other ranks)."""


# [Note: rank 0's weights, cut on rank 0]
# Every rank starts from rank 0's weights (as DDP and DeepSpeed's zero.Init do), but no rank needs the whole unit
# to get there: rank 0 cuts the unit into its W shards and scatters them, and every other rank only allocates its
# own shard. The other ranks never read their own copy of the parameters: the pages of a checkpoint that
# `from_pretrained` mapped lazily stay unread there, and their parameters may even be on the meta device (the
# loading accelerate's FSDP `cpu_ram_efficient_loading` uses: rank 0 loads, the others only build). On rank 0 a
# unit that is one parameter already in the compute dtype and layout (embeddings, an LM head: the largest tensors)
# is scattered from views of it, without a copy. Any other unit is scattered in rounds: each round rank 0 copies
# the same column range of every rank's shard out of the parameters into one small buffer (at most
# `SCATTER_ROUND_NUMEL` elements for the W pieces) and scatters it, so no rank ever holds a unit whole, rank 0
# included (rank 0 held one flattened unit beside the shards: 20 MB above FSDP2's init peak on a Llama whose
# decoder layers are 28 MB, issue 44, item 12). Without a scatter each rank copies its own range the same way.
SCATTER_ROUND_NUMEL = 1 << 20


def build_flat(
    params: list[nn.Parameter],
    rank: int,
    num_shards: int,
    dtype: torch.dtype,
    device: torch.device,
    scatter: Scatter | None = None,
    cuts: bool | None = None,
) -> FlatUnitBuffer:
    """Flattens `params` into one padded bucket and keeps this rank's slice, the full buffer freed. `scatter`:
    the slices are rank 0's ([Note: rank 0's weights, cut on rank 0]); None: every rank cuts its own. `cuts`: this
    rank is the one that cuts and scatters (default: shard 0; with replicas, rank 0 of the world only)."""
    plan = plan_group([tuple(p.shape) for p in params], sys.maxsize, num_shards)
    (bucket,) = plan.buckets
    lo, hi = bucket.shard_range(rank)
    cutting = scatter is None or (cuts if cuts is not None else rank == 0)
    shard_views = _views_of(params, bucket, num_shards, dtype, device) if cutting else None
    if scatter is None:
        shard = (
            shard_views[rank].clone() if shard_views is not None else torch.empty(hi - lo, dtype=dtype, device=device)
        )
        if shard_views is None:
            _copy_range(shard, params, bucket, lo)
    else:
        shard = torch.empty(hi - lo, dtype=dtype, device=device)
        _scatter_in_rounds(shard, params if cutting else None, shard_views, bucket, num_shards, scatter)
    # The full buffer is never written here (on a CPU its pages are never touched): it only gives the parameters
    # their views, and its storage is freed at once.
    full = torch.empty(bucket.numel, dtype=dtype, device=device)
    views = [full[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in bucket.slots]
    views = [views[index] for index in sorted(range(len(views)), key=lambda i: bucket.slots[i].param_index)]
    for param in params:
        set_data(param, full.new_empty(0))
    flat = FlatUnitBuffer(plan=bucket, rank=rank, params=params, views=views, full=full, shard=shard)
    flat.free()
    return flat


def set_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """`tensor.data = value`, also for a tensor on the meta device (whose data cannot be re-pointed at real storage:
    its contents are swapped instead, keeping the Python object every reference holds, the optimizer's included)."""
    if tensor.device.type != "meta":
        tensor.data = value
    elif isinstance(tensor, nn.Parameter):
        torch.utils.swap_tensors(tensor, nn.Parameter(value, requires_grad=tensor.requires_grad))
    else:
        torch.utils.swap_tensors(tensor, value)


def _views_of(
    params: list[nn.Parameter], bucket: BucketPlan, num_shards: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor] | None:
    """The W shards as views of the unit's only parameter, when it needs no cast, move or padding; else None."""
    only = params[0].detach() if len(params) == 1 else None
    if only is None or bucket.padding or only.dtype != dtype or only.device != device or not only.is_contiguous():
        return None
    flat = only.reshape(-1)
    return [flat[lo:hi] for lo, hi in (bucket.shard_range(r) for r in range(num_shards))]


def _copy_range(out: torch.Tensor, params: list[nn.Parameter], bucket: BucketPlan, start: int) -> None:
    """Elements [start, start + out.numel()) of the unit flattened by `bucket` into `out` (zeros in the padding)."""
    end = start + out.numel()
    out.zero_()
    for slot in bucket.slots:
        lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
        if lo < hi:
            values = params[slot.param_index].detach().reshape(-1)[lo - slot.offset : hi - slot.offset]
            out[lo - start : hi - start].copy_(values)


def _scatter_in_rounds(
    shard: torch.Tensor,
    params: list[nn.Parameter] | None,
    shard_views: list[torch.Tensor] | None,
    bucket: BucketPlan,
    num_shards: int,
    scatter: Scatter,
) -> None:
    """[Note: rank 0's weights, cut on rank 0]: `params` on the rank that cuts, None on the others, which only
    receive; `shard_views`: the W shards as views of the parameter, sent without a copy. Every rank runs the same
    rounds (the plan is the same everywhere, whichever way rank 0 cuts)."""
    width = max(1, SCATTER_ROUND_NUMEL // num_shards)
    pieces = None
    if params is not None and shard_views is None:
        pieces = torch.empty(num_shards, min(width, shard.numel()), dtype=shard.dtype, device=shard.device)
    for column in range(0, shard.numel(), width):
        out = shard[column : column + width]
        if shard_views is not None:
            scatter(out, [view[column : column + out.numel()] for view in shard_views])
        elif pieces is not None and params is not None:
            round_pieces = pieces[:, : out.numel()]
            for r in range(num_shards):
                _copy_range(round_pieces[r], params, bucket, bucket.shard_range(r)[0] + column)
            scatter(out, list(round_pieces.unbind(0)))
        else:
            scatter(out, None)
