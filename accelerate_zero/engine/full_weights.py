"""Full weights streamed out of a sharded engine: `ZeroEngine.named_full_parameters()`.

[Note: streaming full weights to a generator]
An RL trainer hands its new weights to a generation engine (vLLM's `load_weights`, a server's weight update, a
plain transformers model) after every step. Gathering the whole model first needs the whole model on the device
at once: the out-of-memory users of TRL's ZeRO-3 sync report, which gathers everything to merge a PEFT adapter. Here
the units are gathered in their layout order, a few at a time (as many as fit in `max_bytes`, at least one), each
full parameter is yielded while its unit is gathered, and the unit is released before the next ones are gathered:
the device holds at most `max(max_bytes, the largest unit)` of gathered weights plus the tensor being handed over.
Every tensor handed over is one of the receiver's own (a copy, a cast or a merged weight), whatever its source: a
gathered unit's buffer is freed under any view of it, a receiver that batches several tensors before sending them
(a packing broadcast) must read them intact, and a parameter that is not partitioned (stages 0-2, stage 3's
persistent ones) is the training weight itself: a view of it would change with the next step, and a receiver
writing into it would write into training. Each parameter is yielded once. peft adapters are merged on the fly,
under the base model's own names ([Note: merging every adapter kind peft has] in engine/adapter_merge.py), which is
what a generator built from the base checkpoint expects.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator
from typing import Protocol

import torch
from torch import nn

from accelerate_zero.engine.adapter_merge import Merge, adapter_merges, stream_name
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.experts.parallel import ExpertPlacement
from accelerate_zero.engine.experts.partition import whole_experts
from accelerate_zero.engine.gathered import GatheredParameters
from accelerate_zero.engine.layout import ShardingLayout
from accelerate_zero.engine.stage3.hooks import PlaceholderStateDictGuard
from accelerate_zero.engine.stage3.param_unit import ParamUnit


class StreamedEngine(Protocol):
    """What the stream reads of an engine (engine/engine.py implements it; typed here so that the engine, which
    imports this module, is not imported back)."""

    module: nn.Module
    layout: ShardingLayout
    units: list[ParamUnit]
    experts: ExpertPlacement | None
    comm_stats_counter: CommStats


def named_full_parameters(
    engine: StreamedEngine,
    max_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    rank0_only: bool = False,
    merge_lora: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Implements `ZeroEngine.named_full_parameters` ([Note: streaming full weights to a generator]); an adapter
    that cannot be merged is refused here, before anything is gathered."""
    merges = adapter_merges(engine.module) if merge_lora else {}
    return _stream(engine, max_bytes, dtype, rank0_only, merge_lora, merges)


def _stream(
    engine: StreamedEngine,
    max_bytes: int | None,
    dtype: torch.dtype | None,
    rank0_only: bool,
    merge_lora: bool,
    merges: dict[int, Merge],
) -> Iterator[tuple[str, torch.Tensor]]:
    module = engine.module
    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(id(param), name)
    emit = not rank0_only or engine.layout.world.rank == 0
    done: set[int] = set()
    whole = whole_experts(engine.experts, engine.comm_stats_counter)

    def named(name: str, param: nn.Parameter) -> Iterator[tuple[str, torch.Tensor]]:
        value = whole(param)  # a split layer's experts: gathered whole on every rank of its group
        # Their LoRA adapters (whole, partitioned like any parameter at stage 3) merged into them whole.
        adapters = engine.experts.adapter_parameters(param) if value is not None and merges else []
        with GatheredParameters(adapters):
            if emit:
                yield from _named(name, param, merges, merge_lora, dtype, value)

    for batch in _unit_batches(engine, max_bytes):
        with torch.no_grad(), GatheredParameters(batch):
            for param in batch:
                if id(param) in names and id(param) not in done:
                    done.add(id(param))
                    yield from named(names[id(param)], param)
    with torch.no_grad():  # not partitioned: persistent parameters, stages 0-2, non-floating-point ones
        for name, param in module.named_parameters():
            if id(param) not in done:
                yield from named(name, param)


def _unit_batches(engine: StreamedEngine, max_bytes: int | None) -> Iterator[list[nn.Parameter]]:
    """The units' parameters, a batch of consecutive units at a time whose full size fits in `max_bytes`."""
    batch: list[nn.Parameter] = []
    size = 0
    for unit in engine.units:
        unit_bytes = sum(flat.plan.numel * flat.shard.element_size() for flat in unit.flats)
        if batch and (max_bytes is None or size + unit_bytes > max_bytes):
            yield batch
            batch, size = [], 0
        batch += [param for flat in unit.flats for param in flat.params]
        size += unit_bytes
    if batch:
        yield batch


def _named(
    name: str,
    param: torch.Tensor,
    merges: dict[int, Merge],
    merge_lora: bool,
    dtype: torch.dtype | None,
    value: torch.Tensor | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream's (name, tensor) for `param` (`value`: its whole value when that is not `param.data`): always a
    tensor of the receiver's own, never a view of a training weight or of a gathered unit ([Note: streaming full
    weights to a generator])."""
    fresh = value is not None  # True once `value` is a tensor made here
    value = param.data if value is None else value
    if merge_lora:
        base_name = stream_name(name)
        if base_name is None:
            return  # an adapter's own tensor: merged into its base weight
        name = base_name
        merge = merges.get(id(param))
        if merge is not None:
            value, fresh = merge(value), True
    if dtype is not None and dtype != value.dtype:
        value, fresh = value.to(dtype), True
    yield name, value if fresh else value.clone()


def full_state_dict(
    engine: StreamedEngine,
    guard: PlaceholderStateDictGuard | None,
    dtype: torch.dtype | None = None,
    only: Collection[str] | None = None,
) -> dict[str, torch.Tensor]:
    """Implements `ZeroEngine.full_state_dict`: units gathered one at a time, copied to the CPU on rank 0 of the
    world. `guard`: the stage-3 state-dict guard, lifted while the rest of the state dict is read."""

    def to_cpu(tensor: torch.Tensor) -> torch.Tensor:
        cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        return tensor.detach().to(device="cpu", dtype=cast, copy=True)

    main = engine.layout.world.rank == 0
    gathered: dict[str, torch.Tensor] = {}
    names: dict[int, list[str]] = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    wanted = set(only) if only is not None else None
    whole = whole_experts(engine.experts, engine.comm_stats_counter)
    in_units = {id(p) for unit in engine.units for flat in unit.flats for p in flat.params}
    for unit in engine.units:
        params = [p for flat in unit.flats for p in flat.params]
        if wanted is not None:
            params = [p for p in params if wanted.intersection(names[id(p)])]
            if not params:
                continue
        with GatheredParameters(params):
            for param in params:
                value = whole(param)  # a split expert in a unit: the expert group's ranges too, every rank
                if main:
                    gathered.update({name: to_cpu(param if value is None else value) for name in names[id(param)]})
    for param in engine.experts.expert_parameters() if engine.experts is not None else ():
        if id(param) not in in_units and (wanted is None or wanted.intersection(names[id(param)])):
            value = whole(param)  # every rank of the expert group takes part
            if main and value is not None:
                gathered.update({name: to_cpu(value) for name in names[id(param)]})
    if not main:
        return {}
    with guard.disabled() if guard is not None else contextlib.nullcontext():
        full = engine.module.state_dict()
    return {
        name: gathered[name] if name in gathered else to_cpu(t)
        for name, t in full.items()
        if wanted is None or name in wanted
    }
