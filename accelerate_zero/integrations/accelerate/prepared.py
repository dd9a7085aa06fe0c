"""What `ZeroAccelerator.prepare` returns and keeps for each model: the no-op optimizer and scheduler wrappers (the
engine steps both), the record of a prepared model (its engine, hooks, and how to give it back), and the lookups
over those records."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from torch import nn
from torch.utils.hooks import RemovableHandle

from accelerate_zero.engine.engine import ZeroEngine
from accelerate_zero.engine.gathered import GatheredParameters
from accelerate_zero.engine.setup import cast_forward_inputs


class ZeroOptimizerWrapper(AcceleratedOptimizer):
    """The optimizer `ZeroAccelerator.prepare` returns: `step()` and `zero_grad()` do nothing.

    The engine steps the optimizer inside `accelerator.backward` on the accumulation boundary and zeroes the
    gradients after it (as accelerate's `DeepSpeedOptimizerWrapper`), so a loop written for accelerate runs as is.
    `param_groups`, `state_dict()` and `load_state_dict()` are those of the user's optimizer, which the engine keeps
    and re-points at this rank's fp32 shard.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, engine: ZeroEngine) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.engine = engine
        self._step_was_skipped = False

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        pass  # the engine zeroes its gradient buffers after each optimizer step

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        pass  # accelerator.backward steps the engine on the accumulation boundary

    @property
    def step_was_skipped(self) -> bool:
        """True when the last optimizer step was skipped because of an fp16 (or bf16) gradient overflow."""
        return self._step_was_skipped


class ZeroSchedulerWrapper(AcceleratedScheduler):
    """A scheduler the engine built (config `scheduler` block, or `DummyScheduler(lr_scheduler_callable=...)`).

    The engine steps it after each optimizer step that was not skipped, so `step()` does nothing here (as
    accelerate's `DeepSpeedSchedulerWrapper`); its state is saved with the engine checkpoint.
    """

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass


@dataclasses.dataclass
class PreparedModel:
    """A model `prepare` handed to an engine."""

    model: nn.Module
    engine: ZeroEngine
    optimizer: ZeroOptimizerWrapper | None
    """None: prepared for inference (frozen, no optimizer state; sharded at stage 3)."""
    hooks: list[RemovableHandle]
    """Hooks this accelerator added to the model (the input cast under bf16/fp16)."""
    requires_grad: list[bool]
    """Each parameter's `requires_grad` before prepare (a model prepared for inference is frozen)."""

    def close(self) -> None:
        for handle in self.hooks:
            handle.remove()
        for name in ("offload_states", "reload_states"):  # the engine's, set by prepare
            self.model.__dict__.pop(name, None)
        self.engine.destroy()

    def release(self) -> None:
        """Gives the model back as it was before prepare: full parameters (gathered at stage 3, in the compute
        dtype), the original `requires_grad` flags, no hooks."""
        engine = self.engine
        full: dict[int, torch.Tensor] = {}
        for params in engine.gather_groups():  # stage 3: each parameter gets its own full tensor again
            with GatheredParameters(params):
                full.update({id(p): p.data.clone() for p in params})
        self.close()
        for param, flag in zip(self.model.parameters(), self.requires_grad, strict=True):
            if id(param) in full:
                param.data = full[id(param)]
            param.requires_grad_(flag)
        for flag in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):  # engine/setup.py keep_generate_in_step
            self.model.__dict__.pop(flag, None)


def prepared_of_param(prepared: list[PreparedModel], param: torch.Tensor) -> PreparedModel | None:
    """The prepared model holding `param`, or None."""
    return next((e for e in prepared if any(p is param for p in e.model.parameters())), None)


def trained_by_backward(prepared: list[PreparedModel], model: nn.Module | None) -> PreparedModel | None:
    """The prepared model a backward trains: `model`'s, else the only one prepared with an optimizer (None: none is).

    Raises:
        ValueError: `model` was not prepared together with its optimizer.
        RuntimeError: `model` is None and several models were prepared with optimizers.
    """
    if model is not None:
        entry = next((e for e in prepared if e.model is model), None)
        if entry is None or entry.optimizer is None:
            raise ValueError("backward(model=...) must be a model prepared together with its optimizer")
        return entry
    training = [entry for entry in prepared if entry.optimizer is not None]
    if len(training) > 1:
        raise RuntimeError(
            f"{len(training)} models were prepared with optimizers and one backward drives one engine: pass "
            "the model this loss trains, accelerator.backward(loss, model=model)"
        )
    return training[0] if training else None


def is_zero_wrapper(obj: Any) -> bool:
    return isinstance(obj, (ZeroOptimizerWrapper, ZeroSchedulerWrapper))


class CastForwardInputs:
    """A forward pre-hook casting the model's floating-point inputs to the compute dtype, as `ZeroEngine.__call__`
    does ([Note: casting forward inputs] in engine/setup.py): the model is returned unwrapped, so its own forward
    must accept what the engine's would."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        return cast_forward_inputs(args, kwargs, self.dtype)
