"""NodeLayout: which node each rank runs on, read once from the launcher (or declared, to simulate nodes).

[Note: where the node layout comes from]
Launchers number ranks node by node: torchrun (and `accelerate launch`, which runs it) gives node k the ranks
k * LOCAL_WORLD_SIZE ... (k + 1) * LOCAL_WORLD_SIZE - 1, and SLURM's block distribution does the same with
SLURM_NTASKS_PER_NODE tasks per node. So the layout is one number, the ranks per node, and every rank computes the
same layout without talking to the others. In order:
1. `ACCELERATE_ZERO_SIMULATED_NODES=<n>`: the ranks are split into n equal consecutive blocks, as if on n nodes
   (tests and benchmarks run "two nodes" of gloo processes on one machine this way);
2. `LOCAL_WORLD_SIZE` (torchrun, accelerate, our launcher);
3. `SLURM_NTASKS_PER_NODE` (srun without a launcher per node);
4. otherwise one node.
Nodes of different sizes are refused: hierarchical groups are cut in equal blocks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


SIMULATED_NODES_ENV = "ACCELERATE_ZERO_SIMULATED_NODES"


@dataclass(frozen=True)
class NodeLayout:
    """`world_size` ranks on `num_nodes` nodes of `ranks_per_node` consecutive ranks each."""

    world_size: int
    ranks_per_node: int
    source: str = "given"
    """Where the layout was read from (named in errors)."""

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(
                f"{self.world_size} ranks cannot be split into nodes of {self.ranks_per_node} ranks (from "
                f"{self.source}): every node must run the same number of ranks"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def ranks_of_node(self, node: int) -> tuple[int, ...]:
        first = node * self.ranks_per_node
        return tuple(range(first, first + self.ranks_per_node))


def node_layout_from_env(world_size: int, environ: dict[str, str] | None = None) -> NodeLayout:
    """The node layout of a run on `world_size` ranks ([Note: where the node layout comes from])."""
    env = os.environ if environ is None else environ
    simulated = env.get(SIMULATED_NODES_ENV)
    if simulated:
        nodes = _positive_int(SIMULATED_NODES_ENV, simulated)
        if world_size % nodes:
            raise ValueError(
                f"{SIMULATED_NODES_ENV}={simulated}: {world_size} ranks cannot be split into {nodes} equal nodes; "
                f"use a divisor of {world_size}"
            )
        return NodeLayout(world_size, world_size // nodes, f"{SIMULATED_NODES_ENV}={simulated}")
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        raw = env.get(key)
        if raw:
            per_node = min(_positive_int(key, raw.split("(")[0].split(",")[0]), world_size)
            return NodeLayout(world_size, per_node, f"{key}={raw}")
    return NodeLayout(world_size, world_size, "one node (no LOCAL_WORLD_SIZE)")


def _positive_int(key: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{key}={raw!r} is not a positive number of ranks or nodes")
    return value
