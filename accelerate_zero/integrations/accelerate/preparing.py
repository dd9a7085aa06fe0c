"""Which objects passed to `ZeroAccelerator.prepare` go to the ZeRO engines, and how one model becomes a
`PreparedModel`: each model with the optimizer over its parameters and the `DummyScheduler` of that optimizer
(accelerate's messages where it has them), and the objects prepared by an earlier call."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from accelerate.utils.deepspeed import DummyOptim, DummyScheduler  # importable without deepspeed
from torch import nn

from accelerate_zero.config import ResolvedZeroConfig
from accelerate_zero.engine.engine import initialize
from accelerate_zero.engine.setup import forward_input_dtype
from accelerate_zero.integrations.accelerate.prepared import (
    CastForwardInputs,
    PreparedModel,
    ZeroOptimizerWrapper,
    is_zero_wrapper,
)


@dataclasses.dataclass(frozen=True)
class EngineObjects:
    """The objects of one `prepare` call that one engine takes, by their position in the call."""

    model: int
    optimizer: int | None
    """None: the model is prepared for inference."""
    scheduler: int | None
    """The `DummyScheduler` over the optimizer, if one was passed."""


@dataclasses.dataclass(frozen=True)
class PreparePlan:
    """What the objects of one `prepare` call hold for the ZeRO engines."""

    earlier: dict[int, Any]
    """Position -> what to return for an object prepared earlier: a prepared model or wrapper itself, the wrapper
    for the raw optimizer of a model prepared earlier."""
    engines: list[EngineObjects]
    """The engines to build, in the order of their models."""

    @property
    def owned(self) -> set[int]:
        """The positions of every object the engines take (accelerate prepares the others)."""
        owned = set(self.earlier)
        for objects in self.engines:
            owned.update(i for i in (objects.model, objects.optimizer, objects.scheduler) if i is not None)
        return owned


def plan_prepare(args: tuple, prepared: list[PreparedModel]) -> PreparePlan:
    """Sorts the objects passed to `prepare` into the engines they form and the objects prepared earlier.

    Args:
        args: the objects passed to `prepare`.
        prepared: the models this accelerator prepared before this call.

    Raises:
        ValueError: an optimizer was passed without the model owning its parameters, a model got several
            optimizers, or a `DummyScheduler` was passed without its model and optimizer.
    """
    earlier = {i: obj for i, obj in enumerate(args) if any(e.model is obj for e in prepared) or is_zero_wrapper(obj)}
    for i, obj in enumerate(args):
        wrapper = next((e.optimizer for e in prepared if e.optimizer and e.optimizer.optimizer is obj), None)
        if wrapper is not None:  # the raw optimizer of a model prepared earlier: its wrapper again
            earlier[i] = wrapper
    models = [i for i, obj in enumerate(args) if isinstance(obj, nn.Module) and i not in earlier]
    optimizers = [
        i for i, obj in enumerate(args) if isinstance(obj, (torch.optim.Optimizer, DummyOptim)) and i not in earlier
    ]
    dummy_schedulers = [i for i, obj in enumerate(args) if isinstance(obj, DummyScheduler)]
    pairs = pair_optimizers(args, models, optimizers, prepared)
    engines = []
    for model_index in models:
        opt_index = pairs.get(model_index)
        optimizer = args[opt_index] if opt_index is not None else None
        sched_index = next((i for i in dummy_schedulers if args[i].optimizer is optimizer), None)
        engines.append(EngineObjects(model_index, opt_index, sched_index))
    plan = PreparePlan(earlier, engines)
    if any(index not in plan.owned for index in dummy_schedulers):
        raise ValueError("a DummyScheduler was passed without the model and optimizer it belongs to")
    return plan


def models_to_train(args: tuple, prepared: list[PreparedModel]) -> list[nn.Module]:
    """The models prepared for inference earlier that are passed now with an optimizer over their parameters: they
    are released first (full weights and `requires_grad` back), then prepared for training."""
    optimizers = [o for o in args if isinstance(o, (torch.optim.Optimizer, DummyOptim)) and not is_zero_wrapper(o)]
    held = {id(p) for optimizer in optimizers for p in optimizer_params(optimizer)}
    inference = {id(entry.model) for entry in prepared if entry.optimizer is None}
    models = {
        id(obj): obj
        for obj in args
        if isinstance(obj, nn.Module) and id(obj) in inference and any(id(p) in held for p in obj.parameters())
    }
    return list(models.values())


def build_prepared_model(
    model: nn.Module,
    optimizer: Any,
    scheduler: DummyScheduler | None,
    config: ResolvedZeroConfig,
    device: torch.device,
) -> PreparedModel:
    """Builds the engine of `model` and what `prepare` returns with it (the optimizer wrapper, the input cast).

    Args:
        model: the model; trained in place.
        optimizer: a torch optimizer over its parameters, a `DummyOptim` (the config's optimizer), or None: the model
            is prepared for inference ([Note: models prepared for inference]).
        scheduler: the `DummyScheduler` passed with the optimizer, or None.
        config: the engine's config, every "auto" filled.
        device: where the engine places the model.
    """
    requires_grad = [p.requires_grad for p in model.parameters()]
    if optimizer is None:
        # [Note: models prepared for inference] The model is frozen and gets an engine whose optimizer has no
        # parameters: at stage 3 the engine shards the frozen weights (gathered unit by unit in forward); below
        # it, it only moves them to the device in the compute dtype and broadcasts rank 0's values. No gradient,
        # master weight or optimizer state is allocated.
        model.requires_grad_(False)
        engine = initialize(model, torch.optim.SGD([{"params": []}], lr=0.0), config, device=device)
        wrapper = None
    else:
        torch_optimizer = None if isinstance(optimizer, DummyOptim) else optimizer
        callable_scheduler = scheduler.lr_scheduler_callable if scheduler is not None else None
        engine = initialize(model, torch_optimizer, config, callable_scheduler, device=device)
        wrapper = ZeroOptimizerWrapper(engine.optimizer, engine)
    hooks = []
    input_dtype = forward_input_dtype(engine.config)
    if input_dtype is not None:
        # The model is returned unwrapped: a pre-hook casts its inputs as `engine(...)` would.
        hooks.append(model.register_forward_pre_hook(CastForwardInputs(input_dtype), with_kwargs=True))
    # accelerate returns DeepSpeed's engine from prepare, and RL code (TRL, OpenRLHF, verl) puts it to sleep between
    # rollouts through it: the model we return answers the same two calls (taken off again by `close`).
    model.offload_states, model.reload_states = engine.offload_states, engine.reload_states
    return PreparedModel(model, engine, wrapper, hooks, requires_grad)


def pair_optimizers(args: tuple, models: list[int], optimizers: list[int], prepared: list[PreparedModel]) -> dict:
    """model index -> the index of the optimizer over its parameters (each optimizer belongs to exactly one model)."""
    owner_of = {id(p): i for i in models for p in args[i].parameters()}
    pairs: dict[int, int] = {}
    for opt_index in optimizers:
        params = optimizer_params(args[opt_index])
        owners = {owner_of.get(id(p)) for p in params}
        if len(owners) != 1 or None in owners:
            earlier = any(any(p is q for q in e.model.parameters()) for e in prepared for p in params[:1])
            raise ValueError(
                "an optimizer was passed to prepare() without the model owning all its parameters"
                + (" (its model was prepared earlier without an optimizer, for inference)" if earlier else "")
                + ": with ZeroAccelerator a model and its optimizer must be passed together to the same prepare() call"
            )
        model_index = owners.pop()
        if model_index in pairs:
            raise ValueError("several optimizers for one model: the ZeRO engine steps one optimizer per model")
        pairs[model_index] = opt_index
    return pairs


def optimizer_params(optimizer: Any) -> list[torch.Tensor]:
    if isinstance(optimizer, DummyOptim):
        if not isinstance(optimizer.params, (list, tuple)):
            # DummyOptim(model.parameters()) holds a generator, which one reading would use up for every later one
            optimizer.params = list(optimizer.params)
        groups = list(optimizer.params)
        return [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    return [p for group in optimizer.param_groups for p in group["params"]]
