"""What each stage-3 layout sends inside and between nodes per micro-step, and what it costs in memory.

[Note: the layout formulas]
k nodes of n GPUs (W = k n); P the bytes of every parameter in the compute dtype, G the bytes of the trainable
gradients in the communication dtype; per node and micro-step, with units released after their forward
(`stage3_max_reuse_distance: 0`: every unit gathered once in forward and once in backward). A collective over a
group of g ranks, m of them on each node, moving N bytes (the volume model of [Note: bytes between nodes] in
engine/collectives.py: what comes from another node enters a node once):
- all-gather / reduce-scatter: N (g - m)/g between nodes into each node, m N (g - 1)/g - N (g - m)/g inside it;
  an all-reduce twice that; an all-to-all of N per rank: m N (g - m)/g between, m N (m - 1)/g inside.
Per layout:
- flat: all-gather P over W (forward), again (backward), reduce-scatter G over W: between (2P + G)(k - 1)/k.
- hpZ (`zero_hpz_partition_size: n`): forward over W, backward over the node, gradients over W: (P + G)(k - 1)/k.
  Memory: the secondary copy, P / n per GPU at most (every unit released after its forward keeps 1/n of itself
  until its backward).
- MiCS (`mics_shard_size: n`): gathers and reduce-scatter inside the node, then each gradient shard G/n all-reduced
  over the k replicas: 2G (k - 1)/k. Memory: every partitioned state is 1/n instead of 1/W, k times flat's.
- ZeRO++ (hpZ + `zero_quantized_weights` + `zero_quantized_gradients`): the forward all-gather moves int8 codes
  and a 4-byte scale per 256 (P8 = parameters x 1.016 bytes), backward gathers inside the node, gradients in int4
  with a scale per 64 (G4 = trainable parameters x 0.5625 bytes) in two all-to-alls, of which only the second,
  1/n of each rank's, crosses nodes: (P8 + G4)(k - 1)/k. Lossy: the bounds of engine/quantized_comm.py.
tests/distributed/test_layouts.py checks these against the bytes the engine moved, on 2 simulated nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accelerate_zero.engine.quantized_comm import GRADIENTS, WEIGHTS, BlockQuantization


@dataclass(frozen=True)
class Traffic:
    between: float = 0.0
    inside: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.between + other.between, self.inside + other.inside)

    def __mul__(self, factor: float) -> Traffic:
        return Traffic(self.between * factor, self.inside * factor)


def gather(nbytes: float, group: int, per_node: int) -> Traffic:
    """An all-gather (or reduce-scatter) of `nbytes` over `group` ranks, `per_node` of them on each node."""
    between = nbytes * (group - per_node) / group
    return Traffic(between, per_node * nbytes * (group - 1) / group - between)


def all_to_all(nbytes_per_rank: float, group: int, per_node: int) -> Traffic:
    share = per_node * nbytes_per_rank / group
    return Traffic(share * (group - per_node), share * (per_node - 1))


@dataclass(frozen=True)
class LayoutRow:
    name: str
    zero_optimization: dict[str, Any]
    """The keys that select this layout."""
    traffic: Traffic
    """Bytes per node per micro-step ([Note: the layout formulas])."""
    model_states: int
    """Bytes per GPU held across steps under this layout."""
    secondary_copy: int
    """hpZ: bytes per GPU of the secondary copy at its largest."""
    exact: bool
    """False: quantized collectives (results within the bounds of engine/quantized_comm.py, not equal)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "layout": self.name,
            "zero_optimization": self.zero_optimization,
            "between_nodes_per_micro_step": round(self.traffic.between),
            "inside_node_per_micro_step": round(self.traffic.inside),
            "model_states": self.model_states,
            "secondary_copy": self.secondary_copy,
            "exact": self.exact,
        }


def layout_rows(
    numel: int, trainable: int, compute_bytes: int, comm_bytes: int, num_nodes: int, per_node: int, states: int
) -> list[LayoutRow]:
    """Every stage-3 layout on `num_nodes` x `per_node` GPUs; `states`: flat stage 3's model states per GPU."""
    k, n = num_nodes, per_node
    world = k * n
    P, G = numel * compute_bytes, trainable * comm_bytes
    p8 = numel * _wire_bytes(WEIGHTS)
    g4 = trainable * _wire_bytes(GRADIENTS)
    flat = gather(P, world, n) * 2 + gather(G, world, n)
    hpz = gather(P, world, n) + gather(P, n, n) + gather(G, world, n)
    mics = gather(P, n, n) * 2 + gather(G, n, n) + gather(G / n, k, 1) * (2 * n)
    zeropp = gather(p8, world, n) + gather(P, n, n) + all_to_all(g4, n, n) + all_to_all(g4 / n, k, 1) * n
    secondary = P // n
    return [
        LayoutRow("flat", {}, flat, states, 0, True),
        LayoutRow("hpZ", {"zero_hpz_partition_size": n}, hpz, states, secondary, True),
        LayoutRow("MiCS", {"mics_shard_size": n}, mics, states * k, 0, True),
        LayoutRow(
            "ZeRO++",
            {"zero_hpz_partition_size": n, "zero_quantized_weights": True, "zero_quantized_gradients": True},
            zeropp,
            states,
            secondary,
            False,
        ),
    ]


def _wire_bytes(q: BlockQuantization) -> float:
    """Bytes per element of a quantized collective: the code and a share of its block's fp32 scale."""
    return q.bits / 8 + 4 / q.block


def recommend_layout(rows: list[LayoutRow], room: int | None, num_nodes: int) -> LayoutRow:
    """The exact layout that sends the fewest bytes between nodes and fits in `room` (bytes per GPU beyond flat
    stage 3's total; None: unknown, all fit); MiCS on a tie (its gathers never leave the node); flat on one node."""
    if num_nodes == 1:
        return rows[0]
    flat_cost = rows[0].model_states + rows[0].secondary_copy

    def fits(row: LayoutRow) -> bool:
        return room is None or row.model_states + row.secondary_copy - flat_cost <= room

    candidates = [row for row in rows if row.exact and fits(row)]
    return min(candidates, key=lambda row: (round(row.traffic.between), row.name != "MiCS"))
