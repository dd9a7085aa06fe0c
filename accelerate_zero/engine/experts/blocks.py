"""Mixture-of-experts layers found by structure, as transformers 5 builds them.

[Note: which expert layers are split]
transformers 5 keeps a MoE layer's experts in one module whose parameters are indexed by expert along their first
dimension, and recognises such a module by what it is, not by its class name: an int `num_experts` and either 3-D
direct parameters (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`: Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, ...)
or the experts' calling convention below (DBRX keeps its experts in a child as `[E * F, H]` matrices). Each of its
parameters, its children's included, hold `E` equal blocks of rows (`[E, ...]`, biases `[E, out]`,
`[E * F, H]`), except a child's parameters that every expert uses (a shared norm), which stay whole on every
rank like the rest of the model; each rank of an expert group keeps `E / ep` consecutive blocks of the others. How the block calls it
decides how the tokens travel ([Note: the experts' own forward on the local experts] in engine/experts/parallel.py),
read from its forward's signature:
- ROUTED, `experts(hidden_states, top_k_index, top_k_weights)` (the argument names may differ, gpt-oss's
  `router_indices, routing_weights`): one row per token, its top-k experts and weights; the experts weight and sum.
- REPLICATED, `experts(hidden_states)` (Llama-4): every token once per expert, expert-major (`[E * T, H]`), each row
  already scaled by its routing score, 0 for an expert not chosen; the block sums the experts' outputs. Only the
  rows of chosen experts travel: a zero row gives a zero output and a zero gradient when the experts hold no bias
  and their activation maps 0 to 0 (checked here), so leaving it out changes nothing.
Anything else is refused by name with its reason when the experts are split (at `initialize`): experts held as a
list or dict of modules (indexed by the block's own loop), a forward with another calling convention (JetMoE's
`(inputs, expert_size)`), a parameter that is not indexed by expert, or a module called `experts` that is none of
these (LongCat-Flash's, which counts "zero experts" beside its own); a model with no experts module at all is
refused naming the modules that count experts (Doge's retrieval experts are embeddings).
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.utils import parametrize


class Convention(enum.Enum):
    """How a MoE block calls its experts module ([Note: which expert layers are split])."""

    ROUTED = "routed"
    """`experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`."""
    REPLICATED = "replicated"
    """`experts(hidden_states [E * T, H])`, each token once per expert, pre-scaled (Llama-4)."""


_ROUTED_ARITY = 3


@dataclass(frozen=True)
class ExpertLayer:
    """One fused experts module of a model."""

    name: str
    """Its qualified name in the model."""
    module: nn.Module
    num_experts: int
    """Experts in the whole layer (before any split)."""
    param_names: tuple[str, ...]
    """Its parameters (children's included, dotted), each with `num_experts` equal blocks of rows."""
    convention: Convention = Convention.ROUTED
    inputs: tuple[str, ...] = ("hidden_states", "top_k_index", "top_k_weights")
    """Its forward's argument names, in order."""
    shared_names: tuple[str, ...] = ()
    """Parameters of its children that every expert uses (MuseSpark's post-expert norm): whole on every rank,
    trained as the rest of the model is."""

    def params(self) -> list[nn.Parameter]:
        """The parameters themselves (a peft LoRA wrapper's parametrization, active during its forward, read
        through to the parameter it adapts)."""
        out = []
        for name in self.param_names:
            owner_name, _, leaf = name.rpartition(".")
            owner = self.module.get_submodule(owner_name)
            if parametrize.is_parametrized(owner, leaf):
                out.append(owner.parametrizations[leaf].original)
            else:
                out.append(owner.get_parameter(leaf))
        return out


def find_expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """The fused experts modules of `model`, in module order ([Note: which expert layers are split]).

    Raises:
        NotImplementedError: a layer of experts held as a list or dict of modules, called another way, or with
            parameters that are not indexed by expert (named, with the reason).
    """
    found: list[ExpertLayer] = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and name.rsplit(".", 1)[-1] == "experts":
            kind = "list" if isinstance(module, nn.ModuleList) else "dict"
            raise NotImplementedError(
                f"expert parallelism: {name} ({type(module).__name__}) holds its experts as a {kind} of {len(module)} "
                "modules, which the layer's own loop indexes; only fused experts (parameters indexed by expert, "
                "transformers 5's layout) are split. Train this model without expert_parallel"
            )
        if any(name.startswith(f"{layer.name}.") for layer in found) or not _is_experts(module):
            continue
        found.append(_layer(name, module))
    for name, module in model.named_modules():
        unsplit = name.rsplit(".", 1)[-1] == "experts" and next(module.parameters(), None) is not None
        if unsplit and not any(f"{layer.name}.".startswith(f"{name}.") for layer in found):
            raise NotImplementedError(
                f"expert parallelism: {name} ({type(module).__name__}) holds experts but is not a fused experts "
                "module this engine splits (an int `num_experts` and parameters indexed by expert, called with "
                "(hidden_states, top_k_index, top_k_weights)); its layer would stay whole on every rank. Train this "
                "model without expert_parallel"
            )
    return found


def counts_experts(model: nn.Module) -> list[str]:
    """Modules that count experts (an int `num_experts` above 1), for a refusal that names them."""
    return [
        f"{name} ({type(module).__name__}, num_experts={module.num_experts})"
        for name, module in model.named_modules()
        if isinstance(getattr(module, "num_experts", None), int) and module.num_experts > 1
    ]


def _is_experts(module: nn.Module) -> bool:
    num_experts = getattr(module, "num_experts", None)
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        return False  # a router counts experts too, but holds [E, H] matrices and is called with the tokens only
    direct = module.parameters(recurse=False)
    return any(p.dim() == 3 for p in direct) or len(_inputs(module)) == _ROUTED_ARITY and _routed_names(module)


def _inputs(module: nn.Module) -> tuple[str, ...]:
    try:
        signature = inspect.signature(module.forward)  # follows transformers' @wraps to the experts' own forward
    except (TypeError, ValueError):
        return ()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind not in kinds for p in signature.parameters.values()):
        return ()  # *args / **kwargs: not an experts forward this file can read
    return tuple(signature.parameters)


def _routed_names(module: nn.Module) -> bool:
    index, weights = _inputs(module)[1:]
    return ("index" in index or "indices" in index) and "weight" in weights


def _layer(name: str, module: nn.Module) -> ExpertLayer:
    num_experts = module.num_experts
    params = dict(module.named_parameters())
    split = {n: p for n, p in params.items() if _indexed_by_expert(p, num_experts, params.values())}
    shared = tuple(n for n in params if n not in split)
    if not split or any("." not in n for n in shared):
        raise NotImplementedError(
            f"expert parallelism: {name} ({type(module).__name__}, num_experts={num_experts}) holds parameters that "
            f"are not indexed by expert: {list(shared)}; it has no single split. Train this model without "
            "expert_parallel"
        )
    inputs = _inputs(module)
    if len(inputs) == _ROUTED_ARITY and _routed_names(module):
        return ExpertLayer(name, module, num_experts, tuple(split), Convention.ROUTED, inputs, shared)
    if len(inputs) == 1:
        _check_zero_rows(name, module, params)
        return ExpertLayer(name, module, num_experts, tuple(split), Convention.REPLICATED, inputs, shared)
    raise NotImplementedError(
        f"expert parallelism: {name} ({type(module).__name__}) is called as forward{inputs or '(...)'}; split "
        "experts run when called with (hidden_states, top_k_index, top_k_weights) as transformers 5's experts "
        "are, or with every token once per expert as Llama-4's are. Train this model without expert_parallel"
    )


def _indexed_by_expert(param: nn.Parameter, num_experts: int, every: object) -> bool:
    """`[E, ...]` (weights, biases), or DBRX's `[E * F, H]` in a module holding no 3-D parameter at all."""
    if param.dim() < 2:
        return False
    if any(p.dim() == 3 for p in every):
        return param.shape[0] == num_experts
    return param.dim() == 2 and param.shape[0] % num_experts == 0


def _check_zero_rows(name: str, module: nn.Module, params: dict[str, nn.Parameter]) -> None:
    """A REPLICATED layer leaves out the rows of experts not chosen: exact only when a zero row maps to zero."""
    activation = getattr(module, "act_fn", None)
    zero_in_zero_out = callable(activation) and all(p.dim() == 3 for p in params.values())
    if zero_in_zero_out:
        with torch.no_grad():
            zero_in_zero_out = bool((activation(torch.zeros(2)) == 0).all())
    if not zero_in_zero_out:
        raise NotImplementedError(
            f"expert parallelism: {name} ({type(module).__name__}) is called with every token once per expert; its "
            "experts are split only when a zero row gives a zero output (3-D weights without bias, an activation "
            "with f(0) = 0), so that the rows of experts a token did not choose need not travel. Train this model "
            "without expert_parallel"
        )
