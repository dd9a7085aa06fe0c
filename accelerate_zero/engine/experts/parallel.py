"""Expert parallelism: each rank of an expert group keeps 1/ep of every MoE layer's experts and computes them for the
whole group's tokens.

[Note: the experts' own forward on the local experts]
The layer's experts module keeps its class, its forward and its parameter names; only its parameters shrink to
this rank's experts (`num_experts` with them, which the forward reads). Two hooks around that forward make it
expert-parallel ([Note: routes of an expert-parallel layer] in engine/experts/routing.py; engine/experts/calls.py
for each way a block calls its experts):
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

from torch import nn
from torch.utils.hooks import RemovableHandle

from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.experts.adapters import localize_adapters
from accelerate_zero.engine.experts.blocks import ExpertLayer, counts_experts, find_expert_layers
from accelerate_zero.engine.experts.calls import LayerCalls
from accelerate_zero.engine.groups import DataParallelGroup


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
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """id(split parameter) -> its shape on this rank (stage 3 may leave the parameter an empty placeholder)."""
    handles: list[RemovableHandle] = field(default_factory=list)
    adapters: list[nn.Module] = field(default_factory=list)
    """peft LoRA wrappers of the split parameters, whole on every rank ([Note: LoRA on split experts] in
    engine/experts/adapters.py)."""

    def expert_parameters(self) -> list[nn.Parameter]:
        """Every split parameter, in layer order ([Note: gradients of split experts])."""
        return [param for layer in self.layers for param in layer.params()]

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
        counting = counts_experts(model)
        raise ValueError(
            "expert_parallel: the model has no fused experts module (3-D parameters indexed by expert, as "
            "transformers 5 builds Qwen3-MoE, Mixtral, gpt-oss, ...); turn expert_parallel off for a dense model"
            + (f" (modules that count experts but hold none fused: {', '.join(counting[:3])})" if counting else "")
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
        for name, param in zip(layer.param_names, layer.params(), strict=True):
            # The same Parameter, shrunk: an optimizer built over the model before the split still holds it.
            if not param.is_floating_point():
                raise NotImplementedError(
                    f"expert_parallel: {layer.name}.{name} holds {param.dtype} values (quantized experts?), which are "
                    "not cut by expert; keep the experts in a floating-point dtype (bitsandbytes' 4-bit QLoRA leaves "
                    "fused experts unquantized) or train without expert_parallel"
                )
            rows = param.shape[0] // layer.num_experts  # 1, or DBRX's F rows per expert
            param.data = param.data[start * rows : (start + per_rank) * rows].clone()
            placement.shapes[id(param)] = tuple(param.shape)
        layer.module.num_experts = per_rank  # what the experts' own forward reads (one-hot width, group bins)
        # [Note: LoRA on split experts] in engine/experts/adapters.py
        placement.adapters += localize_adapters(model, layer.module, layer.name, start, start + per_rank)
        placement.ranges[layer.name] = (start, start + per_rank)
        calls = LayerCalls(layer, per_rank, group, stats)
        placement.handles.append(layer.module.register_forward_pre_hook(calls.before, with_kwargs=True))
        placement.handles.append(layer.module.register_forward_hook(calls.after, with_kwargs=True))
    return placement
