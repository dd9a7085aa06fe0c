"""Stage 3 with ep < W: each split layer's experts as a gather unit cut over their expert peers.

[Note: experts below 1/ep at stage 3]
With W ranks and expert groups of ep, each rank holds E / ep experts of every MoE layer
([Note: expert parallelism in the engine] in engine/experts/partition.py), and W / ep peers hold the same ones. At
stages 1 and 2 those local experts stay whole between steps (a flat group partitioned over the peers, gathered
after the step). At stage 3 with more than one peer they are partitioned once more, as stage 3 partitions the rest
of the model over the world and as DeepSpeed's AutoEP partitions them over its expert-data-parallel group:
- each split layer's local experts (those above `stage3_param_persistence_threshold`, judged by the rule stage 3
  applies to every parameter, on their local size) form one gather unit, `ExpertUnit`, whose flat buffers are cut
  over the peers instead of the world. A rank then holds 1/(W/ep) of 1/ep of the experts: 1/W, as flat stage 3
  does. Its trainable part has a gradient bucket reduced over the peers (`reduce_group`), divided by W like every
  gradient ([Note: gradients of split experts] in engine/experts/parallel.py);
- the unit's module is the experts module itself, or the outermost peft wrapper around it: peft's `ParamWrapper`
  reads the parameter it adapts before it calls the experts (it parametrizes it), so the gather must come first;
- the unit is scheduled like any other (stage3/schedule.py): gathered before its forward (prefetched along the
  execution-order trace), released after it or kept for backward as the reuse distance says, gathered again
  before its backward and released when its gradients are reduced. Only its collectives run over the peers
  (`ExpertUnit.unshard`); the tokens' all-to-alls still run over the expert group inside its forward;
- each rank cuts its own shards: every rank of an expert group starts from rank 0's experts (broadcast before the
  split), so the peers hold the same local experts and need no scatter;
- the unit sits right after the unit containing it (its decoder layer), so that its bucket, which completes
  before the layer's in backward, launches first ([Note: collective order is the same on every rank]);
- what reads a split expert whole (the weight stream, `full_state_dict`) gathers its unit first, then the expert
  group's ranges (`whole_experts` in engine/experts/partition.py); checkpoints name the unit's ranges by their
  place in the whole layer as before.
Persistent experts (small ones) and every expert at ep = W (a single peer: nothing to cut) keep the stage-2 rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from accelerate_zero.config.schema import ZeroOptimizationConfig
from accelerate_zero.engine.buckets import GradBucket, KeptFor, ReduceMode
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.experts.parallel import ExpertPlacement
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.host_copies import HostCopies
from accelerate_zero.engine.kept_grads import ArenaSlot, GradArena
from accelerate_zero.engine.quantized_comm import BlockQuantization
from accelerate_zero.engine.scratch import ScratchBuffers
from accelerate_zero.engine.stage3.build import DtypePlan
from accelerate_zero.engine.stage3.flat_unit import FlatUnitBuffer, build_flat
from accelerate_zero.engine.stage3.param_unit import ParamUnit
from accelerate_zero.engine.stage3.units import UnitLayout, layout_units
from accelerate_zero.engine.stores import ShardStore


class ExpertUnit(ParamUnit):
    """A split layer's local experts as a stage-3 gather unit over their expert peers ([Note: experts below 1/ep at
    stage 3]): the scheduler drives it as any unit; its gathers run over `peers` whatever group it is handed."""

    peers: DataParallelGroup

    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module,
        trainable: FlatUnitBuffer | None,
        frozen: FlatUnitBuffer | None,
        bucket: GradBucket | None,
        store: ShardStore,
        peers: DataParallelGroup,
    ) -> None:
        super().__init__(index, name, module, trainable, frozen, bucket, store)
        self.peers = peers

    def unshard(
        self,
        dp: DataParallelGroup,
        stats: CommStats,
        use_all_reduce: bool = False,
        copies: HostCopies | None = None,
        secondary: DataParallelGroup | None = None,
        quantize: BlockQuantization | None = None,
    ) -> None:
        """`ParamUnit.unshard` over the peers (`dp` and hpZ's `secondary`, the engine's groups, do not hold these
        shards; expert parallelism runs on the flat layout, so there is no secondary copy to keep)."""
        super().unshard(self.peers, stats, use_all_reduce, copies, None, quantize)

    def reshard(self, force: bool = False, keep_secondary: DataParallelGroup | None = None) -> None:
        super().reshard(force, None)


@dataclass
class ExpertUnitSpec:
    """What one split layer's gather unit holds."""

    name: str
    module: nn.Module
    """The experts module, or the outermost peft wrapper around it."""
    trainable: list[nn.Parameter]
    frozen: list[nn.Parameter]


@dataclass
class ExpertUnitPlan:
    """Which split experts stage 3 cuts over their peers, and which keep the stage-2 rule (persistent)."""

    specs: list[ExpertUnitSpec]
    persistent: list[nn.Parameter]

    def in_units(self) -> set[int]:
        return {id(p) for spec in self.specs for p in (*spec.trainable, *spec.frozen)}

    def split_groups(
        self, experts: list[list[nn.Parameter]]
    ) -> tuple[list[list[nn.Parameter]], list[list[nn.Parameter]]]:
        """Each optimizer group's trainable split experts as (kept whole: the stage-2 rule, cut into units)."""
        cut = self.in_units()
        return [[p for p in g if id(p) not in cut] for g in experts], [[p for p in g if id(p) in cut] for g in experts]


def plan_expert_units(
    model: nn.Module,
    placement: ExpertPlacement,
    persistence_threshold: int,
    persistence_budget: int,
) -> ExpertUnitPlan:
    """Lays the split experts out ([Note: experts below 1/ep at stage 3]): stage 3's persistence rule
    (`layout_units`) on their local sizes within what the rest left of `stage3_model_persistence_threshold`
    (`persistence_budget`), every other expert in its layer's unit."""
    experts = placement.expert_parameters()
    persistent = expert_persistence(model, experts, persistence_threshold, persistence_budget, torch.numel)
    kept = {id(p) for p in persistent}
    specs = []
    for layer in placement.layers:
        params = [p for p in layer.params() if id(p) not in kept and p.is_floating_point()]
        if params:
            name, module = unit_module(model, layer.module, placement.adapters)
            trainable = [p for p in params if p.requires_grad]
            frozen = [p for p in params if not p.requires_grad]
            specs.append(ExpertUnitSpec(name, module, trainable, frozen))
    return ExpertUnitPlan(specs, persistent)


def expert_persistence(
    model: nn.Module,
    experts: Sequence[nn.Parameter],
    threshold: int,
    budget: int,
    numel_of: Callable[[nn.Parameter], int],
) -> list[nn.Parameter]:
    """The split experts stage 3 keeps whole on their rank: `layout_units`' rule (the smallest first, each of at
    most `threshold` elements, in total within `budget`) applied to the experts alone. `numel_of`: a parameter's
    local size (the estimate reads an unsplit model)."""
    expert_ids = {id(p) for p in experts}
    others = [p for p in model.parameters() if id(p) not in expert_ids]
    return layout_units(model, [], threshold, max(budget, 0), numel_of=numel_of, exclude=others).persistent


def unit_module(model: nn.Module, experts: nn.Module, adapters: Sequence[nn.Module]) -> tuple[str, nn.Module]:
    """The module whose forward the experts' unit is gathered around: the outermost peft wrapper of `experts`
    (its forward parametrizes the experts' parameters before calling them), else `experts`."""
    names = {id(m): n for n, m in model.named_modules()}
    outer = experts
    for wrapper in adapters:
        if wrapper.get_base_layer() is experts and len(names[id(wrapper)]) < len(names[id(outer)]):
            outer = wrapper
    return names[id(outer)], outer


def build_expert_units(
    plan: ExpertUnitPlan,
    peers: DataParallelGroup,
    first_index: int,
    *,
    compute_dtype: torch.dtype,
    grad_dtype: torch.dtype,
    comm_dtype: torch.dtype,
    device: torch.device,
    contiguous_gradients: bool,
    store: ShardStore,
    to_host: bool = False,
    kept_for: KeptFor | None = None,
    scratch: ScratchBuffers | None = None,
) -> list[ExpertUnit]:
    """Cuts each planned layer's experts over the peers (this rank keeps its slice; the parameters become empty
    placeholders) and gives its trainable part a bucket reduced over the peers. `first_index`: the first unit index
    no other unit uses. `to_host`: `offload_param`, the shards live in host memory (settled with the other units')."""

    def flat_of(params: list[nn.Parameter]) -> FlatUnitBuffer | None:
        if not params:
            return None
        flat = build_flat(params, peers.rank, peers.world_size, compute_dtype, device)  # every peer cuts its own
        if to_host and flat.shard.device.type != "cpu":
            flat.shard = flat.shard.to("cpu", copy=True)  # [Note: where an offloaded shard settles] in build.py
        return flat

    flats = [(flat_of(spec.trainable), flat_of(spec.frozen)) for spec in plan.specs]
    arena, offset = None, 0
    if contiguous_gradients:
        arena = GradArena(sum(t.plan.shard_numel for t, _ in flats if t is not None), grad_dtype, device)
    units = []
    for index, (spec, (trainable, frozen)) in enumerate(zip(plan.specs, flats, strict=True)):
        bucket = None
        if trainable is not None:
            slot = None
            if arena is not None:
                slot, offset = ArenaSlot(arena, offset), offset + trainable.plan.shard_numel
            mode = ReduceMode.SCATTER_TO_SHARD
            kept = kept_for(trainable.plan, mode) if kept_for is not None else None
            bucket = GradBucket(
                trainable.plan, mode, peers.rank, grad_dtype, comm_dtype, device, slot, trainable.params, kept, scratch
            )
            bucket.reduce_group = peers
        units.append(ExpertUnit(first_index + index, spec.name, spec.module, trainable, frozen, bucket, store, peers))
    return units


def for_stage3(
    model: nn.Module,
    placement: ExpertPlacement | None,
    peers: DataParallelGroup | None,
    rest: UnitLayout,
    trainable: list[list[nn.Parameter]],
    experts: list[list[nn.Parameter]],
    zero: ZeroOptimizationConfig,
    dtypes: DtypePlan,
    device: torch.device,
    **build: object,
) -> tuple[list[ExpertUnit], list[list[nn.Parameter]], list[list[nn.Parameter]]]:
    """Stage 3's split experts ([Note: experts below 1/ep at stage 3]): (their gather units; each optimizer group's
    trainable parameters laid out as stage 3's, the units' experts added; the split experts that keep the stage-2
    rule). Without peers (ep = W) or expert parallelism: no unit, every split expert keeps the stage-2 rule.
    `rest`: the layout of everything else; `build`: `build_expert_units`' keyword arguments."""
    if placement is None or peers is None:
        return [], trainable, experts
    budget = zero.stage3_model_persistence_threshold - sum(p.numel() for p in rest.persistent)
    plan = plan_expert_units(model, placement, zero.stage3_param_persistence_threshold, budget)
    kept, cut = plan.split_groups(experts)
    units = build_expert_units(
        plan,
        peers,
        len(rest.units),
        compute_dtype=dtypes.compute,
        grad_dtype=dtypes.grad,
        comm_dtype=dtypes.comm,
        device=device,
        contiguous_gradients=zero.contiguous_gradients,
        **build,
    )
    return units, [[*own, *more] for own, more in zip(trainable, cut, strict=True)], kept
