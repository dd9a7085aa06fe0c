"""Expert parallelism: each rank of an expert group keeps 1/ep of every MoE layer's experts and computes them for the
whole group's tokens.

[Note: the experts' own forward on the local experts]
The layer's experts module keeps its class, its forward and its parameter names; only its parameters shrink to
this rank's experts (`num_experts` with them, which the forward reads). Two hooks around that forward make it
expert-parallel ([Note: routes of an expert-parallel layer] in engine/experts/routing.py):
- before it, the routes are planned and each (token, slot) pair's hidden state goes to its expert's rank; the
  forward then runs on what arrived, each row with one local expert and a routing weight of exactly 1;
- after it, each result goes back to the pair's rank, where it is weighted by the pair's routing weight and added
  into the token's row, as the model's own forward does.
So every experts implementation transformers has (eager, batched, grouped matmuls) computes the local experts,
activations and biases included, with no copy of the model's code; the router, the top-k, the normalisation of
the weights and the load-balancing loss stay the model's.

[Note: every expert parameter takes part]
A rank whose experts received no pair in some call computes nothing with them (transformers' eager loop skips an
expert no token reached), so without care two things differ between ranks in backward: its expert parameters get
no gradient there while they do elsewhere (the gradient hooks the engine reduces with would fire on some ranks and
not on others), and its experts' output, made without any tensor that needs a gradient, would not carry the
return exchange into backward, whose all-to-all the other ranks then wait for forever. A zero-weighted term
reading every local expert parameter and the rows received is added to the output before it goes back, so on every
rank each parameter takes part in every backward (with a gradient of 0 where no token reached it) and both
exchanges run backward, in the same order.

[Note: gradients of split experts]
After backward, rank r's expert gradient holds the sum over its expert group's tokens of what reached its experts.
The ranks holding the same experts (one per expert group: W / ep of them, `ExpertPlacement.peers`) are these
experts' data-parallel ranks: the gradient of the mean loss over all W ranks is the sum over the peers divided by
W, not by the number of peers. What is not an expert parameter is reduced over all W ranks as usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.experts.adapters import localize_adapters
from accelerate_zero.engine.experts.blocks import ExpertLayer, find_expert_layers
from accelerate_zero.engine.experts.routing import Routes, plan_routes, return_from_experts, send_to_experts
from accelerate_zero.engine.groups import DataParallelGroup


_INPUTS = ("hidden_states", "top_k_index", "top_k_weights")


@dataclass
class ExpertPlacement:
    """Which experts this rank holds, per layer, and the groups that train them."""

    group: DataParallelGroup
    """The expert group: its ranks hold the experts of one layer between them and exchange tokens."""
    peers: DataParallelGroup | None
    """The ranks holding the same experts (one per expert group); None when there is one expert group."""
    layers: list[ExpertLayer]
    ranges: dict[str, tuple[int, int]]
    """Layer name -> the global experts [start, stop) this rank holds."""
    handles: list[RemovableHandle] = field(default_factory=list)
    adapters: list[nn.Module] = field(default_factory=list)
    """peft LoRA wrappers of the split parameters, whole on every rank ([Note: LoRA on split experts] in
    engine/experts/adapters.py)."""

    def expert_parameters(self) -> list[nn.Parameter]:
        """Every split parameter, in layer order ([Note: gradients of split experts])."""
        return [getattr(layer.module, name) for layer in self.layers for name in layer.param_names]

    def adapter_parameters(self, param: nn.Parameter) -> list[nn.Parameter]:
        """The (whole) adapter tensors whose update merges into the split parameter `param`."""
        split = {id(p) for p in self.expert_parameters()}
        wrappers = [w for w in self.adapters if w.get_param() is param]
        return [p for w in wrappers for p in w.parameters() if id(p) not in split]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


def split_experts(
    model: nn.Module,
    group: DataParallelGroup,
    stats: CommStats,
    peers: DataParallelGroup | None = None,
) -> ExpertPlacement:
    """Keeps this rank's 1/ep of every fused experts module of `model` and makes those modules expert-parallel over
    `group` ([Note: the experts' own forward on the local experts]). `model` must hold every expert when called.

    Raises:
        ValueError: no experts module, or a layer whose experts do not divide evenly by the group size (named).
        NotImplementedError: a layer that cannot be split ([Note: which expert layers are split]).
    """
    layers = find_expert_layers(model)
    if not layers:
        raise ValueError(
            "expert_parallel: the model has no fused experts module (3-D parameters indexed by expert, as "
            "transformers 5 builds Qwen3-MoE, Mixtral, gpt-oss, ...); turn expert_parallel off for a dense model"
        )
    ep = group.world_size
    placement = ExpertPlacement(group, peers, layers, {})
    for layer in layers:
        if layer.num_experts % ep:
            raise ValueError(
                f"expert_parallel: {layer.name} has {layer.num_experts} experts, which {ep} ranks cannot split "
                f"evenly; choose an expert-parallel size that divides {layer.num_experts}"
            )
        per_rank = layer.num_experts // ep
        start = group.rank * per_rank
        for name in layer.param_names:
            # The same Parameter, shrunk: an optimizer built over the model before the split still holds it.
            param = getattr(layer.module, name)
            if not param.is_floating_point():
                raise NotImplementedError(
                    f"expert_parallel: {layer.name}.{name} holds {param.dtype} values (quantized experts?), which are "
                    "not cut by expert; keep the experts in a floating-point dtype (bitsandbytes' 4-bit QLoRA leaves "
                    "fused experts unquantized) or train without expert_parallel"
                )
            param.data = param.data[start : start + per_rank].clone()
        layer.module.num_experts = per_rank  # what the experts' own forward reads (one-hot width, group bins)
        # [Note: LoRA on split experts] in engine/experts/adapters.py
        placement.adapters += localize_adapters(model, layer.module, layer.name, start, start + per_rank)
        placement.ranges[layer.name] = (start, start + per_rank)
        calls = _LayerCalls(layer, per_rank, group, stats)
        placement.handles.append(layer.module.register_forward_pre_hook(calls.before, with_kwargs=True))
        placement.handles.append(layer.module.register_forward_hook(calls.after, with_kwargs=True))
    return placement


@dataclass
class _Call:
    routes: Routes
    token_of_pair: torch.Tensor
    weights: torch.Tensor  # [pairs]: the routing weights, kept on this rank
    shape: torch.Size


class _LayerCalls:
    """The two hooks of one split layer; calls in flight are a stack (activation checkpointing re-runs a forward
    inside backward, between another call's hooks)."""

    def __init__(self, layer: ExpertLayer, per_rank: int, group: DataParallelGroup, stats: CommStats) -> None:
        self.layer, self.per_rank, self.group, self.stats = layer, per_rank, group, stats
        self.pending: list[_Call] = []

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, index, weights = _bound(self.layer.name, args, kwargs)
        tokens, k = index.shape
        routes = plan_routes(index, self.per_rank, self.group, self.stats)
        token_of_pair = torch.arange(tokens, device=index.device).repeat_interleave(k)
        received = send_to_experts(hidden[token_of_pair], routes, self.group, self.stats)
        self.pending.append(_Call(routes, token_of_pair, weights.reshape(-1), hidden.shape))
        ones = torch.ones((received.shape[0], 1), dtype=weights.dtype, device=weights.device)
        return (received, routes.received_experts[:, None], ones), {}

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor:
        call = self.pending.pop()
        output = output + _zero_reading(module, self.layer.param_names, args[0])
        results = return_from_experts(output, call.routes, self.group, self.stats)
        weighted = results * call.weights[:, None]
        combined = torch.zeros(call.shape, dtype=output.dtype, device=output.device)
        return combined.index_add(0, call.token_of_pair, weighted.to(output.dtype))


def _zero_reading(module: nn.Module, names: tuple[str, ...], received: torch.Tensor) -> torch.Tensor:
    """0, computed from every local expert parameter and from what this rank received ([Note: every expert
    parameter takes part])."""
    reads = [getattr(module, name).reshape(-1)[:1].sum() for name in names]
    return (sum(reads) + received.sum()) * 0.0


def _bound(name: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    values = dict(zip(_INPUTS, args, strict=False)) | {k: v for k, v in kwargs.items() if k in _INPUTS}
    missing = [key for key in _INPUTS if key not in values]
    if missing or len(args) + len(kwargs) != len(_INPUTS):
        raise TypeError(
            f"expert_parallel: {name} was called with {len(args)} positional and {sorted(kwargs)} keyword "
            f"arguments; an experts module takes exactly {_INPUTS}"
        )
    return values["hidden_states"], values["top_k_index"], values["top_k_weights"]
