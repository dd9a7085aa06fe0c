"""`initialize` on a model partitioned at construction: its slices become the engine's shards, one unit at a time
([Note: parameters partitioned at construction] in init_shards.py).

At stage 3 each unit's parameters are gathered (every rank, unit by unit, in unit order), this rank's shard of the
unit is cut from them (`load_flat`, as partitioned loading reads files), and the gathered values are dropped before
the next unit: no rank holds more than one unit whole. The shards wait on the model for the engine to adopt, as
`from_pretrained`'s do (engine/stage3/loading.py). Below stage 3 every rank holds the whole model anyway: each
parameter gets its full values back.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from accelerate_zero.config import ZeroConfig
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.layout import LayoutPlan
from accelerate_zero.engine.shard_plan import plan_group
from accelerate_zero.engine.stage3 import init_shards
from accelerate_zero.engine.stage3.loading import PRELOADED_ATTR, Preloaded, load_flat, unit_layout


def adopt_init_shards(
    model: nn.Module,
    config: ZeroConfig,
    world: DataParallelGroup,
    sharding: LayoutPlan,
    device: torch.device,
    unit_classes: list[type[nn.Module] | str] | None,
) -> None:
    """Prepares a model built inside `PartitionedConstruction` for the engine; nothing to do for any other model.

    Raises:
        NotImplementedError: the model was partitioned at construction and `expert_parallel` splits its experts.
    """
    partitioned = init_shards.partitioned_params(model)
    if not partitioned:
        return
    if config.zero_optimization.stage != 3:
        for param in partitioned:
            param.data = init_shards.gather(param)
            init_shards.forget(param)
        return
    if config.expert_parallel.enabled:
        raise NotImplementedError(
            "expert_parallel with a model built under zero.Init (partitioned at construction): not available; build "
            "the model without zero.Init, or load it with accelerate_zero.from_pretrained"
        )
    records = {id(p): init_shards.init_shard_of(p) for p in partitioned}
    layout = unit_layout(model, config, unit_classes, numel_of=lambda p: _numel(records, p))
    names = {id(p): name for name, p in model.named_parameters()}
    num_shards, shard_rank = sharding.shard_size, sharding.shard_index_of(world.rank)
    dtype = config.compute_dtype
    offload = config.zero_optimization.offload_param
    shard_device = torch.device("cpu") if offload is not None and offload.device in ("cpu", "nvme") else device
    flats = {}
    for params in [ps for spec in layout.units for ps in (spec.trainable, spec.frozen) if ps]:
        shapes = [tuple(records[id(p)].shape) if id(p) in records else tuple(p.shape) for p in params]
        plan = plan_group(shapes, sys.maxsize, num_shards).buckets[0]
        unit = _GatheredUnit({names[id(p)]: _full_values(p) for p in params})
        flat = load_flat(params, plan, names, unit, shard_rank, dtype, device, shard_device)
        flats[tuple(id(p) for p in params)] = flat
    in_units = {param_id for ids in flats for param_id in ids}
    for param in partitioned:
        if id(param) not in in_units:  # persistent (small) parameters stay whole on every rank
            values = _full_values(param)
            param.data = values.to(dtype) if values.is_floating_point() else values
    for param in partitioned:
        init_shards.forget(param)
    setattr(model, PRELOADED_ATTR, Preloaded(num_shards, shard_rank, dtype, flats))


def _numel(records: dict[int, init_shards.InitShard], param: nn.Parameter) -> int:
    record = records.get(id(param))
    return record.numel if record is not None else param.numel()


def _full_values(param: nn.Parameter) -> torch.Tensor:
    """A parameter's full values: gathered from the construction slices, or its own data (built before the
    context, so never partitioned)."""
    return init_shards.gather(param) if init_shards.init_shard_of(param) is not None else param.data


class _GatheredUnit:
    """One unit's full values by parameter name, read as partitioned loading reads files."""

    def __init__(self, values: dict[str, torch.Tensor]) -> None:
        self.values = values

    def read_range(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.values[name].reshape(-1)[start:end]
