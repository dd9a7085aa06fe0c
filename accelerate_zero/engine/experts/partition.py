"""Expert parallelism inside the engine: the split layers' experts as a partition of their own.

[Note: expert parallelism in the engine]
With `expert_parallel.enabled`, the composition root (engine/assemble.py) splits every fused MoE layer before it
builds anything else ([Note: the experts' own forward on the local experts] in engine/experts/parallel.py). What each rank
then holds of the experts differs between expert groups, so the experts cannot join the partition of the rest of the
model, which assumes every rank holds the same parameters:
- The rest (attention, the routers, embeddings, shared experts) is partitioned over all W ranks as usual, at the
  configured stage.
- Each rank's experts form, per optimizer param group, one flat group of their own, partitioned over their peers
  (the W / ep ranks holding the same experts, `layout.expert_peers`): at stage 1 their optimizer states and fp32
  masters, at stages 2 and 3 their gradients too, reduce-scattered over the peers during backward and divided by W
  ([Note: gradients of split experts]). After the step the peers all-gather the updated experts, which stay whole
  on their rank between steps, 1/ep of each layer: a token's expert computes where it lives, so the bytes that
  flat stage 3 gathers for every expert of every layer become one all-gather of 1/ep of them among the peers.
- At stage 3 with more than one peer (ep < W) the local experts are cut once more, over the peers, into one gather
  unit per layer, gathered among the peers around the experts' forward and backward as stage 3 gathers the rest
  over the world ([Note: experts below 1/ep at stage 3] in engine/experts/gather_units.py): each rank then holds
  1/W of the experts, as flat stage 3 does. Small (persistent) experts, and all of them at ep = W, stay whole.
- Each element of every expert is held by exactly one rank of the world in the optimizer's shards (one peer of one
  expert group), as each element of the rest is, so the gradient norm and the overflow check summed over all W
  ranks count everything once: clipping is the one-process clipping.
- Every rank starts from rank 0's experts: rank 0 broadcasts each whole experts tensor before the split, as it
  broadcasts the rest.
- Checkpoints name each expert range by its place in the whole layer (engine/checkpoint_state.py), so a checkpoint
  saved at one ep loads at any other, or without expert parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from accelerate_zero.config.blocks import ExpertParallelConfig
from accelerate_zero.engine import collectives
from accelerate_zero.engine.buckets import GradBucket, ReduceMode
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.experts.blocks import find_expert_layers
from accelerate_zero.engine.experts.parallel import ExpertPlacement, split_experts
from accelerate_zero.engine.flat_buffer import GroupShard, group_slices
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.layout import ShardingLayout
from accelerate_zero.engine.setup import keep_generate_in_step
from accelerate_zero.engine.shard_slice import ShardSlice


def split_for_engine(
    module: nn.Module, layout: ShardingLayout, stats: CommStats, config: ExpertParallelConfig
) -> ExpertPlacement | None:
    """Checks the model, makes every rank hold rank 0's experts and splits them ([Note: expert parallelism in the
    engine]); None without expert groups.

    Raises:
        ValueError: `preset_model` names another model family, or a rank holds experts on the meta device.
    """
    if layout.expert is None:
        return None
    preset_model = config.preset_model
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if preset_model is not None and model_type is not None and preset_model != model_type:
        raise ValueError(
            f"expert_parallel.preset_model={preset_model!r} but the model is a {model_type!r}: fix the preset name "
            "or remove the key (layers are found by structure)"
        )
    for layer in find_expert_layers(module):
        for name, param in zip(layer.param_names, layer.params(), strict=True):
            if param.device.type == "meta":
                raise ValueError(
                    f"expert_parallel: {layer.name}.{name} is on the meta device on rank {layout.world.rank}: each "
                    "rank keeps its own experts of the layer, so every rank must build the model with real weights"
                )
            collectives.broadcast(param.data, 0, layout.world, stats)
    keep_generate_in_step(module)  # every forward is now a collective of the expert group, at every stage
    return split_experts(module, layout.expert, stats, layout.expert_peers)


def expert_peers_group(layout: ShardingLayout) -> DataParallelGroup:
    """The ranks the experts' states are partitioned over: the expert peers, or this rank alone (ep == W)."""
    if layout.expert_peers is not None:
        return layout.expert_peers
    return DataParallelGroup(None, 0, 1)


def split_trainable(
    trainable: list[list[nn.Parameter]], placement: ExpertPlacement | None
) -> tuple[list[list[nn.Parameter]], list[list[nn.Parameter]]]:
    """Each optimizer group's trainable parameters as (the rest, the split experts), in the group's order."""
    experts = {id(p) for p in placement.expert_parameters()} if placement is not None else set()
    rest = [[p for p in params if id(p) not in experts] for params in trainable]
    split = [[p for p in params if id(p) in experts] for params in trainable]
    return rest, split


def build_expert_groups(
    experts: list[list[nn.Parameter]],
    layout: ShardingLayout,
    mode: ReduceMode,
    make_shard: Callable[[list[nn.Parameter], int, int, ReduceMode], GroupShard],
) -> list[tuple[int, GroupShard]]:
    """(optimizer param group, one flat group of its split experts cut over their peers), for each group holding
    experts. `make_shard(params, num_shards, rank, mode)`: the engine's flat group builder."""
    peers = expert_peers_group(layout)
    out = []
    for index, params in enumerate(experts):
        if params:
            shard = make_shard(params, peers.world_size, peers.rank, mode)
            shard.group = peers  # cut, reduced and gathered over the peers, not the engine's ranks
            for bucket in shard.buckets:
                bucket.reduce_group = peers
            out.append((index, shard))
    return out


def with_expert_groups(
    module: nn.Module,
    groups: list[GroupShard],
    buckets: list[GradBucket],
    slices: list[list[ShardSlice]],
    on_complete: Callable[[int], None] | None,
    expert_groups: list[tuple[int, GroupShard]],
) -> tuple:
    """The stage's flat groups, buckets (launch order), their parameters' locations, optimizer slices (per param
    group) and bucket-completion callback, with the experts' groups added."""
    position = {param: i for i, param in enumerate(module.parameters())}
    extra = [bucket for _, shard in expert_groups for bucket in shard.buckets]
    ordered = insert_in_backward_order(buckets, extra, position)
    slices = [list(group) for group in slices]
    for index, shard in expert_groups:
        slices[index] += group_slices(shard)
    groups = [*groups, *(shard for _, shard in expert_groups)]
    return groups, ordered, bucket_locations(ordered), slices, on_complete_reindexed(on_complete, buckets, ordered)


def insert_in_backward_order(
    buckets: list[GradBucket],
    extra: list[GradBucket],
    position: dict[nn.Parameter, int],
) -> list[GradBucket]:
    """`buckets` (launch order) with each of `extra` placed before the first bucket whose first parameter comes
    earlier in the model: a bucket launches once every earlier one has, so an expert bucket waits for the layers
    after its own, not for the whole backward ([Note: collective order is the same on every rank])."""

    def first(bucket: GradBucket) -> int:
        return min(position[bucket.params[slot.param_index]] for slot in bucket.plan.slots)

    ordered = list(buckets)
    for bucket in sorted(extra, key=first, reverse=True):
        key = first(bucket)
        at = next((i for i, other in enumerate(ordered) if first(other) < key), len(ordered))
        ordered.insert(at, bucket)
    return ordered


def bucket_locations(buckets: list[GradBucket]) -> dict[nn.Parameter, tuple[int, object]]:
    """For each trainable parameter, (its bucket's index in `buckets`, its slot)."""
    return {
        bucket.params[slot.param_index]: (index, slot)
        for index, bucket in enumerate(buckets)
        for slot in bucket.plan.slots
    }


def on_complete_reindexed(
    on_complete: Callable[[int], None] | None, old: list[GradBucket], new: list[GradBucket]
) -> Callable[[int], None] | None:
    """A bucket-completion callback written for `old`'s indices, called with `new`'s."""
    if on_complete is None:
        return None
    old_index = {id(bucket): index for index, bucket in enumerate(old)}
    by_new = {i: old_index[id(b)] for i, b in enumerate(new) if id(b) in old_index}

    def call(index: int) -> None:
        if index in by_new:
            on_complete(by_new[index])

    return call


def expert_element_offsets(placement: ExpertPlacement | None) -> dict[int, tuple[int, list[int]]]:
    """id(parameter) -> (where its first element sits in the whole layer's flattened tensor, the whole shape)."""
    if placement is None:
        return {}
    out = {}
    for layer in placement.layers:
        start, stop = placement.ranges[layer.name]
        for param in layer.params():
            shape = placement.shapes[id(param)]  # not `param.shape`: a placeholder inside a stage-3 unit
            per_expert = math.prod(shape) // (stop - start)  # elements of one expert ([E, ...] or DBRX's [E * F, H])
            whole_rows = shape[0] // (stop - start) * layer.num_experts
            out[id(param)] = (start * per_expert, [whole_rows, *shape[1:]])
    return out


def gather_whole_experts(local: torch.Tensor, group: DataParallelGroup, stats: CommStats) -> torch.Tensor:
    """The whole layer's experts from each rank's consecutive range of them (every rank of `group` calls it)."""
    whole = torch.empty((group.world_size * local.shape[0], *local.shape[1:]), dtype=local.dtype, device=local.device)
    collectives.all_gather(whole.view(-1), local.contiguous().view(-1), group, stats, kind="all_gather_experts")
    return whole


def whole_experts(
    placement: ExpertPlacement | None, stats: CommStats
) -> Callable[[torch.Tensor], torch.Tensor | None]:
    """A function giving a split layer's experts whole, gathered from their expert group (a new tensor; a
    collective: every rank calls it for the same parameters in the same order); None for any other parameter."""
    split = {id(p) for p in placement.expert_parameters()} if placement is not None else set()

    def whole(param: torch.Tensor) -> torch.Tensor:
        if id(param) not in split:
            return None
        assert placement is not None
        return gather_whole_experts(param.data, placement.group, stats)

    return whole
