"""ShardingLayout: every process group the engine shards and communicates over, built once from the node layout.

[Note: the three hierarchical layouts]
- flat ZeRO-3: every state is partitioned over all W ranks; each gather and each gradient reduction spans every
  node.
- hpZ (`zero_hpz_partition_size: n`, ZeRO++): the same primary partition over W (optimizer states, gradients, the
  fp32 masters), and a secondary copy of each unit's parameters partitioned over the n ranks of a block (a node):
  forward gathers from the primary partition and keeps the block's slice; backward gathers from that slice, inside
  the block. Costs 1/n of each unit gathered in forward until its backward is done.
- replicate x shard (`mics_shard_size: s`, MiCS; FSDP2's HSDP; accelerate's `dp_shard_size`): all state
  partitioned over blocks of s consecutive ranks and replicated across the W/s blocks. Gathers stay inside a block;
  each gradient shard is reduce-scattered inside the block and then all-reduced across the replicas. Each rank holds
  1/s of the state instead of 1/W.
Blocks are consecutive ranks, so a block of ranks_per_node ranks is one node ([Note: where the node layout comes
from] in engine/nodes.py). This module is the only place that turns ranks into groups: the engine asks the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.engine.nodes import NodeLayout
from accelerate_zero.engine.quantized_comm import TwoLevelGroups


@dataclass(frozen=True)
class LayoutPlan:
    """The rank lists of a layout, pure arithmetic ([Note: the three hierarchical layouts])."""

    nodes: NodeLayout
    shard_size: int
    """Ranks one copy of the state is partitioned over (the world size when not replicated)."""
    secondary_size: int = 1
    """hpZ: ranks a secondary copy of the parameters is partitioned over (1: no secondary copy)."""
    two_level: bool = False
    """qgZ: the node and across-node groups of the two-level reduce-scatter (engine/quantized_comm.py)."""
    sequence_size: int = 1
    """Ulysses: ranks sharing each sequence, consecutive (accelerate_zero/sequence); 1: none."""
    expert_size: int = 1
    """Expert parallelism: consecutive ranks that split each MoE layer's experts between them and exchange tokens
    (accelerate_zero/engine/experts); 1: every rank holds every expert."""

    def __post_init__(self) -> None:
        world = self.nodes.world_size
        sizes = (
            ("shard size", self.shard_size),
            ("secondary partition size", self.secondary_size),
            ("sequence-parallel size", self.sequence_size),
            ("expert-parallel size", self.expert_size),
        )
        for key, size in sizes:
            if size < 1 or world % size:
                raise ValueError(f"{key} {size} does not divide the {world} ranks")
        if self.secondary_size > 1 and self.shard_size != world:
            raise ValueError("hpZ (a secondary partition) and replicate x shard (MiCS) cannot be combined")
        if self.two_level and self.shard_size != world:
            raise ValueError("the two-level gradient reduce-scatter (qgZ) needs the state sharded over every rank")

    @property
    def world_size(self) -> int:
        return self.nodes.world_size

    @property
    def num_replicas(self) -> int:
        return self.world_size // self.shard_size

    @property
    def kind(self) -> str:
        if self.secondary_size > 1:
            return "hpz"
        return "replicate_x_shard" if self.num_replicas > 1 else "flat"

    def shard_index_of(self, rank: int) -> int:
        """Which shard of the state rank `rank` holds (its rank in its shard group)."""
        return rank % self.shard_size

    def shard_groups(self) -> list[tuple[int, ...]]:
        return _blocks(self.world_size, self.shard_size)

    def replicate_groups(self) -> list[tuple[int, ...]]:
        """Ranks holding the same shard: the same position in each shard group."""
        return [tuple(range(i, self.world_size, self.shard_size)) for i in range(self.shard_size)]

    def secondary_groups(self) -> list[tuple[int, ...]]:
        return _blocks(self.world_size, self.secondary_size)

    def sequence_groups(self) -> list[tuple[int, ...]]:
        return _blocks(self.world_size, self.sequence_size)

    def expert_groups(self) -> list[tuple[int, ...]]:
        return _blocks(self.world_size, self.expert_size)

    def expert_peer_groups(self) -> list[tuple[int, ...]]:
        """Ranks holding the same experts: the same position in each expert group ([Note: gradients of split
        experts] in engine/experts/parallel.py)."""
        return [tuple(range(i, self.world_size, self.expert_size)) for i in range(self.expert_size)]

    def node_groups(self) -> list[tuple[int, ...]]:
        return [self.nodes.ranks_of_node(node) for node in range(self.nodes.num_nodes)]

    def across_node_groups(self) -> list[tuple[int, ...]]:
        """The ranks of each local index, one per node."""
        per_node = self.nodes.ranks_per_node
        return [tuple(range(j, self.world_size, per_node)) for j in range(per_node)]

    def describe(self) -> str:
        nodes = f"{self.nodes.num_nodes} node(s) x {self.nodes.ranks_per_node} ranks"
        if self.kind == "hpz":
            return f"hpZ: primary over {self.world_size} ranks, secondary over {self.secondary_size} ({nodes})"
        if self.kind == "replicate_x_shard":
            return f"{self.num_replicas} replicas x shards over {self.shard_size} ranks ({nodes})"
        return f"flat over {self.world_size} ranks ({nodes})"


def _blocks(world: int, size: int) -> list[tuple[int, ...]]:
    return [tuple(range(first, first + size)) for first in range(0, world, size)]


@dataclass(frozen=True, eq=False)
class ShardingLayout:
    """The groups of one run ([Note: the three hierarchical layouts])."""

    plan: LayoutPlan
    world: DataParallelGroup
    """Every data-parallel rank: barriers, the loss, what rank 0 alone does."""
    shard: DataParallelGroup
    """The ranks one copy of the state is partitioned over (== world unless replicated)."""
    replicate: DataParallelGroup | None
    """The ranks holding the same shard as this one (None: no replicas)."""
    secondary: DataParallelGroup | None
    """hpZ: the ranks this rank's secondary copy is partitioned over (None: no secondary copy)."""
    two_level: TwoLevelGroups | None = None
    """qgZ: this rank's node and across-node groups (None: gradients are reduced over `shard` in one level)."""
    sequence: DataParallelGroup | None = None
    """Ulysses: the ranks sharing this rank's sequences (None: sequences are not cut). ZeRO partitions over all of
    `world` all the same, as DeepSpeed does ([Note: the loss over a sequence-parallel group])."""
    expert: DataParallelGroup | None = None
    """Expert parallelism: the ranks splitting each MoE layer's experts with this one (None: no split)."""
    expert_peers: DataParallelGroup | None = None
    """The ranks holding the same experts as this one, one per expert group (None: a single expert group)."""

    def shard_index_of(self, rank: int) -> int:
        return self.plan.shard_index_of(rank)

    @property
    def writes_shards(self) -> bool:
        """Whether this rank writes its shard to a checkpoint: one replica (the first) does."""
        return self.replicate is None or self.replicate.rank == 0


def flat_layout(world: DataParallelGroup, nodes: NodeLayout | None = None) -> ShardingLayout:
    """Everything partitioned over `world` (no new group is created)."""
    nodes = nodes if nodes is not None else NodeLayout(world.world_size, world.world_size, "one node")
    world = _with_nodes(world, nodes)
    return ShardingLayout(LayoutPlan(nodes, world.world_size), world, world, None, None)


def build_sharding_layout(world: DataParallelGroup, plan: LayoutPlan) -> ShardingLayout:
    """Creates the plan's groups (every rank must call it, in the same order) and picks this rank's."""
    if plan.kind == "flat" and not plan.two_level and plan.sequence_size == 1 and plan.expert_size == 1:
        return flat_layout(world, plan.nodes)
    if world.group is not None:
        raise ValueError(
            f"{plan.describe()} needs torch's default process group: pass process_group=None (the layout cuts the "
            "groups itself)"
        )
    world = _with_nodes(world, plan.nodes)
    sequence = _my_group(plan.sequence_groups(), world.rank, plan.nodes) if plan.sequence_size > 1 else None
    expert, peers = _expert_groups(plan, world.rank)
    two_level = None
    if plan.two_level:
        node = _my_group(plan.node_groups(), world.rank, plan.nodes)
        two_level = TwoLevelGroups(node, _my_group(plan.across_node_groups(), world.rank, plan.nodes))
    if plan.kind == "flat":
        return ShardingLayout(plan, world, world, None, None, two_level, sequence, expert, peers)
    if plan.kind == "hpz":
        secondary = _my_group(plan.secondary_groups(), world.rank, plan.nodes)
        return ShardingLayout(plan, world, world, None, secondary, two_level, sequence, expert, peers)
    shard = _my_group(plan.shard_groups(), world.rank, plan.nodes)
    replicate = _my_group(plan.replicate_groups(), world.rank, plan.nodes)
    return ShardingLayout(plan, world, shard, replicate, None, None, sequence, expert, peers)


def _expert_groups(plan: LayoutPlan, rank: int) -> tuple[DataParallelGroup | None, DataParallelGroup | None]:
    if plan.expert_size == 1:
        return None, None
    expert = _my_group(plan.expert_groups(), rank, plan.nodes)
    if plan.expert_size == plan.world_size:
        return expert, None
    return expert, _my_group(plan.expert_peer_groups(), rank, plan.nodes)


def _with_nodes(group: DataParallelGroup, nodes: NodeLayout) -> DataParallelGroup:
    ranks = tuple(range(group.world_size)) if group.group is None else tuple(dist.get_process_group_ranks(group.group))
    return DataParallelGroup(group.group, group.rank, group.world_size, tuple(nodes.node_of(r) for r in ranks))


def _my_group(blocks: list[tuple[int, ...]], rank: int, nodes: NodeLayout) -> DataParallelGroup:
    mine, _ = dist.new_subgroups_by_enumeration([list(block) for block in blocks])
    (block,) = [b for b in blocks if rank in b]
    return DataParallelGroup(mine, block.index(rank), len(block), tuple(nodes.node_of(r) for r in block))


def plan_from_config(config: Any, nodes: NodeLayout) -> LayoutPlan:
    """The layout a config asks for (`zero_optimization.zero_hpz_partition_size`, `mics_shard_size`,
    `zero_quantized_gradients`, `sequence_parallel_size`, `expert_parallel`; validated by config/resolve.py) on `nodes`."""
    zero = config.zero_optimization
    hpz = zero.zero_hpz_partition_size if zero.stage == 3 and zero.zero_hpz_partition_size > 1 else 1
    shard = zero.mics_shard_size if zero.stage == 3 and zero.mics_shard_size > 0 else nodes.world_size
    two_level = zero.stage == 3 and zero.zero_quantized_gradients
    sequence = config.sequence_parallel_size
    expert = config.expert_parallel.autoep_size if config.expert_parallel.enabled else 1
    return LayoutPlan(
        nodes,
        shard_size=shard,
        secondary_size=hpz,
        two_level=two_level,
        sequence_size=sequence,
        expert_size=expert,
    )
