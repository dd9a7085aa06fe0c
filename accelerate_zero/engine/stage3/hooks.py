"""Module and tensor hooks for stage 3: they keep their handles and delegate to the UnitScheduler."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from accelerate_zero.engine.stage3.param_unit import ParamUnit
from accelerate_zero.engine.stage3.schedule import UnitScheduler


def register_unit_hooks(units: list[ParamUnit], scheduler: UnitScheduler) -> list[RemovableHandle]:
    """Gather before each unit's forward, release after it, and gather again before its backward."""
    handles = []
    for unit in units:
        handles.append(unit.module.register_forward_pre_hook(_PreForward(unit, scheduler), prepend=True))
        # always_call: a forward that raises still leaves the unit and the scheduler consistent
        handles.append(unit.module.register_forward_hook(_PostForward(unit, scheduler), always_call=True))
    return handles


class _PreForward:
    def __init__(self, unit: ParamUnit, scheduler: UnitScheduler) -> None:
        self.unit, self.scheduler = unit, scheduler

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        with torch.profiler.record_function("ZeRO::pre_forward"):
            self.scheduler.pre_forward(self.unit)


class _PostForward:
    def __init__(self, unit: ParamUnit, scheduler: UnitScheduler) -> None:
        self.unit, self.scheduler = unit, scheduler

    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        with torch.profiler.record_function("ZeRO::post_forward"):
            if torch.is_grad_enabled():
                pre_backward = _PreBackward(self.unit, self.scheduler)
                for tensor in _tensors(output):
                    if tensor.requires_grad:
                        tensor.register_hook(pre_backward)
            self.scheduler.post_forward(self.unit)


class _PreBackward:
    """Runs when the gradient of one of the unit's outputs is computed, i.e. before the unit's own backward."""

    def __init__(self, unit: ParamUnit, scheduler: UnitScheduler) -> None:
        self.unit, self.scheduler = unit, scheduler

    def __call__(self, grad: torch.Tensor) -> None:
        with torch.profiler.record_function("ZeRO::pre_backward"):
            self.scheduler.pre_backward(self.unit)


def _tensors(output: Any) -> list[torch.Tensor]:
    if torch.is_tensor(output):
        return [output]
    if isinstance(output, dict):
        return [t for value in output.values() for t in _tensors(value)]
    if isinstance(output, (list, tuple)):
        return [t for value in output for t in _tensors(value)]
    return []


class PlaceholderStateDictGuard:
    """A state_dict post-hook refusing to return partitioned placeholders (they would become empty weight files)."""

    def __init__(self) -> None:
        self.enabled = True

    def __call__(self, module: torch.nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        if not self.enabled:
            return
        empty = [name for name, value in state_dict.items() if torch.is_tensor(value) and value.numel() == 0]
        if empty:
            raise RuntimeError(
                f"model.state_dict() under ZeRO stage 3 would hold empty placeholders ({empty[:3]} ...): the "
                "parameters are partitioned. Use engine.full_state_dict() or engine.save_16bit_model(dir), or read "
                "them inside accelerate_zero.GatheredParameters(model.parameters()) on every rank"
            )

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True
