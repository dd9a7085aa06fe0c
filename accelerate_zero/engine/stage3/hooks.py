"""Module and tensor hooks for stage 3: they keep their handles and delegate to the UnitScheduler.

Under torch.compile the unit hooks run outside the graphs and the entry hooks inside a unit are traced as nothing
([Note: compiling around ZeRO's hooks] in engine/compile_boundary.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from accelerate_zero.engine.compile_boundary import outside_compile, tracing
from accelerate_zero.engine.stage3.external import param_index
from accelerate_zero.engine.stage3.param_unit import ParamUnit
from accelerate_zero.engine.stage3.schedule import UnitScheduler


def register_unit_hooks(units: list[ParamUnit], scheduler: UnitScheduler) -> list[RemovableHandle]:
    """Gather before each unit's forward, release after it, and gather again before its backward."""
    handles = []
    for unit in units:
        pre_forward = _PreForward(unit, scheduler)
        handles.append(unit.module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True))
        # always_call: a forward that raises still leaves the unit and the scheduler consistent
        handles.append(unit.module.register_forward_hook(_PostForward(unit, scheduler), always_call=True))
    return handles


def entry_units(model: nn.Module, units: list[ParamUnit]) -> list[tuple[nn.Module, list[ParamUnit]]]:
    """Every sub-module whose call alone needs units that no hook of its own gathers ([Note: sub-module calls]).

    For each module other than `model`: the units holding its parameters (tied ones included), except those whose
    unit module it contains, in unit order.
    """
    unit_of = param_index(units)
    out = []
    for module in model.modules():
        if module is model:
            continue
        inside = {id(m) for m in module.modules()}
        needed: dict[int, ParamUnit] = {}
        for _, param in module.named_parameters(remove_duplicate=False):
            unit = unit_of.get(id(param))
            if unit is not None and id(unit.module) not in inside:
                needed[unit.index] = unit
        if needed:
            out.append((module, [needed[i] for i in sorted(needed)]))
    return out


def register_entry_hooks(model: nn.Module, units: list[ParamUnit], scheduler: UnitScheduler) -> list[RemovableHandle]:
    """Lets any sub-module be called on its own (after `register_unit_hooks`, so a unit module runs both, entry first)."""
    handles = []
    in_units = {id(m) for unit in units[:-1] for m in unit.module.modules()}
    for module, needed in entry_units(model, units):
        entry = _Entry(needed, scheduler, always_called=id(module) not in in_units)
        handles.append(module.register_forward_pre_hook(entry.pre, prepend=True))
        # `always_call` keeps the scheduler consistent when a forward raises, but makes every call of the module
        # several times slower. Modules inside a unit run nested in its forward nearly always, where the entry
        # does nothing, so they go without: after an exception in one called alone, its unit stays marked in use
        # until the model's next forward (whose start resets that); `UnitScheduler.enter` gathers it again if it
        # was released meanwhile.
        handles.append(module.register_forward_hook(entry.post, always_call=entry.always_called))
    return handles


class _Entry:
    """The pre- and post-forward hooks of one sub-module: a stack, since the module may run inside itself."""

    def __init__(self, needed: list[ParamUnit], scheduler: UnitScheduler, always_called: bool) -> None:
        self.needed, self.scheduler, self.always_called = needed, scheduler, always_called
        self.frames: list[tuple[list[ParamUnit], bool]] = []

    def pre(self, module: nn.Module, args: Any) -> None:
        # Nearly every call is nested in a forward that holds the units already: that path must stay cheap. Traced
        # by dynamo, the call is nested in a compiled unit's forward ([Note: compiling around ZeRO's hooks]).
        if tracing():
            return
        if self.scheduler.in_use(self.needed):
            self.frames.append(_NESTED)
            return
        with torch.profiler.record_function("ZeRO::pre_forward_entry"):
            self.frames.append(self.scheduler.enter(id(module), self.needed, record_external=self.always_called))

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        if tracing() or not self.frames:
            return  # the pre-hook raised before it entered anything
        entered, began = self.frames.pop()
        if not entered:
            return
        with torch.profiler.record_function("ZeRO::post_forward_entry"):
            if torch.is_grad_enabled():
                for unit in entered:
                    _register_pre_backward(output, unit, self.scheduler)
            self.scheduler.leave(entered, began)


_NESTED: tuple[list[ParamUnit], bool] = ([], False)


def _register_pre_backward(output: Any, unit: ParamUnit, scheduler: UnitScheduler) -> None:
    pre_backward = _PreBackward(unit, scheduler)
    for tensor in _tensors(output):
        if tensor.requires_grad:
            tensor.register_hook(pre_backward)


class _PreForward:
    def __init__(self, unit: ParamUnit, scheduler: UnitScheduler) -> None:
        self.unit, self.scheduler = unit, scheduler

    @outside_compile
    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        with torch.profiler.record_function("ZeRO::pre_forward"):
            self.scheduler.pre_forward(self.unit)
            if self.unit.has_frozen and torch.is_grad_enabled():
                _report_input_grads(self.unit, self.scheduler, [*args, *kwargs.values()])


def _report_input_grads(unit: ParamUnit, scheduler: UnitScheduler, inputs: list[Any]) -> None:
    """Hooks the call's inputs that need a gradient: once backward computed them all, the unit's backward is over
    ([Note: release after backward]). A tensor hook, not an autograd function around the inputs, so that the
    forward may still modify its inputs in place."""
    tensors = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
    if tensors and scheduler.expects_input_grads(unit, len(tensors)):
        done = _InputGradDone(unit, scheduler)
        for tensor in tensors:
            tensor.register_hook(done)


class _InputGradDone:
    """A tensor hook on one input of a unit's forward call."""

    def __init__(self, unit: ParamUnit, scheduler: UnitScheduler) -> None:
        self.unit, self.scheduler = unit, scheduler

    @outside_compile
    def __call__(self, grad: torch.Tensor) -> None:
        with torch.profiler.record_function("ZeRO::post_backward"):
            self.scheduler.input_grads_done(self.unit)


class _PostForward:
    def __init__(self, unit: ParamUnit, scheduler: UnitScheduler) -> None:
        self.unit, self.scheduler = unit, scheduler

    @outside_compile
    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        with torch.profiler.record_function("ZeRO::post_forward"):
            if torch.is_grad_enabled():
                _register_pre_backward(output, self.unit, self.scheduler)
            self.scheduler.post_forward(self.unit)


class _PreBackward:
    """Runs when the gradient of one of the unit's outputs is computed, i.e. before the unit's own backward."""

    def __init__(self, unit: ParamUnit, scheduler: UnitScheduler) -> None:
        self.unit, self.scheduler = unit, scheduler

    @outside_compile
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
