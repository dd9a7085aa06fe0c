"""Full weights streamed out of a sharded engine: `ZeroEngine.named_full_parameters()`.

[Note: streaming full weights to a generator]
An RL trainer hands its new weights to a generation engine (vLLM's `load_weights`, a server's weight update, a
plain transformers model) after every step. Gathering the whole model first needs the whole model on the device
at once: the out-of-memory users of TRL's ZeRO-3 sync report, which gathers everything to merge a PEFT adapter. Here
the units are gathered in their layout order, a few at a time (as many as fit in `max_bytes`, at least one), each
full parameter is yielded while its unit is gathered, and the unit is released before the next ones are gathered:
the device holds at most `max(max_bytes, the largest unit)` of gathered weights plus the tensor being handed over.
That tensor is one of its own (a copy, a cast or a merged LoRA weight): the unit's buffer is freed under any view
of it, and a receiver that batches several tensors before sending them (a packing broadcast) must read them
intact. Each parameter is yielded once. A LoRA adapter (peft) is merged on the fly: the base weight comes out as
`W + scale * B @ A` under the base model's own name (`base_model.model.` and `.base_layer` dropped, the adapter's
own tensors left out), which is what a generator built from the base checkpoint expects.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Collection, Iterator
from typing import Protocol

import torch
from torch import nn

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


_ADAPTER_COPY = re.compile(r"modules_to_save\.[^.]+\.")


def named_full_parameters(
    engine: StreamedEngine,
    max_bytes: int | None = None,
    dtype: torch.dtype | None = None,
    rank0_only: bool = False,
    merge_lora: bool = True,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Implements `ZeroEngine.named_full_parameters` ([Note: streaming full weights to a generator])."""
    module = engine.module
    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(id(param), name)
    lora_of = _lora_layers(module) if merge_lora else {}
    emit = not rank0_only or engine.layout.world.rank == 0
    done: set[int] = set()
    for batch in _unit_batches(engine, max_bytes):
        with torch.no_grad(), GatheredParameters(batch):
            for param in batch:
                if id(param) in names and id(param) not in done:
                    done.add(id(param))
                    if emit:
                        yield from _named(names[id(param)], param, lora_of, merge_lora, dtype, owned=True)
    with torch.no_grad():  # not partitioned: persistent parameters, stages 0-2, non-floating-point ones
        for name, param in module.named_parameters():
            if id(param) not in done and emit:
                yield from _named(name, param, lora_of, merge_lora, dtype)


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


def _lora_layers(module: nn.Module) -> dict[int, nn.Module]:
    """id(base weight) -> the peft LoRA layer that wraps it (none without peft, or for a model without adapters)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return {}
    found = {}
    for name, layer in module.named_modules():
        if isinstance(layer, LoraLayer) and not getattr(layer, "merged", False):
            if any(getattr(layer, "use_dora", {}).get(a, False) for a in layer.active_adapters):
                raise NotImplementedError(
                    f"named_full_parameters(merge_lora=True): {name} is a DoRA layer, which is not merged on the fly; "
                    "pass merge_lora=False and merge on the receiving side"
                )
            found[id(layer.get_base_layer().weight)] = layer
    return found


def _named(
    name: str,
    param: torch.Tensor,
    lora_of: dict[int, nn.Module],
    merge_lora: bool,
    dtype: torch.dtype | None,
    owned: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """`owned`: `param` is a view of a gathered unit, whose storage is freed when the unit is released: the value
    handed over is a tensor of its own (a cast or a merge makes one anyway)."""
    value = param.data
    if merge_lora:
        if ".lora_" in name or "original_module" in name or "lora_magnitude_vector" in name:
            return  # merged into its base weight, or superseded by the adapter's copy
        name = _ADAPTER_COPY.sub("", name.removeprefix("base_model.model.").replace(".base_layer", ""))
        layer = lora_of.get(id(param))
        if layer is not None:
            merged = value.to(torch.float32, copy=True)  # never an alias of the gathered weight (fp32 training)
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    merged += layer.get_delta_weight(adapter).float()
            value, owned = merged.to(value.dtype), False
    if dtype is not None and dtype != value.dtype:
        value, owned = value.to(dtype), False
    yield name, value.clone() if owned else value


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
    for unit in engine.units:
        params = [p for flat in unit.flats for p in flat.params]
        if wanted is not None:
            params = [p for p in params if wanted.intersection(names[id(p)])]
            if not params:
                continue
        with GatheredParameters(params):
            if main:
                gathered.update({name: to_cpu(p) for p in params for name in names[id(p)]})
    if not main:
        return {}
    with guard.disabled() if guard is not None else contextlib.nullcontext():
        full = engine.module.state_dict()
    return {
        name: gathered[name] if name in gathered else to_cpu(t)
        for name, t in full.items()
        if wanted is None or name in wanted
    }
