"""What a ZeRO run with expert parallelism (`expert_parallel.autoep_size` = ep) would hold per rank.

[Note: what expert parallelism holds, per rank]
As the engine lays it out ([Note: expert parallelism in the engine] in engine/experts/partition.py), with W ranks and
an MoE model whose fused experts modules are found by structure (`find_expert_layers`: 3-D tensors indexed by
expert, `gate_up_proj [E, 2I, H]` and `down_proj [E, H, I]` in transformers 5):
- the rest of the model (attention, routers, embeddings, shared experts, norms) is laid out over all W ranks at the
  configured stage exactly as without expert parallelism (`estimate_stage`), its stage 3 units built without the
  experts;
- each rank keeps E / ep consecutive experts of every layer (1/ep of the experts' elements), in the compute dtype;
- at stages 1 and 2 (and at stage 3 when ep = W, a single peer) those local experts stay whole: one flat group per
  optimizer param group, partitioned over their W / ep peers (the ranks holding the same experts) with stage 1's
  rules at stage 1 and stage 2's otherwise: fp32 masters (under bf16/fp16) and optimizer states 1/(W/ep) of the
  local experts, so 1/W of all the experts as without expert parallelism; gradients full at stage 1, 1/(W/ep) at
  stages 2-3;
- at stage 3 with ep < W they are laid out by stage 3's own rule over the peers ([Note: experts below 1/ep at
  stage 3] in engine/experts/gather_units.py): one gather unit per layer cut over the peers, the experts under
  `stage3_param_persistence_threshold` (their local size, within what the rest left of
  `stage3_model_persistence_threshold`) kept whole as above. The parameters too are then 1/W of the experts.
So per rank, against flat stage 3, only the parameters at stages 1-2 grow: the experts' share from X c / W to
X c / ep (X the experts' elements, c the compute dtype's bytes); the gradients, masters and states are the same.
Transient buffers: the experts' reduce buckets are added to the rest's (an upper bound), and so are the experts'
gathered units at stage 3. Offload with expert parallelism is not estimated (only "none").
`tests/distributed/test_estimate_experts_vs_engine.py` compares this with `engine.memory_breakdown()`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from accelerate_zero.config.schema import ZeroOptimizationConfig
from accelerate_zero.debug.estimate import (
    DEVICE_KINDS,
    MODEL_STATE_KINDS,
    Architecture,
    MemoryEstimate,
    ModelShapes,
    Shape,
    TrainingSetup,
    estimate_stage,
)
from accelerate_zero.engine.experts.blocks import ExpertLayer, find_expert_layers
from accelerate_zero.engine.experts.gather_units import expert_persistence
from accelerate_zero.engine.stage3.build import plan_units


EXPERT_STAGES = (1, 2, 3)
"""`config.resolve` refuses expert parallelism at stage 0."""


@dataclass(frozen=True)
class ExpertShapes:
    """An MoE model split for expert parallelism of size `ep`: the rest as `ModelShapes`, and each rank's experts."""

    ep: int
    rest: ModelShapes
    """Every trainable parameter but the split experts; stage 3 units built without them."""
    local_experts: tuple[Shape, ...]
    """The shapes of one rank's trainable experts tensors (E / ep rows each), in model order."""
    expert_numel: int
    """Elements of every expert of every layer (the whole model's experts)."""
    layers: tuple[tuple[str, int], ...]
    """(qualified name, experts) of each split layer."""
    top_k: int = 0
    """Experts each token is routed to (rows per token each all-to-all moves); 0: unknown."""
    hidden: int = 0
    """Width of a token's row in the all-to-alls (the model's hidden size); 0: unknown."""
    local_units: tuple[tuple[Shape, ...], ...] = ()
    """Stage 3 with ep < W: per split layer, its trainable local experts cut over the peers (a gather unit)."""
    local_persistent: tuple[Shape, ...] = ()
    """Stage 3 with ep < W: the trainable local experts kept whole (under the persistence thresholds)."""

    @property
    def local_numel(self) -> int:
        return sum(math.prod(shape) for shape in self.local_experts)


def expert_shapes_from_module(
    model: nn.Module,
    ep: int,
    zero: ZeroOptimizationConfig | None = None,
    *,
    architecture: Architecture | None = None,
) -> ExpertShapes:
    """The shapes `ZeroEngine` would lay out for `model` under `expert_parallel.autoep_size=ep` (the model may live
    on the meta device).

    Raises:
        ValueError: `model` has no fused experts module (a dense model), or ep does not divide a layer's experts.
        NotImplementedError: a layer that cannot be split ([Note: which expert layers are split]).
    """
    if ep < 1:
        raise ValueError(f"--expert_parallel must be at least 1, got {ep=}")
    layers = find_expert_layers(model)
    if not layers:
        raise ValueError(
            f"--expert_parallel {ep}: {type(model).__name__} has no fused experts module (3-D parameters indexed by "
            "expert, as transformers 5 builds Qwen3-MoE, Mixtral, gpt-oss, ...): a dense model has nothing to split; "
            "drop --expert_parallel"
        )
    uneven = [f"{layer.name} ({layer.num_experts} experts)" for layer in layers if layer.num_experts % ep]
    if uneven:
        raise ValueError(
            f"--expert_parallel {ep} does not divide the experts of {uneven[0]}"
            + (f" and {len(uneven) - 1} more layers" if len(uneven) > 1 else "")
            + f": use a divisor of {layers[0].num_experts}"
        )
    experts = [param for layer in layers for param in layer.params()]
    split = {id(p) for p in experts}
    zero = zero if zero is not None else ZeroOptimizationConfig()
    units = plan_units(model, zero, exclude=experts)
    budget = zero.stage3_model_persistence_threshold - sum(p.numel() for p in units.persistent)
    local_numel = lambda p: p.numel() // ep  # noqa: E731  (the model is not split)
    kept = expert_persistence(model, experts, zero.stage3_param_persistence_threshold, budget, local_numel)
    kept_ids = {id(p) for p in kept}
    trainable = [p for p in model.parameters() if p.requires_grad and id(p) not in split]
    persistent = set(units.persistent)
    rest = ModelShapes(
        shapes=tuple(tuple(p.shape) for p in trainable),
        units=tuple(tuple(tuple(p.shape) for p in spec.trainable) for spec in units.units),
        persistent=tuple(tuple(p.shape) for p in trainable if p in persistent),
        architecture=architecture,
    )

    def local(params: list[nn.Parameter]) -> tuple[Shape, ...]:
        return tuple((p.shape[0] // ep, *p.shape[1:]) for p in params if p.requires_grad)

    cut = [local([p for p in layer.params() if id(p) not in kept_ids]) for layer in layers]
    return ExpertShapes(
        ep=ep,
        rest=rest,
        local_experts=local(experts),
        local_units=tuple(shapes for shapes in cut if shapes),
        local_persistent=local(kept),
        expert_numel=sum(p.numel() for p in experts),
        layers=tuple((layer.name, layer.num_experts) for layer in layers),
        top_k=_routed_per_token(model, layers[0]),
        hidden=int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0),
    )


def _routed_per_token(model: nn.Module, layer: ExpertLayer) -> int:
    """The top-k of a layer's router: the block's or its router's `top_k`, else the config's name for it."""
    block = model.get_submodule(layer.name.rpartition(".")[0]) if "." in layer.name else model
    for module in block.modules():
        top_k = getattr(module, "top_k", None)
        if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k > 0:
            return top_k
    config = getattr(model, "config", None)
    for key in ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def estimate_expert_parallel(
    model: ExpertShapes, setup: TrainingSetup, stage: int, offload: str = "none", *, rank: int = 0
) -> MemoryEstimate:
    """Bytes `rank` would hold at `stage` with expert parallelism ([Note: what expert parallelism holds, per
    rank]), under the kinds of `ZeroEngine.memory_breakdown()`.

    Raises:
        ValueError: stage 0, an offload mode other than "none", an ep that does not divide `setup.world_size`, or a
            rank outside the world.
    """
    world, ep = setup.world_size, model.ep
    if stage not in EXPERT_STAGES:
        raise ValueError(f"expert parallelism runs at ZeRO stages 1-3, got {stage=}")
    if offload != "none":
        raise ValueError(f"offload with expert parallelism is not estimated, got {offload=}: use offload='none'")
    if world % ep:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(f"--expert_parallel {ep} does not divide the {world} GPUs: use one of {divisors}")
    rest = estimate_stage(model.rest, setup, stage, rank=rank)
    if not model.local_experts:  # every expert frozen: not counted, as `estimate_stage` counts no frozen parameter
        return rest
    peers = dataclasses.replace(setup, world_size=world // ep)
    kinds: tuple[str, ...] = (*MODEL_STATE_KINDS, "communication_buffers")
    if stage == 3 and world > ep:  # [Note: experts below 1/ep at stage 3]; the root unit last, empty
        expert_stage, kinds = 3, (*kinds, "gathered_parameters")
        local = ModelShapes(model.local_experts, units=(*model.local_units, ()), persistent=model.local_persistent)
    else:
        expert_stage = min(stage, 2)
        local = ModelShapes(shapes=model.local_experts, units=(), persistent=())
    experts = estimate_stage(local, peers, expert_stage, rank=rank // ep)  # the peers: rank // ep in its group
    return _with(rest, {kind: experts.device[kind] for kind in kinds})


def _with(base: MemoryEstimate, extra: dict[str, int]) -> MemoryEstimate:
    device = {kind: base.device[kind] + extra.get(kind, 0) for kind in DEVICE_KINDS}
    device["total"] = sum(device.values())
    return MemoryEstimate(stage=base.stage, offload=base.offload, device=device, host=base.host, nvme=base.nvme)


def expert_bytes_per_rank(model: ExpertShapes, setup: TrainingSetup, stage: int) -> dict[str, int]:
    """The experts' own bytes per rank (what `estimate_expert_parallel` adds to the rest's), and, for comparison,
    the experts' parameter bytes one rank holds at flat stage 3 (1/W of them, unpadded)."""
    rest = estimate_stage(model.rest, setup, stage)
    whole = estimate_expert_parallel(model, setup, stage)
    out = {kind: whole.device[kind] - rest.device[kind] for kind in MODEL_STATE_KINDS}
    out["total"] = sum(out.values())
    out["flat_stage3_parameters"] = model.expert_numel * setup.compute_bytes // setup.world_size
    return out


def is_applicable(stage: int, offload: str) -> bool:
    """The (stage, offload) combinations estimated with expert parallelism ([Note: what expert parallelism holds,
    per rank])."""
    return stage in EXPERT_STAGES and offload == "none"


def report_section(model: ExpertShapes, setup: TrainingSetup) -> dict:
    """The `expert_parallel` section of `accelerate-zero estimate --json` (its schema is in cli/estimate.py)."""
    return {
        "size": model.ep,
        "peers": setup.world_size // model.ep,
        "layers": len(model.layers),
        "experts_per_layer": model.layers[0][1],
        "experts_per_rank_per_layer": model.layers[0][1] // model.ep,
        "expert_parameters": model.expert_numel,
        "expert_parameters_per_rank": model.local_numel,
        "expert_bytes_per_rank": {stage: expert_bytes_per_rank(model, setup, stage) for stage in EXPERT_STAGES},
    }


def deepspeed_block(model: ExpertShapes | None) -> dict:
    """The config block that selects this layout (DeepSpeed's AutoEP keys); {} without expert parallelism."""
    return {} if model is None else {"expert_parallel": {"enabled": True, "autoep_size": model.ep}}


def estimate(
    model: ExpertShapes | None, shapes: ModelShapes, setup: TrainingSetup, stage: int, offload: str
) -> MemoryEstimate:
    """`estimate_expert_parallel` for a split model, `estimate_stage` of `shapes` without expert parallelism."""
    if model is None:
        return estimate_stage(shapes, setup, stage, offload)
    return estimate_expert_parallel(model, setup, stage, offload)


def for_estimate(ep: int | None, loaded: Any, setup: TrainingSetup, offload: str) -> ExpertShapes | None:
    """`accelerate-zero estimate --expert_parallel EP`: the model split as the engine would split it; None without
    the flag.

    Args:
        loaded: the `model_source.LoadedModel` of --config_json / --model; None for --params.
        offload: the --offload flag ("all" or a mode).

    Raises:
        ValueError: no model layers to read (--params), an offload mode, an ep that divides neither the GPUs nor a
            layer's experts, a dense model, or a layer that cannot be split.
    """
    if ep is None:
        return None
    if loaded is None:
        raise ValueError("--expert_parallel needs the model's layers: give --config_json or --model, not --params")
    if offload not in ("all", "none"):
        raise ValueError(f"--expert_parallel is estimated without offload only, got --offload {offload}")
    if setup.world_size % ep:
        sizes = [d for d in range(1, setup.world_size + 1) if setup.world_size % d == 0]
        raise ValueError(f"--expert_parallel {ep} does not divide the {setup.world_size} GPUs: use one of {sizes}")
    try:
        return expert_shapes_from_module(loaded.module, ep, setup.zero, architecture=loaded.architecture)
    except NotImplementedError as error:
        raise ValueError(str(error)) from error


def notes(model: ExpertShapes | None, setup: TrainingSetup | None = None, tokens: int | None = None) -> list[str]:
    """What the estimate's notes say about expert parallelism (with `setup` and `tokens` per GPU and micro-step:
    whether it moves fewer bytes than flat stage 3, [Note: expert bytes against flat stage 3])."""
    if model is None:
        return []
    experts, layers = model.layers[0][1], len(model.layers)
    out = [
        f"expert parallelism {model.ep}: each GPU holds {experts // model.ep} of the {experts} experts of each of "
        f"{layers} MoE layers, whole at stages 1-2 (1/ep of the experts, not 1/W) and at stage 3 partitioned over "
        "the GPUs holding the same experts (1/W, as flat stage 3); their gradients, master weights and optimizer "
        "states are partitioned over those GPUs at every stage. Stages 1-3 without offload only."
    ]
    if setup is not None and tokens is not None and model.top_k and model.hidden:
        out.append(traffic_note(model, setup, tokens))
    return out


# [Note: expert bytes against flat stage 3]
# Per GPU and micro-step, counted as engine/collectives.py counts them (payload x (g - 1)/g over g ranks; an
# all-to-all: the rows that leave the rank), X the experts' elements, W GPUs, L MoE layers, T tokens per GPU, k
# experts per token, H the hidden size, c / g the compute / gradient dtype's bytes, P = W / ep peers:
# - flat stage 3 gathers every expert once in forward (DeepSpeed's default reuse distance keeps it to backward) and
#   reduce-scatters its gradient: X (c + g) (W - 1) / W;
# - expert parallelism sends each (token, expert) row to its expert's rank and back, and both again in backward:
#   4 L T k H c (ep - 1) / ep; over the peers it reduce-scatters the local experts' gradients, X / ep g (P - 1)/P,
#   and all-gathers the local experts, X / ep c (P - 1) / P: after the step at stages 1-2 (accumulation divides it),
#   in each micro-step's forward at stage 3 ([Note: experts below 1/ep at stage 3]; kept to backward at DeepSpeed's
#   default reuse distance, as flat stage 3's). Counted here at accumulation 1, where the two are the same.
# The all-to-alls grow with T and flat stage 3's bytes do not: expert parallelism moves fewer bytes below the token
# count where the two meet, and more above it (it still gathers no expert: the peak holds no gathered expert). The
# bench (bench/expert_parallel.py, bench/README.md) measured 42.01 MB against 75.50 (0.556) at ep 2, W 4 and 1,024
# tokens; this formula gives 41.94 against 75.50. It assumes tokens routed uniformly ((ep - 1)/ep of the rows leave
# the rank): the bench's router at ep 4 sent 8% more rows away than that.
def micro_step_bytes(model: ExpertShapes, setup: TrainingSetup, tokens: int) -> dict[str, float]:
    """The experts' bytes per GPU and micro-step with expert parallelism and at flat stage 3 ([Note: expert bytes
    against flat stage 3]), the tokens per GPU and micro-step at which they are equal (`crossover_tokens`), and up to
    which expert parallelism moves at most 1/ep of flat stage 3's (`one_ep_th_tokens`)."""
    world, ep, layers = setup.world_size, model.ep, len(model.layers)
    c, g = setup.compute_bytes, setup.comm_bytes
    peers = world // ep
    flat = model.expert_numel * (c + g) * (world - 1) / world
    per_token = 4 * layers * model.top_k * model.hidden * c * (ep - 1) / ep
    peers_bytes = model.expert_numel / ep * (g + c) * (peers - 1) / peers
    crossover = (flat - peers_bytes) / per_token if per_token else math.inf
    within_goal = (flat / ep - peers_bytes) / per_token if per_token else math.inf
    return {
        "expert_parallel": per_token * tokens + peers_bytes,
        "flat_stage3": flat,
        "crossover_tokens": crossover,
        "one_ep_th_tokens": max(within_goal, 0.0),
    }


def traffic_note(model: ExpertShapes, setup: TrainingSetup, tokens: int) -> str:
    """The estimate's line telling which of expert parallelism and flat stage 3 moves fewer expert bytes."""
    counted = micro_step_bytes(model, setup, tokens)
    ours, flat, crossover = counted["expert_parallel"], counted["flat_stage3"], counted["crossover_tokens"]
    goal = counted["one_ep_th_tokens"]
    fewer = "fewer" if ours < flat else "more"
    choice = (
        "expert parallelism moves fewer bytes"
        if ours < flat
        else "flat stage 3 (no --expert_parallel) moves fewer bytes; expert parallelism still gathers no expert"
    )
    return (
        f"expert bytes per GPU and micro-step at {tokens} tokens per GPU (--micro_batch x --seq_len): expert "
        f"parallelism {model.ep} moves {ours / 2**20:.1f} MiB (token all-to-alls, the peers' gradient "
        f"reduce-scatter and experts' gather at accumulation 1), {fewer} than flat stage 3's "
        f"{flat / 2**20:.1f} MiB (expert gathers and gradient reduce-scatters), {ours / flat:.2f}x; they meet at "
        f"about {crossover:.0f} tokens per GPU and micro-step (1/ep of flat stage 3's up to about {goal:.0f}): "
        f"here {choice}."
    )
