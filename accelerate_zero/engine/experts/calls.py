"""The two hooks around a split experts module's forward, for each way a block calls its experts.

A call is cut into (row, expert) pairs, each row travels to its expert's rank ([Note: routes of an expert-parallel
layer] in engine/experts/routing.py), the module's own forward runs on what arrived, and the results travel back
and are put together as the unsplit forward would have ([Note: the experts' own forward on the local experts] in
engine/experts/parallel.py). What a pair is, what the local forward is called with and how the results combine
depend on the calling convention ([Note: which expert layers are split] in engine/experts/blocks.py):
- ROUTED: a pair is (token, slot) of `top_k_index`; the local forward gets the rows received, each with its local
  expert and a routing weight of exactly 1; the sender weights each result and adds it into the token's row.
- REPLICATED: a pair is a nonzero row of the `[E * T, H]` input (its expert is `row // T`); the local forward gets
  the rows received laid out as it reads them (`[E / ep, M, H]`, each local expert's rows padded with zero rows to
  the most any of them received); the results go back to their rows of a zero `[E * T, H]` output, which the block
  sums over experts as it always does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.experts.blocks import Convention, ExpertLayer
from accelerate_zero.engine.experts.routing import Routes, plan_routes, return_from_experts, send_to_experts
from accelerate_zero.engine.groups import DataParallelGroup


@dataclass
class _Call:
    routes: Routes
    row_of_pair: torch.Tensor
    """Where each pair's result goes in the output (a token's row; REPLICATED: the input row)."""
    weights: torch.Tensor | None
    """ROUTED: each pair's routing weight, kept on this rank; None when the rows arrive scaled."""
    shape: torch.Size
    """The output's shape (the hidden states' as they came in)."""
    picked: torch.Tensor | None
    """REPLICATED: where each received row sits in the padded local input; None: in arrival order."""


class LayerCalls:
    """The two hooks of one split layer; calls in flight are a stack (activation checkpointing re-runs a forward
    inside backward, between another call's hooks)."""

    def __init__(self, layer: ExpertLayer, per_rank: int, group: DataParallelGroup, stats: CommStats) -> None:
        self.layer, self.per_rank, self.group, self.stats = layer, per_rank, group, stats
        self.pending: list[_Call] = []

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        values = _bound(self.layer, args, kwargs)
        if self.layer.convention is Convention.ROUTED:
            hidden, index, weights = values
            shape, hidden = hidden.shape, hidden.reshape(-1, hidden.shape[-1])  # DBRX passes [B, S, H]
            index, weights = index.reshape(hidden.shape[0], -1), weights.reshape(hidden.shape[0], -1)
            tokens, k = index.shape
            row_of_pair = torch.arange(tokens, device=index.device).repeat_interleave(k)
            experts, rows, pair_weights = index.reshape(-1), hidden[row_of_pair], weights.reshape(-1)
        else:
            (hidden,) = values
            shape = hidden.shape
            tokens = hidden.shape[0] // self.layer.num_experts
            row_of_pair = hidden.detach().ne(0).any(dim=-1).nonzero().reshape(-1)  # [Note: which expert layers ...]
            experts = torch.div(row_of_pair, tokens, rounding_mode="floor")
            rows, pair_weights = hidden[row_of_pair], None
        routes = plan_routes(experts[:, None], self.per_rank, self.group, self.stats)
        received = send_to_experts(rows, routes, self.group, self.stats)
        local = routes.received_experts
        if self.layer.convention is Convention.ROUTED:
            self.pending.append(_Call(routes, row_of_pair, pair_weights, shape, None))
            ones = torch.ones((received.shape[0], 1), dtype=weights.dtype, device=weights.device)
            return (received, local[:, None], ones), {}
        padded, picked = _padded(received, local, self.per_rank)
        self.pending.append(_Call(routes, row_of_pair, None, shape, picked))
        return (padded,), {}

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        call = self.pending.pop()
        output = output.reshape(-1, output.shape[-1])  # one row per row received (DBRX returns [P, 1, H])
        output = output + _zero_reading(module, (*self.layer.param_names, *self.layer.shared_names), args[0])
        if call.picked is not None:
            output = output[call.picked]
        results = return_from_experts(output, call.routes, self.group, self.stats)
        if call.weights is not None:
            results = results * call.weights[:, None]
        rows = call.shape.numel() // call.shape[-1]
        combined = torch.zeros((rows, call.shape[-1]), dtype=output.dtype, device=output.device)
        return combined.index_add(0, call.row_of_pair, results.to(output.dtype)).reshape(call.shape)


def _padded(received: torch.Tensor, local: torch.Tensor, per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows received as `[per_rank * M, H]`, expert-major, each expert's rows first and zero rows after; and
    where each received row sits in it."""
    counts = torch.bincount(local, minlength=per_rank)
    most = max(int(counts.max().item()) if local.numel() else 0, 1)
    order = torch.sort(local, stable=True).indices
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.empty_like(local)
    slot[order] = torch.arange(local.numel(), device=local.device) - starts[local[order]]
    picked = local * most + slot
    padded = received.new_zeros((per_rank * most, *received.shape[1:]))
    return padded.index_copy(0, picked, received), picked


def _zero_reading(module: nn.Module, names: tuple[str, ...], received: torch.Tensor) -> torch.Tensor:
    """0, computed from every local expert parameter and from what this rank received ([Note: every expert
    parameter takes part] in engine/experts/parallel.py). Read by attribute: under peft's LoRA the value is the
    parametrized one, so the adapters take part too."""
    reads = []
    for name in names:
        owner, _, leaf = name.rpartition(".")
        reads.append(getattr(module.get_submodule(owner), leaf).reshape(-1)[:1].sum())
    return (sum(reads) + received.sum()) * 0.0


def _bound(layer: ExpertLayer, args: tuple, kwargs: dict) -> tuple[Any, ...]:
    values = dict(zip(layer.inputs, args, strict=False)) | {k: v for k, v in kwargs.items() if k in layer.inputs}
    missing = [key for key in layer.inputs if key not in values]
    if missing or len(args) + len(kwargs) != len(layer.inputs):
        raise TypeError(
            f"expert_parallel: {layer.name} was called with {len(args)} positional and {sorted(kwargs)} keyword "
            f"arguments; its forward takes exactly {layer.inputs}"
        )
    return tuple(values[key] for key in layer.inputs)
