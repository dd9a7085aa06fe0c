"""Partitioned loading: a model that never exists whole on any rank.

The model is built with its parameters on the meta device (buffers real, so values computed at construction such
as rotary frequencies stay right), then each gather unit's shard is read from the safetensors files: only the rows
of each tensor that hold this rank's element ranges are read. Peak memory is this rank's shards plus one tensor's
rows; under NVMe parameter offload only the shards that stay in memory, since each one bound for a file is written
there as soon as it is read ([Note: partitioned loading under NVMe parameter offload]). `initialize` adopts the
shards (and the files) instead of flattening the parameters again.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from accelerate_zero.checkpoint.fragments import range_fragments
from accelerate_zero.checkpoint.hf_files import SafetensorsFolder
from accelerate_zero.config import ZeroConfig
from accelerate_zero.engine.groups import init_data_parallel_group, resolve_device
from accelerate_zero.engine.layout import plan_from_config
from accelerate_zero.engine.nodes import node_layout_from_env
from accelerate_zero.engine.shard_plan import BucketPlan, plan_group
from accelerate_zero.engine.stage3.flat_unit import FlatUnitBuffer
from accelerate_zero.engine.stage3.units import UnitLayout, find_unit_modules, layout_units
from accelerate_zero.offload.nvme_params import preload_rank_folder, spill_shard, swapped_flags


PRELOADED_ATTR = "_accelerate_zero_preloaded"


class RangeSource(Protocol):
    """Where a unit's values are read from: safetensors files, or parameters gathered from construction slices."""

    def read_range(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened tensor `name`."""


@dataclass
class Preloaded:
    """Shards made by `from_pretrained`, waiting for `initialize` to adopt them."""

    world_size: int
    rank: int
    dtype: torch.dtype
    flats: dict[tuple[int, ...], FlatUnitBuffer]
    """Keyed by the ids of the flat's parameters, in order."""
    spilled: dict[int, Path] = dataclasses.field(default_factory=dict)
    """id(flat) -> the file holding its shard (offload_param nvme: the flat's `shard` is an empty placeholder)."""


def from_pretrained(
    model_class: Any,
    path: str,
    config: Any = None,
    *,
    unit_classes: list[type[nn.Module] | str] | None = None,
    device: torch.device | str | None = None,
    process_group: dist.ProcessGroup | None = None,
    **model_kwargs: Any,
) -> nn.Module:
    """Loads a transformers model from a local folder with only this rank's stage-3 shards materialized.

    Below stage 3 (where every rank holds the full parameters anyway) this is `model_class.from_pretrained`.

    Args:
        model_class: e.g. `LlamaForCausalLM` or `AutoModelForCausalLM`.
        path: a local folder with config.json and safetensors weights.
        config: the ZeRO config (dict, path or ZeroConfig) that `initialize` will get; its stage, compute dtype
            (bf16/fp16) and stage3 thresholds decide the layout.
        unit_classes: as for `initialize`.
        model_kwargs: passed to the model's constructor (e.g. attn_implementation).

    Returns:
        The model; pass it to `accelerate_zero.initialize` with the same config on every rank.
    """
    zero = ZeroConfig.from_any(config if config is not None else {})
    if zero.zero_optimization.stage != 3:
        return model_class.from_pretrained(path, **model_kwargs)
    device = resolve_device(device)
    dp = init_data_parallel_group(device, process_group)
    # Under replicate x shard (mics_shard_size) a rank loads the shard its group partitions (engine/layout.py).
    sharding = plan_from_config(zero, node_layout_from_env(dp.world_size))
    num_shards, shard_rank = sharding.shard_size, sharding.shard_index_of(dp.rank)
    dtype = zero.compute_dtype
    model = _empty_model(model_class, path, model_kwargs)
    files = SafetensorsFolder(path)
    names = {id(p): n for n, p in model.named_parameters()}
    _check_keys(names.values(), files)
    zero_opt = zero.zero_optimization
    layout = unit_layout(model, zero, unit_classes)  # on the meta parameters: shapes and sizes are all it needs
    shapes = {id(p): tuple(p.shape) for p in model.parameters()}
    real = _replace_meta_parameters(model, device, dtype)
    names = {id(p): n for n, p in model.named_parameters()}
    # Every flat buffer in unit order (trainable, then frozen), the order the engine's units list them in.
    meta_members = [ps for spec in layout.units for ps in (spec.trainable, spec.frozen) if ps]
    members = [[real[id(p)] for p in ps] for ps in meta_members]
    plans = [plan_group([shapes[id(p)] for p in ps], sys.maxsize, num_shards).buckets[0] for ps in meta_members]
    spill = _spill_plan(zero, [plan.shard_numel for plan in plans], dp.rank)
    # Under parameter offload the shards live in host memory: they are read there, never staged on the device.
    offloaded = zero_opt.offload_param is not None and zero_opt.offload_param.device in ("cpu", "nvme")
    shard_device = torch.device("cpu") if offloaded else device
    flats, spilled = {}, {}
    for index, (params, plan) in enumerate(zip(members, plans, strict=True)):
        # A reader per unit: its files are unmapped after the unit, so the pages this rank read do not stay
        # resident until the whole model is loaded (they would double the loading peak).
        flat = load_flat(params, plan, names, SafetensorsFolder(path), shard_rank, dtype, device, shard_device)
        flats[tuple(id(p) for p in params)] = flat
        if spill is not None and spill.flags[index]:
            # [Note: partitioned loading under NVMe parameter offload] A shard the engine will keep in a file goes
            # there now, so no rank ever holds all of its shards (4/W bytes per parameter in fp32); the engine's
            # store moves the file into place instead of writing it.
            spilled[id(flat)] = spill.folder / f"flat{index:05d}.bin"
            spill_shard(flat, spilled[id(flat)])
    in_units = {id(p) for flat in flats.values() for p in flat.params}
    for param in model.parameters():
        if id(param) not in in_units:
            loaded = files.get(names[id(param)])
            param.data = loaded.to(device=device, dtype=dtype if loaded.is_floating_point() else loaded.dtype)
    _load_buffers(model, files, device)
    if spill is not None:  # the engine moves the files out; what it did not adopt goes with the model
        weakref.finalize(model, shutil.rmtree, spill.folder, True)
    setattr(model, PRELOADED_ATTR, Preloaded(num_shards, shard_rank, dtype, flats, spilled))
    return model


def unit_layout(
    model: nn.Module,
    zero: ZeroConfig,
    unit_classes: list[type[nn.Module] | str] | None,
    numel_of: Callable[[nn.Parameter], int] = torch.numel,
) -> UnitLayout:
    """The stage-3 units the engine will build for `model` under `zero` (what shards made before `initialize` are
    laid out by); `numel_of`: a parameter's real size, when its data is a placeholder."""
    zero_opt = zero.zero_optimization
    leaf = zero_opt.leaf_module
    return layout_units(
        model,
        find_unit_modules(model, unit_classes, extra_leaf=[*leaf.classes, *leaf.names] if leaf else []),
        zero_opt.stage3_param_persistence_threshold,
        model_persistence_threshold=zero_opt.stage3_model_persistence_threshold,
        numel_of=numel_of,
    )


@dataclass(frozen=True)
class _SpillPlan:
    folder: Path
    flags: list[bool]
    """Per flat, in loading order: its shard goes to a file (the engine's `choose_swapped` picks the same ones)."""


def _spill_plan(zero: ZeroConfig, shard_numels: list[int], rank: int) -> _SpillPlan | None:
    offload = zero.zero_optimization.offload_param
    if offload is None or offload.device != "nvme" or not offload.nvme_path:
        return None
    flags = swapped_flags(shard_numels, offload.max_in_cpu)
    if not any(flags):
        return None
    folder = preload_rank_folder(offload.nvme_path, rank)
    shutil.rmtree(folder, ignore_errors=True)  # left by a job that was killed while loading
    folder.mkdir(parents=True, exist_ok=True)
    return _SpillPlan(folder, flags)


def load_flat(
    params: list[nn.Parameter],
    plan: BucketPlan,
    names: dict[int, str],
    files: RangeSource,
    rank: int,
    dtype: torch.dtype,
    device: torch.device,
    shard_device: torch.device,
) -> FlatUnitBuffer:
    """This rank's shard of one unit, read from `files` (only the ranges it holds: from safetensors files, the rows
    holding them) into `shard_device` (the host under parameter offload); the parameters' full buffer is on the
    compute `device`."""
    lo, hi = plan.shard_range(rank)
    shard = torch.zeros(hi - lo, dtype=dtype, device=shard_device)
    for frag in range_fragments(plan, params, names, lo, hi):
        shard[frag.offset : frag.offset + frag.numel].copy_(files.read_range(frag.name, frag.start, frag.end))
    # The full buffer only provides the parameters' views; its storage is freed at once ([Note: what a parameter
    # points at while its unit is sharded]).
    full = torch.empty(plan.numel, dtype=dtype, device=device)
    views = [
        full[s.offset : s.offset + s.numel].view(s.shape) for s in sorted(plan.slots, key=lambda s: s.param_index)
    ]
    flat = FlatUnitBuffer(plan=plan, rank=rank, params=params, views=views, full=full, shard=shard)
    flat.free()
    return flat


def _empty_model(model_class: Any, path: str, model_kwargs: dict) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    with init_empty_weights(include_buffers=False):
        # Auto classes build with from_config, concrete model classes with _from_config.
        builder = model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config
        model = builder(hf_config, **model_kwargs)
    model.tie_weights()
    return model


def _replace_meta_parameters(model: nn.Module, device: torch.device, dtype: torch.dtype) -> dict[int, nn.Parameter]:
    """Swaps every meta parameter for an empty real one (a meta tensor cannot take real data), keeping ties."""
    real: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in real:
                kind = dtype if param.is_floating_point() else param.dtype
                real[id(param)] = nn.Parameter(torch.empty(0, device=device, dtype=kind), param.requires_grad)
            module._parameters[name] = real[id(param)]
    return real


def _check_keys(names: Any, files: SafetensorsFolder) -> None:
    missing = sorted(set(names) - files.keys())
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} parameters the model has, e.g. {missing[:5]}: partitioned loading "
            "needs every parameter in the safetensors files (is this checkpoint for this model class?)"
        )


def _load_buffers(model: nn.Module, files: SafetensorsFolder, device: torch.device) -> None:
    keys = files.keys()
    for name, buffer in model.named_buffers():
        buffer.data = (files.get(name) if name in keys else buffer.data).to(device)


def preloaded_numel(model: nn.Module) -> Callable[[nn.Parameter], int]:
    """A parameter's real size, also for the placeholders `from_pretrained` leaves behind."""
    preloaded: Preloaded | None = getattr(model, PRELOADED_ATTR, None)
    sizes = {}
    if preloaded is not None:
        for flat in preloaded.flats.values():
            sizes.update({id(flat.params[slot.param_index]): slot.numel for slot in flat.plan.slots})
    return lambda param: sizes.get(id(param), param.numel())


def adopt(model: nn.Module, params: list[nn.Parameter], world_size: int, rank: int) -> FlatUnitBuffer | None:
    """The preloaded flat holding exactly `params`, if `from_pretrained` made one for this layout."""
    preloaded: Preloaded | None = getattr(model, PRELOADED_ATTR, None)
    if preloaded is None:
        return None
    if (preloaded.world_size, preloaded.rank) != (world_size, rank):
        raise ValueError(
            f"the model was loaded for {preloaded.world_size} ranks (this is rank {preloaded.rank}) but the engine "
            f"runs on {world_size} (rank {rank}): call accelerate_zero.from_pretrained inside the same job"
        )
    return preloaded.flats.get(tuple(id(p) for p in params))
