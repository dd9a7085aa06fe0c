"""Tokens to the ranks that hold their experts and back: the routes of one MoE layer call and the exchanges.

[Note: routes of an expert-parallel layer]
A token routed to k experts is k (token, slot) pairs. Each pair goes to the rank of the expert group that holds its
expert (experts are split into `ep` consecutive ranges of equal size). The pairs are sorted by destination (stably,
so within a destination they keep token order), the counts are exchanged first (one all-to-all of `ep` integers),
then the pairs' hidden states and their experts' local indices travel with one uneven all-to-all each. The owner
runs its experts on what it received and sends every result back along the reverse route; the sender weights each
result by its routing weight and adds it into the token's row. The exchanges are differentiable (the backward of
an all-to-all is the all-to-all of the gradients along the reverse route), so gradients reach the hidden states
on every rank, and the routing weights, which never leave their rank, carry the router's gradient as without
expert parallelism. A rank with no pair for some rank (or for any) still takes part with counts of 0: nobody waits
for it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from accelerate_zero.engine import collectives
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup


class Routes(NamedTuple):
    """Where this rank's (token, slot) pairs go in one layer call, and what it receives."""

    order: torch.Tensor
    """The pairs (flattened `top_k_index` positions) sorted by destination rank."""
    send_counts: list[int]
    """Pairs sent to each rank of the expert group."""
    receive_counts: list[int]
    """Pairs received from each rank."""
    received_experts: torch.Tensor
    """The local expert index (0 .. E/ep - 1) of each pair received, in arrival order."""


def plan_routes(
    top_k_index: torch.Tensor, experts_per_rank: int, group: DataParallelGroup, stats: CommStats
) -> Routes:
    """The routes of the pairs `top_k_index` ([tokens, k] global expert ids) over `group`."""
    flat = top_k_index.reshape(-1)
    owner = torch.div(flat, experts_per_rank, rounding_mode="floor")
    order = torch.sort(owner, stable=True).indices
    send = torch.bincount(owner, minlength=group.world_size)
    receive = collectives.all_to_all_uneven(send, [1] * group.world_size, [1] * group.world_size, group, stats)
    send_counts, receive_counts = send.tolist(), receive.tolist()
    local = (flat[order] - owner[order] * experts_per_rank).to(torch.int64)
    received = collectives.all_to_all_uneven(
        local, send_counts, receive_counts, group, stats, kind="all_to_all_expert_routes"
    )
    return Routes(order, send_counts, receive_counts, received)


def send_to_experts(rows: torch.Tensor, routes: Routes, group: DataParallelGroup, stats: CommStats) -> torch.Tensor:
    """Each pair's hidden state (`rows`: one per pair, in pair order) to its expert's rank; differentiable."""
    return _Exchange.apply(rows[routes.order], routes.send_counts, routes.receive_counts, group, stats)


def return_from_experts(
    results: torch.Tensor, routes: Routes, group: DataParallelGroup, stats: CommStats
) -> torch.Tensor:
    """The experts' results back to the pairs' ranks, in pair order again; differentiable."""
    back = _Exchange.apply(results, routes.receive_counts, routes.send_counts, group, stats)
    unsorted = torch.empty_like(back)
    return unsorted.index_copy(0, routes.order, back)


class _Exchange(torch.autograd.Function):
    """An uneven all-to-all whose backward sends the gradients along the reverse route."""

    @staticmethod
    def forward(
        ctx: Any,
        rows: torch.Tensor,
        send_counts: list[int],
        receive_counts: list[int],
        group: DataParallelGroup,
        stats: CommStats,
    ) -> torch.Tensor:
        ctx.route = (send_counts, receive_counts, group, stats)
        return collectives.all_to_all_uneven(
            rows, send_counts, receive_counts, group, stats, kind="all_to_all_experts"
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        send_counts, receive_counts, group, stats = ctx.route
        back = collectives.all_to_all_uneven(
            grad, receive_counts, send_counts, group, stats, kind="all_to_all_experts"
        )
        return back, None, None, None, None
