"""Parameters used outside their own unit's forward (e.g. `F.linear(h, self.embed.weight)` in the root).

Such a parameter's unit is "attached" to the unit whose forward uses it: gathered with it before its forward
and its backward. Attachments come from `register_external_parameter(module, param)` (DeepSpeed's API) or are
found during the first forward, the one that records the execution order: a TorchFunctionMode looks at the
parameters each torch function receives; one whose unit is not gathered is gathered on the spot and attached to
the innermost unit running. The mode is only active during that first forward, so it costs nothing afterwards;
a branch that first runs later must be registered explicitly. That forward runs eagerly even in a compiled model
([Note: compiling around ZeRO's hooks] in engine/compile_boundary.py).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from torch.overrides import TorchFunctionMode

from accelerate_zero.engine.compile_boundary import EagerWhileRecording
from accelerate_zero.engine.stage3.param_unit import ParamUnit, UnitState


logger = logging.getLogger(__name__)


REGISTERED_ATTR = "_accelerate_zero_external_parameters"
"""On a module: the parameters `register_external_parameter` declared before the engine existed (DeepSpeed's users
call it in `__init__`, e.g. transformers' Wav2Vec2); the engine attaches their units when it is built."""


def remember_registration(module: nn.Module, parameter: nn.Parameter) -> None:
    registered = module.__dict__.setdefault(REGISTERED_ATTR, [])
    if not any(parameter is known for known in registered):
        registered.append(parameter)


def attach_registered(root: nn.Module, units: list[ParamUnit]) -> None:
    """Attaches the units of the parameters registered on `root`'s modules before the engine was built."""
    unit_of = param_index(units)
    for module in root.modules():
        for parameter in module.__dict__.get(REGISTERED_ATTR, []):
            used = unit_of.get(id(parameter))
            if used is not None:
                attach(find_unit(units, module), used)


def attach(user: ParamUnit, used: ParamUnit) -> bool:
    """Records that `user`'s forward uses parameters of `used`; returns False if already known."""
    if used is user or used in user.external:
        return False
    user.external.append(used)
    return True


class ExternalUseDetector(TorchFunctionMode):
    """Gathers and attaches units whose parameters are used while their own unit is not running."""

    def __init__(self, unit_of: dict[int, ParamUnit], active: list[ParamUnit], gather: Any) -> None:
        super().__init__()
        self.unit_of, self.active, self.gather = unit_of, active, gather
        self._eager = EagerWhileRecording()

    def __enter__(self) -> ExternalUseDetector:
        self._eager.enter()  # dynamo would trace this mode's gathers ([Note: compiling around ZeRO's hooks])
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._eager.exit()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.active:
            for value in (*args, *kwargs.values()):
                if isinstance(value, nn.Parameter):
                    self._check(value)
        return func(*args, **kwargs)

    def _check(self, param: nn.Parameter) -> None:
        unit = self.unit_of.get(id(param))
        if unit is None or unit.state is UnitState.GATHERED or unit in self.active:
            return
        user = self.active[-1]
        self.gather(unit)
        if attach(user, unit):
            logger.info(
                "accelerate_zero stage 3: %s uses a parameter of %s outside its forward; they are gathered together",
                user.name or "the root module",
                unit.name or "the root module",
            )


def param_index(units: list[ParamUnit]) -> dict[int, ParamUnit]:
    return {id(p): unit for unit in units for flat in unit.flats for p in flat.params}


def find_unit(units: list[ParamUnit], module: nn.Module) -> ParamUnit:
    """The unit whose forward runs `module`: the innermost unit module containing it, else the root."""
    best, depth = units[-1], -1
    for unit in units[:-1]:
        for sub in unit.module.modules():
            if sub is module:
                found_depth = sum(1 for _ in unit.module.modules())
                if depth == -1 or found_depth < depth:
                    best, depth = unit, found_depth
    return best
