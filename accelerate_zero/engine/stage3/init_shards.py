"""Parameters partitioned while their model is built (DeepSpeed's `zero.Init`), before any engine exists.

[Note: parameters partitioned at construction]
A model built inside `PartitionedConstruction` (engine/stage3/construction.py) never exists whole on a rank: as
soon as a module is complete, each of its parameters keeps only this rank's slice of its flattened values (every
rank holds ceil(numel / W) elements, the last ones padded) and its data becomes a 0-element placeholder on the
compute device, as a stage-3 parameter's does. The slice lives here, in a side table keyed by the parameter
(weakly; nothing is attached to the parameter), so that:
- `GatheredParameters` can gather such a parameter before `initialize` (loading weights into a model built this
  way, as transformers and DeepSpeed's users do with `modifier_rank=0`);
- `initialize` turns the slices into its units' shards one unit at a time (engine/stage3/init_adoption.py), so no
  rank ever holds more than one unit's full values.
The per-parameter slices differ from the engine's per-unit shards (one flat buffer per unit, cut in W), which is
why adoption gathers each unit once; the construction itself never communicates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from accelerate_zero.engine import collectives
from accelerate_zero.engine.groups import DataParallelGroup


@dataclass
class InitShard:
    """This rank's slice of one parameter partitioned at construction."""

    shape: torch.Size
    """The parameter's full shape (its data is a 0-element placeholder)."""
    dtype: torch.dtype
    device: torch.device
    """Where the parameter computes: the full values are gathered there."""
    shard: torch.Tensor  # 1-D, ceil(numel / W) elements
    dp: DataParallelGroup
    stats: collectives.CommStats
    built_on: tuple[torch.device, torch.dtype] | None = None
    """Where and in which dtype the construction code made the parameter: while the construction is still running,
    its full values come back there (the code that touches them expects them there)."""
    whole: bool = False
    """The parameter holds its full values for now (`restore`), until `keep_slice_of` partitions it again."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def element_range(self) -> tuple[int, int]:
        """The elements of the flattened parameter this rank's slice holds (the rest of the slice is padding)."""
        start = min(self.dp.rank * self.shard.numel(), self.numel)
        return start, min(start + self.shard.numel(), self.numel)


# Keyed by identity: parameters compare element-wise, so a plain WeakKeyDictionary cannot hold them.
_INIT_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def init_shard_of(param: torch.Tensor) -> InitShard | None:
    """The slice of a parameter partitioned at construction, or None (a whole parameter, or an engine's)."""
    return _INIT_SHARDS.get(param)


def is_placeholder(tensor: torch.Tensor) -> bool:
    """True for a parameter partitioned at construction whose data is its placeholder now."""
    record = _INIT_SHARDS.get(tensor)
    return record is not None and not record.whole


def partitioned_params(module: nn.Module) -> list[nn.Parameter]:
    """`module`'s parameters that are partitioned at construction, in `parameters()` order."""
    return [p for p in module.parameters() if p in _INIT_SHARDS]


def partition(
    param: nn.Parameter,
    dp: DataParallelGroup,
    stats: collectives.CommStats,
    *,
    dtype: torch.dtype | None,
    device: torch.device,
    shard_device: torch.device,
    pin_memory: bool = False,
) -> None:
    """Keeps this rank's slice of `param` (cast to `dtype` if floating) and makes its data a placeholder.

    Args:
        dtype: the dtype floating-point parameters are kept in (DeepSpeed's `zero.Init(dtype=...)`); None keeps it.
        device: where the parameter computes (the placeholder's device, and where it is gathered).
        shard_device: where the slice lives (the compute device, or host memory for `remote_device="cpu"`).
        pin_memory: a host slice is page-locked (only with an accelerator to copy it to).
    """
    assert param not in _INIT_SHARDS, "a parameter is partitioned once"
    values = param.data
    kept = dtype if dtype is not None and values.is_floating_point() else values.dtype
    per_rank = math.ceil(values.numel() / dp.world_size)
    pin = pin_memory and shard_device.type == "cpu" and device.type != "cpu"
    shard = torch.zeros(per_rank, dtype=kept, device=shard_device, pin_memory=pin)
    record = InitShard(values.shape, kept, device, shard, dp, stats, built_on=(values.device, values.dtype))
    _INIT_SHARDS[param] = record
    keep_slice_of(param, values)


def gather(param: nn.Parameter) -> torch.Tensor:
    """The full values of a parameter partitioned at construction (a collective: every rank calls it, for the same
    parameters in the same order; none when it holds them now)."""
    record = _INIT_SHARDS[param]
    if record.whole:
        return param.data
    per_rank = record.shard.numel()
    full = torch.empty(per_rank * record.dp.world_size, dtype=record.dtype, device=record.device)
    local = record.shard.to(record.device, non_blocking=False)
    collectives.all_gather(full, local, record.dp, record.stats, kind="init_gather").wait()
    return full[: record.numel].view(record.shape)


def restore(param: nn.Parameter, values: torch.Tensor) -> None:
    """Gives a partitioned parameter full values (gathered, or about to be overwritten) until `keep_slice_of`."""
    param.data = values
    _INIT_SHARDS[param].whole = True


def keep_slice_of(param: nn.Parameter, full: torch.Tensor) -> None:
    """Writes this rank's part of `full` (every rank holds the same values: written by the same code, or broadcast)
    back into the parameter's slice and makes its data a placeholder again. No communication. `full` may have
    another shape than before (`param.data = larger`, an embedding resized): the parameter is partitioned anew."""
    record = _INIT_SHARDS[param]
    if full.shape != record.shape:
        del _INIT_SHARDS[param]
        device, shard_device, pin = record.device, record.shard.device, record.shard.is_pinned()
        partition(
            param,
            record.dp,
            record.stats,
            dtype=record.dtype,
            device=device,
            shard_device=shard_device,
            pin_memory=pin,
        )
        return
    start, end = record.element_range()
    with torch.no_grad():
        record.shard[: end - start].copy_(full.reshape(-1)[start:end])
    param.data = torch.empty(0, dtype=record.dtype, device=record.device)
    record.whole = False


def forget(param: nn.Parameter) -> InitShard:
    """Drops a parameter from the table (an engine owns it now); returns its record."""
    return _INIT_SHARDS.pop(param)
