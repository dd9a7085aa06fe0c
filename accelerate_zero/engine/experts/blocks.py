"""Mixture-of-experts layers found by structure, as transformers 5 builds them.

[Note: which expert layers are split]
transformers 5 keeps a MoE layer's experts in one module whose parameters are 3-D tensors indexed by expert
(`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, biases `[E, ...]` where the model has them: Qwen3-MoE,
Mixtral, gpt-oss, OLMoE, DeepSeek-V3, ...), called as `experts(hidden_states, top_k_index, top_k_weights)` by a
block that routes first. Such a module is split: each rank of an expert group keeps `E / ep` consecutive experts
of every parameter. It is recognised by what it is, not by its class name: an int `num_experts`, 3-D direct
parameters, and every direct parameter with `num_experts` rows (a router, `[E, H]`, only counts experts). A layer whose experts are a list of modules (`nn.ModuleList` of
MLPs, indexed by the block's own loop) cannot be split without rewriting that loop, and a module with both
expert-indexed and shared parameters has no single split: both are refused by name, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ExpertLayer:
    """One fused experts module of a model."""

    name: str
    """Its qualified name in the model."""
    module: nn.Module
    num_experts: int
    """Experts in the whole layer (before any split)."""
    param_names: tuple[str, ...]
    """Its direct parameters, each with `num_experts` rows."""


def find_expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """The fused experts modules of `model`, in module order ([Note: which expert layers are split]).

    Raises:
        NotImplementedError: a layer of experts held as a list of modules, or an experts module with parameters
            that are not indexed by expert (named).
    """
    found = []
    for name, module in model.named_modules():
        direct = dict(module.named_parameters(recurse=False))
        num_experts = getattr(module, "num_experts", None)
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] == "experts":
            raise NotImplementedError(
                f"expert parallelism: {name} holds its experts as a list of {len(module)} modules, which the layer's "
                "own loop indexes; only fused experts (3-D parameters, transformers 5's layout) are split. Load the "
                "model with transformers >= 5, or train it without expert_parallel"
            )
        if not isinstance(num_experts, int) or not any(p.dim() == 3 for p in direct.values()):
            continue  # a router (2-D [E, H] weight) or anything else that only counts experts
        shared = sorted(n for n, p in direct.items() if p.dim() < 2 or p.shape[0] != num_experts)
        if shared:
            raise NotImplementedError(
                f"expert parallelism: {name} ({type(module).__name__}, num_experts={num_experts}) also holds "
                f"parameters that are not indexed by expert: {shared}; it has no single split"
            )
        found.append(ExpertLayer(name, module, num_experts, tuple(direct)))
    return found
