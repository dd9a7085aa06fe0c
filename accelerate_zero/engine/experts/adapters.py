"""peft LoRA on split experts: the adapters stay whole, each rank applies the rows of its own experts.

[Note: LoRA on split experts]
peft targets a fused experts parameter directly (`LoraConfig(target_parameters=["mlp.experts.gate_up_proj", ...])`)
with a `ParamWrapper` around the experts module. Its factors hold every expert of the layer (`lora_A`:
`[r * E, in]`, expert-major; `lora_B`: `[out, r * E]`, expert-minor), and during the wrapper's forward it
parametrizes the experts' parameter as `W + scaling * lhs @ rhs` with `lhs`/`rhs` `[E, ...]`: against a split
`W` (`E / ep` experts) that add fails inside peft. The factors are small (`r * E * (in + out)` against the experts'
`E * in * out`), so they are not split: every rank keeps them whole, as dense parameters the engine partitions over
all W ranks like any other adapter, and each wrapper of a split layer computes only its rank's `E / ep` experts'
rows of the update (`lhs[start:stop] @ rhs[start:stop]`, never the whole layer's update). Autograd then gives
each rank a whole-shaped gradient that is zero outside its experts' rows; summed over all W ranks and divided by W
(the dense reduction) that is the one-process gradient, since each expert's rows get their tokens' gradient on
exactly one rank of each expert group ([Note: gradients of split experts] in engine/experts/parallel.py). Because
the adapters are whole, `save_pretrained` writes the adapter an unsplit model loads, checkpoints need nothing
new, and the weight stream merges the whole layer's update into the whole experts (`whole_delta_weight`).

The wrapper keeps its class's behaviour except for the range: it becomes an instance of a subclass made here
(the subclass of its own class, so peft's isinstance checks and its merge/unmerge still hold) whose delta methods
cut the expert range. Any other peft layer on a split experts module (a tuner with another merge rule) is refused
by name when the experts are split.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


def localize_adapters(model: nn.Module, experts: nn.Module, name: str, start: int, stop: int) -> list[nn.Module]:
    """Makes every peft layer wrapping `experts` (the layer `name`) apply the experts [start, stop) only ([Note: LoRA
    on split experts]); returns those wrappers.

    Raises:
        NotImplementedError: a peft layer on `experts` that is not LoRA on its parameters (named).
    """
    try:
        from peft.tuners.lora import ParamWrapper
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    found = []
    for wrapper_name, wrapper in model.named_modules():
        if not isinstance(wrapper, BaseTunerLayer) or wrapper.get_base_layer() is not experts:
            continue
        if not isinstance(wrapper, ParamWrapper):
            raise NotImplementedError(
                f"expert_parallel: {wrapper_name} is a peft {type(wrapper).__name__} on the split experts of {name}; "
                "only LoRA on their parameters (LoraConfig(target_parameters=[...])) is applied per expert range. "
                "Target the experts with LoRA's target_parameters, or train without expert_parallel"
            )
        if not isinstance(wrapper, _LocalExperts):
            wrapper.__class__ = _local_class(type(wrapper))
        wrapper.expert_range = (start, stop)
        found.append(wrapper)
    return found


class _LocalExperts:
    """The delta methods of a peft `ParamWrapper` cut to one rank's experts ([Note: LoRA on split experts])."""

    expert_range: tuple[int, int]

    def get_delta_factors(self, adapter_name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
        lhs, rhs, scaling = super().get_delta_factors(adapter_name)  # type: ignore[misc]
        start, stop = self.expert_range
        return lhs[start:stop], rhs[start:stop], scaling

    def get_delta_weight(self, adapter_name: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        start, stop = self.expert_range
        return self.whole_delta_weight(adapter_name, *args, **kwargs)[start:stop]

    def whole_delta_weight(self, adapter_name: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The update of every expert of the layer (the shape of the whole, unsplit parameter)."""
        return super().get_delta_weight(adapter_name, *args, **kwargs)  # type: ignore[misc]


@functools.cache
def _local_class(wrapper_class: type) -> type:
    return type(f"ExpertRange{wrapper_class.__name__}", (_LocalExperts, wrapper_class), {})
