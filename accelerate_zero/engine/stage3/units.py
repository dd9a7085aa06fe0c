"""Which parameters are gathered together (gather units) and which stay whole (persistent).

A unit is a module whose parameters are all-gathered before its forward and released after it:
- a transformers model: every module whose class is in `model._no_split_modules` (the decoder layers), and its
  input and output embeddings ([Note: embeddings are units of their own]);
- otherwise the root's children, looking through containers (ModuleList, Sequential, ModuleDict);
- or the module classes the caller names.
The parameters no unit owns form the root unit, gathered for the whole forward of the model, which keeps
embeddings, final norms and a tied LM head correct even when they are used outside their own module's forward;
a sub-module called on its own (`model.model(...)`, `get_encoder()(...)`) gathers it too ([Note: sub-module
calls] in schedule.py).
A parameter shared by modules of two units also goes to the root unit.

Parameters with at most `stage3_param_persistence_threshold` elements are not partitioned (DeepSpeed's
persistent parameters); non-floating-point parameters (a quantized base) are left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)

# [Note: embeddings are units of their own]
# In a transformers model the input embeddings and the LM head are often most of the parameters no decoder layer
# holds (a vocabulary of 32k-150k rows). Left in the root unit they would be gathered together at the start of
# every forward, with nothing to hide the gather behind, and kept for the whole forward: measured on a 33M Llama
# (untied, 2 ranks), the root's gather was 60% of all the time forward waited for parameters. As units of their
# own, the input embeddings are the first gather of a forward (half the size) and the LM head is prefetched behind
# the last decoder layer, as torchtitan shards them separately under FSDP2 and DeepSpeed fetches them per module.
# Tied embeddings share one weight between two modules, so `layout_units` keeps that weight in the root unit as
# before; a weight read outside its module's forward is found by stage3/external.py like any other.


@dataclass
class UnitSpec:
    """The parameters one gather unit owns."""

    name: str
    """The unit module's qualified name ("" for the root)."""
    module: nn.Module
    trainable: list[nn.Parameter] = field(default_factory=list)
    frozen: list[nn.Parameter] = field(default_factory=list)

    def numel(self, numel_of: Callable[[nn.Parameter], int] = torch.numel) -> int:
        return sum(numel_of(p) for p in (*self.trainable, *self.frozen))


@dataclass
class UnitLayout:
    units: list[UnitSpec]
    """In module registration order; the root unit (possibly empty) is last."""
    persistent: list[nn.Parameter]
    """Small floating-point parameters kept whole on every rank."""
    excluded: list[nn.Parameter] = field(default_factory=list)
    """Parameters another partition holds (a split layer's experts: engine/experts/partition.py)."""


def find_unit_modules(
    model: nn.Module,
    unit_classes: Sequence[type[nn.Module] | str] | None = None,
    extra_leaf: Sequence[str] = (),
) -> list[str]:
    """Qualified names of the modules that become gather units (see the module docstring).

    Args:
        unit_classes: classes or class names; default `model._no_split_modules`, else the root's children.
        extra_leaf: `zero_optimization.leaf_module` class names and module names that must be fetched as one
            unit (MoE blocks); they become units unless a unit already contains them.
    """
    wanted = unit_classes if unit_classes is not None else getattr(model, "_no_split_modules", None)
    if wanted:
        names = {c if isinstance(c, str) else c.__name__ for c in wanted}
        found = [name for name, module in model.named_modules() if name and type(module).__name__ in names]
        if unit_classes is None:
            found += [name for name in _embedding_modules(model) if name not in found]
    else:
        found = _container_children(model, "")
    leaves = set(extra_leaf)
    found += [
        n for n, m in model.named_modules() if n and (type(m).__name__ in leaves or n in leaves) and n not in found
    ]
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    return _outermost(sorted(found, key=order.__getitem__))


def _embedding_modules(model: nn.Module) -> list[str]:
    """Qualified names of a transformers model's input and output embedding modules ([Note: embeddings are units of
    their own]); none for a model without them."""
    found = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError):  # not a transformers model, or one without that embedding
            continue
        if not isinstance(module, nn.Module):
            continue
        found += [name for name, m in model.named_modules() if m is module and name]
    return found


def _container_children(module: nn.Module, prefix: str) -> list[str]:
    names = []
    for name, child in module.named_children():
        qualified = f"{prefix}{name}"
        if isinstance(child, _CONTAINERS):
            names += _container_children(child, qualified + ".")
        elif any(True for _ in child.parameters()):
            names.append(qualified)
    return names


def _outermost(names: list[str]) -> list[str]:
    kept: list[str] = []
    for name in sorted(names, key=len):
        if not any(name.startswith(parent + ".") for parent in kept):
            kept.append(name)
    return [n for n in names if n in kept]


def layout_units(
    model: nn.Module,
    unit_names: list[str],
    persistence_threshold: int,
    model_persistence_threshold: int,
    numel_of: Callable[[nn.Parameter], int] = torch.numel,
    exclude: Sequence[nn.Parameter] = (),
) -> UnitLayout:
    """Assigns every floating-point parameter to a unit, the root unit, or the persistent set.

    Persistent parameters are the smallest ones first, as long as their total stays within
    `model_persistence_threshold` elements (`stage3_model_persistence_threshold`). `numel_of` gives a parameter's
    real size (a partitioned parameter's own `.numel()` is 0). `exclude`: parameters left to another partition.
    """
    owners: dict[nn.Parameter, set[str]] = {}
    excluded = {id(p) for p in exclude}
    for param_name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in excluded:
            owners.setdefault(param, set()).add(_owning_unit(param_name, unit_names))
    specs = {name: UnitSpec(name=name, module=model.get_submodule(name)) for name in unit_names}
    root = UnitSpec(name="", module=model)
    small = sorted((p for p in owners if p.is_floating_point() and numel_of(p) <= persistence_threshold), key=numel_of)
    persistent, total = [], 0
    for param in small:
        if total + numel_of(param) > model_persistence_threshold:
            break
        persistent.append(param)
        total += numel_of(param)
    kept = set(persistent)
    for param, units in owners.items():
        if not param.is_floating_point() or param in kept:
            continue
        spec = specs[next(iter(units))] if len(units) == 1 and "" not in units else root
        (spec.trainable if param.requires_grad else spec.frozen).append(param)
    # The root unit is always there, even empty: its hooks mark where each forward starts and ends.
    units = [spec for spec in specs.values() if spec.numel(numel_of) > 0] + [root]
    return UnitLayout(units=units, persistent=persistent, excluded=list(exclude))


def _owning_unit(param_name: str, unit_names: list[str]) -> str:
    for unit in unit_names:
        if param_name.startswith(unit + "."):
            return unit
    return ""
