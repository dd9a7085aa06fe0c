"""GatheredParameters: read full parameters, or write them from one rank, whatever the stage.

DeepSpeed's `GatheredParameters(params, modifier_rank=None)` takes parameters only, so the engine that owns a
parameter is found in a side table keyed by the parameter (weakly: it never keeps a model alive); a parameter
partitioned while its model was built, before any engine (zero.Init), is found in init_shards.py's table. Those are
the package's two module-level tables; nothing is attached to `nn.Parameter` objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from accelerate_zero.checkpoint.async_save import wait_for_snapshots
from accelerate_zero.engine import collectives
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.host_copies import HostCopies
from accelerate_zero.engine.layout import ShardingLayout
from accelerate_zero.engine.stage3 import init_shards
from accelerate_zero.engine.stage3.construction import PartitionedConstruction
from accelerate_zero.engine.stage3.external import attach, find_unit, remember_registration
from accelerate_zero.engine.stage3.param_unit import ParamUnit, UnitState


class ZeroEngine(Protocol):
    """What GatheredParameters needs of the engine that owns a parameter (engine.py implements it; typed here so
    that this module, which the engine imports, does not import the engine back)."""

    module: nn.Module
    units: list[ParamUnit]
    dp: DataParallelGroup
    layout: ShardingLayout
    comm_stats_counter: collectives.CommStats
    host_copies: HostCopies
    sharded_optimizer: Any
    experts: Any
    """The split MoE layers (engine/experts/parallel.py `ExpertPlacement`), or None."""


def units_of(engine: ZeroEngine, params: list[nn.Parameter]) -> list[ParamUnit]:
    """The stage 3 gather units holding any of `params`, in unit order (the same on every rank)."""
    wanted = {id(p) for p in params}
    return [u for u in engine.units if any(id(p) in wanted for flat in u.flats for p in flat.params)]


# Keyed by identity: tensors compare element-wise, so a plain WeakKeyDictionary cannot hold them.
_ENGINE_OF_PARAM: WeakIdKeyDictionary = WeakIdKeyDictionary()


def register_engine_params(engine: ZeroEngine) -> None:
    for param in engine.module.parameters():
        _ENGINE_OF_PARAM[param] = engine


def unregister_engine_params(engine: ZeroEngine) -> None:
    for param in engine.module.parameters():
        if _ENGINE_OF_PARAM.get(param) is engine:
            del _ENGINE_OF_PARAM[param]


class GatheredParameters:
    """Gathers the full values of `params` for the duration of the context.

    Every rank must enter the context with the same parameters (it communicates under stage 3). Parameters not
    managed by an engine are left as they are.

    Args:
        params: a parameter or an iterable of parameters.
        modifier_rank: None to read only. Otherwise the rank whose writes to the gathered parameters are kept:
            on exit its values are broadcast and become every rank's shard and fp32 master weights.
        enabled: False makes the context do nothing.

    Example:
        with accelerate_zero.GatheredParameters(model.lm_head.weight, modifier_rank=0):
            if rank == 0:
                model.lm_head.weight.zero_()
    """

    def __init__(
        self, params: nn.Parameter | Iterable[nn.Parameter], modifier_rank: int | None = None, enabled: bool = True
    ) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.modifier_rank, self.enabled = modifier_rank, enabled
        self._held: list[tuple[ZeroEngine, list[ParamUnit], list[bool]]] = []
        self._constructed: list[nn.Parameter] = []  # partitioned at construction, gathered here

    def __enter__(self) -> None:
        if not self.enabled:
            return
        self._constructed = _gather_constructed(self.params)
        for engine, params in _by_engine(self.params):
            if self.modifier_rank is not None:
                _refuse_split_experts(engine, params)
            units = units_of(engine, params)
            was_gathered = [unit.state is UnitState.GATHERED for unit in units]
            for unit in units:
                unit.holds += 1
                unit.unshard(engine.dp, engine.comm_stats_counter, copies=engine.host_copies)
            for unit in units:
                unit.wait_for_unshard()
            self._held.append((engine, units, was_gathered))

    def __exit__(self, *exc: Any) -> None:
        constructed, self._constructed = self._constructed, []
        _release_constructed(constructed, self.modifier_rank if exc[0] is None else None)
        held, self._held = self._held, []
        for engine, units, was_gathered in held:
            if self.modifier_rank is not None and exc[0] is None:
                _publish_writes(engine, units, self.modifier_rank, self.params)
            for unit, kept in zip(units, was_gathered, strict=True):
                unit.holds -= 1
                if not kept and unit.holds == 0:
                    unit.reshard()


def _refuse_split_experts(engine: ZeroEngine, params: list[nn.Parameter]) -> None:
    """Writes from one rank cannot reach split experts: every expert group holds other experts, so the modifier's
    values would overwrite the other groups' (on every rank alike: each enters with the same parameters)."""
    split = {id(p) for p in engine.experts.expert_parameters()} if engine.experts is not None else set()
    names = [name for name, p in engine.module.named_parameters() if id(p) in split and any(p is q for q in params)]
    if names:
        raise NotImplementedError(
            f"GatheredParameters(modifier_rank=...) on {names[0]}"
            + (f" and {len(names) - 1} more" if len(names) > 1 else "")
            + ": a split layer's experts (expert_parallel), of which each expert group holds other ones, so one "
            "rank's writes cannot become every rank's. Write them before initialize, or load them with load_checkpoint"
        )


def _gather_constructed(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Gives the parameters partitioned at construction (zero.Init, no engine yet) their full values; returns them."""
    gathered = []
    with PartitionedConstruction.paused():
        for param in params:
            if init_shards.is_placeholder(param) and not any(param is g for g in gathered):
                init_shards.restore(param, init_shards.gather(param))
                gathered.append(param)
    return gathered


def _release_constructed(params: list[nn.Parameter], modifier_rank: int | None) -> None:
    """Partitions them again; with a modifier, its values first reach every rank."""
    with PartitionedConstruction.paused(), torch.no_grad():
        for param in params:
            record = init_shards.init_shard_of(param)
            if modifier_rank is not None:
                collectives.broadcast(param.data, modifier_rank, record.dp, record.stats)
            init_shards.keep_slice_of(param, param.data)


def _by_engine(params: list[nn.Parameter]) -> list[tuple[ZeroEngine, list[nn.Parameter]]]:
    grouped: dict[int, tuple[ZeroEngine, list[nn.Parameter]]] = {}
    for param in params:
        engine = _ENGINE_OF_PARAM.get(param)
        if engine is not None:
            grouped.setdefault(id(engine), (engine, []))[1].append(param)
    return list(grouped.values())


def _publish_writes(engine: ZeroEngine, units: list[ParamUnit], src: int, params: list[nn.Parameter]) -> None:
    wait_for_snapshots()  # the masters are rewritten below: an asynchronous save's writer must have copied them
    with torch.no_grad():
        for unit in units:
            for flat in unit.flats:
                collectives.broadcast(flat.full, src, engine.layout.world, engine.comm_stats_counter)
            unit.refresh_shards_from_full()
        in_units = {id(p) for unit in units for flat in unit.flats for p in flat.params}
        for param in params:
            if id(param) not in in_units and _ENGINE_OF_PARAM.get(param) is engine:
                collectives.broadcast(param.data, src, engine.layout.world, engine.comm_stats_counter)
        engine.sharded_optimizer.refresh_masters()


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Declares that `module`'s forward uses `parameter`, which another module owns (DeepSpeed's API).

    Stage 3 then gathers the parameter's unit together with `module`'s unit. Uses in the first forward are found
    automatically; register the ones that only happen later (a branch not taken at first). Called before
    `initialize` (in the module's `__init__`, where DeepSpeed's users call it) it is remembered on the module and
    applied when the engine is built. No-op below stage 3.
    """
    engine = _ENGINE_OF_PARAM.get(parameter)
    if engine is None:
        remember_registration(module, parameter)
        return
    if not engine.units:
        return
    (used,) = units_of(engine, [parameter]) or (None,)
    if used is not None:
        attach(find_unit(engine.units, module), used)
