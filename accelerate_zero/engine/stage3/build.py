"""Stage 3 as a composition: gather units for most parameters, stage-2 style groups for the persistent ones."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from accelerate_zero.engine.buckets import GradBucket, KeptFor, ReduceMode
from accelerate_zero.engine.flat_buffer import GroupShard, build_group_shard, group_slices
from accelerate_zero.engine.kept_grads import ArenaSlot, GradArena
from accelerate_zero.engine.scratch import ScratchBuffers
from accelerate_zero.engine.shard_plan import ParamSlot, plan_group
from accelerate_zero.engine.shard_slice import ShardSlice
from accelerate_zero.engine.stage3.flat_unit import FlatUnitBuffer, Scatter, build_flat, set_data
from accelerate_zero.engine.stage3.loading import PRELOADED_ATTR, adopt
from accelerate_zero.engine.stage3.param_unit import ParamUnit, unit_slices
from accelerate_zero.engine.stage3.units import UnitLayout, find_unit_modules, layout_units
from accelerate_zero.engine.stores import ShardStore


if TYPE_CHECKING:
    from accelerate_zero.config.schema import ZeroOptimizationConfig
    from accelerate_zero.offload.host_memory import HostMemory


@dataclass
class DtypePlan:
    compute: torch.dtype
    grad: torch.dtype
    comm: torch.dtype


@dataclass
class Stage3Parts:
    units: list[ParamUnit]
    root: ParamUnit
    persistent_groups: list[GroupShard]
    buckets: list[GradBucket]
    """Every gradient bucket in launch order: units in backward order, the root unit, then persistent ones."""
    locations: dict[nn.Parameter, tuple[int, ParamSlot]]
    unit_of_bucket: dict[int, ParamUnit]
    slices_by_group: list[list[ShardSlice]]


def plan_units(
    module: nn.Module,
    zero: ZeroOptimizationConfig,
    unit_classes: list[type[nn.Module] | str] | None = None,
    numel_of: Callable[[nn.Parameter], int] = torch.numel,
    exclude: Sequence[nn.Parameter] = (),
) -> UnitLayout:
    """`layout_units` with the unit modules and persistence thresholds of a `zero_optimization` config (its
    `leaf_module` classes and names are units too); what the engine builds and the estimates count."""
    leaf = zero.leaf_module
    extra = [*leaf.classes, *leaf.names] if leaf is not None else []
    return layout_units(
        module,
        find_unit_modules(module, unit_classes, extra_leaf=extra),
        zero.stage3_param_persistence_threshold,
        model_persistence_threshold=zero.stage3_model_persistence_threshold,
        numel_of=numel_of,
        exclude=exclude,
    )


# [Note: stage 3 initialisation, unit by unit]
# The model arrives wherever the user built it (host memory, usually) and must end with each rank holding its 1/W
# shard of every unit on the device. Moving the whole model to the device first (as stages 0-2 do) would put the
# whole model on every GPU at once: the OOM stage 3 exists to avoid. So the engine leaves stage 3's parameters
# where they are, and here each unit is cut on rank 0 into one shard per rank (cast to the compute dtype) and
# scattered ([Note: rank 0's weights, cut on rank 0] in flat_unit.py): every rank starts from rank 0's weights, as
# DDP and DeepSpeed do, and no rank other than rank 0 ever holds a unit whole or reads its own copy of one. The
# device never holds more than the shards plus one unit. Persistent parameters (small by definition) go to the
# device one by one and are broadcast, as are the buffers and what no unit holds (non-floating-point parameters of
# a quantized base), moved by `module.to`, which knows how to move those. A rank other than 0 may hold all of them
# on the meta device: they get empty storage on the device, which the broadcast fills.
def build_stage3(
    module: nn.Module,
    layout: UnitLayout,
    trainable_groups: list[list[nn.Parameter]],
    *,
    rank: int,
    world_size: int,
    cuts: bool,
    dtypes: DtypePlan,
    device: torch.device,
    reduce_bucket_numel: int,
    contiguous_gradients: bool,
    host_memory: HostMemory | None,
    broadcast: Callable[[torch.Tensor], None],
    scatter: Scatter,
    shard_store: ShardStore,
    kept_for: KeptFor | None = None,
    scratch: ScratchBuffers | None = None,
    fp32_masters: bool = True,
    own_group_units: Sequence[ParamUnit] = (),
) -> Stage3Parts:
    """Places the model on the device unit by unit ([Note: stage 3 initialisation, unit by unit]), flattens and
    shards every unit, and plans the persistent parameters per optimizer param group. Every gradient bucket takes
    its temporaries from `scratch`. `fp32_masters` False: no fp32 masters on the device (optimizer offload).
    `rank`/`world_size`: this rank's shard and the number of shards; `cuts`: this rank is the one whose weights
    every rank starts from (rank 0 of the world: with replicas, not every shard group's first rank).
    `own_group_units`: units built already, cut over a group of their own (split experts, [Note: experts below 1/ep
    at stage 3] in engine/experts/gather_units.py); their parameters are in `trainable_groups`, not in `layout`."""
    group_of = {param: index for index, params in enumerate(trainable_groups) for param in params}
    _refuse_meta_on_rank_0(module, cuts, device, broadcast)
    for param in layout.persistent:
        set_data(param, _on_device(param.data, device, dtypes.compute))
        broadcast(param.data)
    units = _build_units(
        module,
        layout,
        rank,
        world_size,
        cuts,
        dtypes,
        device,
        contiguous_gradients,
        host_memory,
        scatter,
        shard_store,
        kept_for,
        scratch,
    )
    units = _after_their_owners(units, own_group_units)
    _place_rest(module, layout, units, device, broadcast)
    root = units[-1]
    persistent = set(layout.persistent)
    persistent_groups = []
    for params in trainable_groups:
        kept = [p for p in params if p in persistent]
        plan = plan_group([tuple(p.shape) for p in kept], reduce_bucket_numel, world_size)
        persistent_groups.append(
            build_group_shard(
                kept,
                plan,
                rank=rank,
                mode=ReduceMode.SCATTER_TO_SHARD,
                compute_dtype=dtypes.compute,
                grad_dtype=dtypes.grad,
                comm_dtype=dtypes.comm,
                device=device,
                contiguous_gradients=contiguous_gradients,
                kept_for=kept_for,
                scratch=scratch,
                fp32_master=fp32_masters,
            )
        )
    ordered_units = [u for u in reversed(units) if u is not root] + [root]
    buckets: list[GradBucket] = []
    locations: dict[nn.Parameter, tuple[int, ParamSlot]] = {}
    unit_of_bucket: dict[int, ParamUnit] = {}
    for unit in ordered_units:
        if unit.bucket is None or unit.trainable is None:
            continue
        unit_of_bucket[len(buckets)] = unit
        for slot in unit.trainable.plan.slots:
            locations[unit.trainable.params[slot.param_index]] = (len(buckets), slot)
        buckets.append(unit.bucket)
    for shard in persistent_groups:
        for bucket in shard.buckets:
            for slot in bucket.plan.slots:
                locations[shard.params[slot.param_index]] = (len(buckets), slot)
            buckets.append(bucket)
    preloaded = getattr(module, PRELOADED_ATTR, None)
    spilled = dict(preloaded.spilled) if preloaded is not None else {}
    if preloaded is not None:
        delattr(module, PRELOADED_ATTR)
    _settle_shards(units, shard_store, spilled, host_memory)
    slices = [group_slices(shard) for shard in persistent_groups]
    for unit in units:
        shard_rank = unit.trainable.rank if unit.trainable is not None else rank  # a unit of its own group: its rank
        for index, unit_group in enumerate(
            unit_slices(unit, group_of, shard_rank, len(trainable_groups), fp32_masters)
        ):
            slices[index] += unit_group
    return Stage3Parts(units, root, persistent_groups, buckets, locations, unit_of_bucket, slices)


def _after_their_owners(units: list[ParamUnit], extra: Sequence[ParamUnit]) -> list[ParamUnit]:
    """`units` (the root unit last) with each of `extra` right after the last unit whose module contains its module
    (before the root when none does): its bucket completes before that unit's in backward."""
    out = list(units)
    for unit in extra:
        inside = [i for i, u in enumerate(out[:-1]) if any(m is unit.module for m in u.module.modules())]
        out.insert(inside[-1] + 1 if inside else len(out) - 1, unit)
    return out


# [Note: where an offloaded shard settles]
# Under offload_param each unit's shard ends in host memory or, under NVMe offload, in a file. Host memory for a GPU
# is page-locked chunks that buffers are cut from ([Note: pinned memory at its size] in offload/host_memory.py), and
# a buffer cut from a chunk can never be freed alone: freeing its storage frees the whole chunk under every other
# buffer. So the shards are first private host tensors; the store takes the ones bound for files (writing them and
# freeing their memory, or moving the file partitioned loading already wrote), and only the shards that stay are
# copied into the chunks. The optimizer's slices are cut after this, from each shard's final home.
def _settle_shards(
    units: list[ParamUnit], shard_store: ShardStore, spilled: dict[int, Path], host_memory: HostMemory | None
) -> None:
    shard_store.place(units, spilled)
    flats = [flat for unit in units for flat in unit.flats]
    if not {id(flat) for flat in flats if shard_store.swapped(flat)} >= set(spilled):
        raise ValueError(
            "the model was loaded by accelerate_zero.from_pretrained with NVMe parameter offload that this "
            "engine's config does not match (offload_param.device, max_in_cpu or the unit layout): pass "
            "initialize the same config as from_pretrained"
        )
    if host_memory is None:
        return
    for flat in flats:
        if not shard_store.swapped(flat):
            flat.shard = host_memory.empty(flat.shard.numel(), flat.shard.dtype).copy_(flat.shard)


def _refuse_meta_on_rank_0(
    module: nn.Module, cuts: bool, device: torch.device, broadcast: Callable[[torch.Tensor], None]
) -> None:
    """Every rank raises when rank 0 holds a parameter on the meta device (rank 0's weights are what every rank
    starts from), before any rank waits for rank 0 in a collective."""
    names = [name for name, p in module.named_parameters() if p.device.type == "meta"] if cuts else []
    flag = torch.tensor([len(names)], dtype=torch.int64, device=device)
    broadcast(flag)
    if flag.item():
        where = f" ({len(names)} of them, first {names[0]!r})" if names else ""
        raise ValueError(
            f"parameters are on the meta device on rank 0{where}: at stage 3 every rank starts from rank 0's "
            "weights, so rank 0 must hold real ones (the other ranks may build on the meta device)"
        )


def _on_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` on `device` in `dtype`; uninitialised storage for one on the meta device (to be broadcast into)."""
    if tensor.device.type == "meta":
        return torch.empty(tensor.shape, dtype=dtype, device=device)
    return tensor.to(device=device, dtype=dtype)


def _place_rest(
    module: nn.Module,
    layout: UnitLayout,
    units: list[ParamUnit],
    device: torch.device,
    broadcast: Callable[[torch.Tensor], None],
) -> None:
    """Buffers and the parameters no unit and no persistent group holds: moved by `module.to`, then broadcast.
    (The units' parameters are 0-element placeholders on the device by now: `to` leaves them as they are.)"""
    placed = {id(p) for p in (*layout.persistent, *layout.excluded)}
    placed |= {id(p) for unit in units for flat in unit.flats for p in flat.params}
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.device.type == "meta":  # a rank other than 0 that only built the model: rank 0's come below
            set_data(tensor, _on_device(tensor.data, device, tensor.dtype))
    module.to(device)
    for param in module.parameters():
        if id(param) not in placed:
            broadcast(param.data)
    for buffer in module.buffers():
        broadcast(buffer.data)


def _build_units(
    module: nn.Module,
    layout: UnitLayout,
    rank: int,
    world_size: int,
    cuts: bool,
    dtypes: DtypePlan,
    device: torch.device,
    contiguous_gradients: bool,
    host_memory: HostMemory | None,
    scatter: Scatter,
    shard_store: ShardStore,
    kept_for: KeptFor | None,
    scratch: ScratchBuffers | None,
) -> list[ParamUnit]:
    def flat_of(params: list[nn.Parameter]) -> FlatUnitBuffer | None:
        # The layout never depends on the optimizer, so shards made by partitioned loading are adopted as they are
        # (the loading ranks read the same files: nothing to broadcast); a unit's slices simply split where
        # optimizer param groups alternate.
        if not params:
            return None
        flat = adopt(module, params, world_size, rank)
        if flat is None:
            flat = build_flat(params, rank, world_size, dtypes.compute, device, scatter=scatter, cuts=cuts)
        if host_memory is not None and flat.shard.device.type != "cpu":
            # offload_param: the shard lives in host memory, copied in before each gather. A private copy for now:
            # [Note: where an offloaded shard settles] (pinned chunks only take the shards that stay).
            flat.shard = flat.shard.to("cpu", copy=True)
        return flat

    flats = [(flat_of(spec.trainable), flat_of(spec.frozen)) for spec in layout.units]
    arena, offset = None, 0
    if contiguous_gradients:
        # [Note: gradients live from the first backward to the optimizer step] in engine/kept_grads.py
        total = sum(train.plan.shard_numel for train, _ in flats if train is not None)
        arena = GradArena(total, dtypes.grad, device)
    units = []
    for index, (spec, (train_flat, frozen_flat)) in enumerate(zip(layout.units, flats, strict=True)):
        bucket = None
        if train_flat is not None:
            storage = None
            if arena is not None:
                storage = ArenaSlot(arena, offset)
                offset += train_flat.plan.shard_numel
            bucket = GradBucket(
                train_flat.plan,
                ReduceMode.SCATTER_TO_SHARD,
                rank,
                dtypes.grad,
                dtypes.comm,
                device,
                storage,
                train_flat.params,
                kept_for(train_flat.plan, ReduceMode.SCATTER_TO_SHARD) if kept_for is not None else None,
                scratch,
            )
        units.append(ParamUnit(index, spec.name, spec.module, train_flat, frozen_flat, bucket, shard_store))
    return units
