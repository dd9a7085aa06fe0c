"""bitsandbytes' per-parameter overrides, carried from the model's parameters to the tensors the engine steps.

bitsandbytes keeps overrides of an optimizer's settings (`optim_bits`, `lr`, ...) in one process-wide manager, keyed
by the parameter's `id`, by its (group, position) in the optimizer, or by (module, attribute): the Trainer registers
every `nn.Embedding` weight for 32-bit state under `optim="adamw_8bit"`, as bitsandbytes recommends. The engine steps
other tensors than the model's parameters (masters, optim/kinds.py and engine/owned_step.py) at other positions, so
every override this optimizer's parameters have is restated for the master that stands for each, before the first
step; positional entries of the original groups are dropped (they would name other tensors now). Without this an
embedding trained in 32 bits in one process would be trained in 8 bits under the engine.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from accelerate_zero.optim.chain import optimizers_in


def carry_overrides(
    optimizer: torch.optim.Optimizer, original_groups: list[list[torch.Tensor]], master_of: dict[int, torch.Tensor]
) -> None:
    """Restates bitsandbytes' overrides of the parameters in `original_groups` (each param group's parameters
    before the engine switched them) for their masters (`master_of`: id(parameter) -> master on this rank). Nothing
    when bitsandbytes is not imported or the optimizer is not one of its 8-bit ones."""
    bnb = sys.modules.get("bitsandbytes.optim.optimizer")
    if bnb is None or not any(isinstance(o, bnb.Optimizer8bit) for o in optimizers_in(optimizer)):
        return
    manager = bnb.GlobalOptimManager.get_instance()
    by_param: dict[int, dict[str, Any]] = {}
    for (group, index), config in list(manager.index2config.items()):
        if group < len(original_groups) and index < len(original_groups[group]):
            by_param.setdefault(id(original_groups[group][index]), {}).update(config)
            del manager.index2config[(group, index)]
    for module, attribute, config in manager.module_weight_config_triple:
        by_param.setdefault(id(getattr(module, attribute)), {}).update(config)
    for params in original_groups:
        for param in params:
            by_param.setdefault(id(param), {}).update(manager.pid2config.get(id(param), {}))
    for key, config in by_param.items():
        master = master_of.get(key)
        if master is not None and config:
            manager.pid2config[id(master)] = dict(config)
