"""DeepSpeed 0.19.8's `"optimizer": {"type": "Muon", "params": {...}}` block, built from torch's optimizers.

[Note: DeepSpeed's Muon block]
DeepSpeed tags each parameter when the engine is built (`deepspeed.set_optimizer_flags`): Muon for a parameter of 2
or more dimensions whose name contains neither "embed" nor "lm_head" (the hidden matrices), Adam for the rest
(embeddings, the head, norms, biases). Its `MuonWithAuxAdam` then steps the two halves with one param group each,
filled from the block's keys, most specific last:
- the Muon half: `lr` (default 0.02), `muon_lr` over it, `momentum` (0.95), `weight_decay` (0), `ns_method` ("gram");
- the Adam half: `lr` (default 3e-4), `adam_lr` over it, `betas` ((0.9, 0.95)), `eps` (1e-10), `weight_decay` (0);
  decoupled weight decay unless `adam_w_mode: false` (then L2, torch's Adam);
- `torch_adam` and `fp32_optimizer_states` choose DeepSpeed's Adam kernel (torch's is always used here, its states
  fp32); `per_head_muon` orthogonalises attention heads apart.
Here the same split and values build an `OptimizerChain` of `torch.optim.Muon` (Nesterov momentum, the quintic
Newton-Schulz iteration, the update scaled by sqrt(max(1, rows / cols)): DeepSpeed's arithmetic; its momentum is an
exponential average, torch's a sum, which differ by a factor the orthogonalisation divides out) and `torch.optim.AdamW`
(or `Adam`). `ns_method: gram` is DeepSpeed's faster formulation of the same iteration (its docstring: mathematically
equivalent); torch runs the standard one for both values. A parameter of 3 or more dimensions, which DeepSpeed would
flatten into a matrix, is refused by name (torch's Muon takes matrices), as is `per_head_muon: true`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from accelerate_zero.optim.chain import chain_or_single


MUON_TYPE = "muon"

_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0}
_ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
_NUMBERS = ("lr", "muon_lr", "adam_lr", "momentum", "weight_decay", "eps")
_FLAGS = ("adam_w_mode", "torch_adam", "fp32_optimizer_states", "per_head_muon")
ACCEPTED_KEYS = (*_NUMBERS, "betas", "ns_method", *_FLAGS)
"""The block's keys DeepSpeed 0.19.8 reads for type Muon."""
_NS_METHODS = ("gram", "standard")


def is_muon_block(type_name: str) -> bool:
    return isinstance(type_name, str) and type_name.lower() == MUON_TYPE


def muon_block_errors(params: Mapping[str, Any]) -> list[str]:
    """One message per problem in a Muon block's `params` ("auto" values are not checked)."""
    errors = []
    for key in sorted(params):
        value = params[key]
        if isinstance(value, str) and value == "auto":
            continue
        if key not in ACCEPTED_KEYS:
            errors.append(
                f"optimizer.params.{key} is not a key of DeepSpeed's Muon block. Accepted: {', '.join(ACCEPTED_KEYS)}."
            )
        elif key in _NUMBERS and (isinstance(value, bool) or not isinstance(value, (int, float))):
            errors.append(f"optimizer.params.{key} must be a number, got {value!r}")
        elif key in _FLAGS and not isinstance(value, bool):
            errors.append(f"optimizer.params.{key} must be true or false, got {value!r}")
        elif key == "betas" and not (isinstance(value, (list, tuple)) and len(value) == 2):
            errors.append(f"optimizer.params.betas must be a list of 2 numbers, got {value!r}")
        elif key == "ns_method" and value not in _NS_METHODS:
            errors.append(f"optimizer.params.ns_method must be one of {', '.join(_NS_METHODS)}, got {value!r}")
    if params.get("per_head_muon") is True:
        errors.append(
            "optimizer.params.per_head_muon=true: per-head orthogonalisation is not available (torch.optim.Muon "
            "orthogonalises each matrix whole); remove the key"
        )
    if params.get("fp32_optimizer_states") is False:
        errors.append(
            "optimizer.params.fp32_optimizer_states=false: the Adam states are always fp32 here (torch's AdamW); "
            "remove the key"
        )
    if "max_grad_norm" in params:
        errors.append("optimizer.params.max_grad_norm: use the top-level gradient_clipping instead")
    return errors


def _autos(params: Mapping[str, Any]) -> list[str]:
    return [key for key, value in params.items() if isinstance(value, str) and value == "auto"]


def takes_muon(name: str, param: nn.Parameter) -> bool:
    """DeepSpeed's rule: Muon for a parameter of 2+ dimensions whose name has neither "embed" nor "lm_head"."""
    return param.ndim >= 2 and not any(keyword in name.lower() for keyword in ("embed", "lm_head"))


def build_muon_with_adam(module: nn.Module, params: Mapping[str, Any]) -> torch.optim.Optimizer:
    """torch's Muon over the hidden matrices and AdamW (Adam) over the rest, as DeepSpeed's Muon block
    ([Note: DeepSpeed's Muon block]); one optimizer when a half is empty.

    Raises:
        ValueError: the block has problems (all listed), or a trainable parameter DeepSpeed would give Muon is not a
            matrix (named).
    """
    errors = muon_block_errors(params)
    errors += [f"optimizer.params.{key} is still 'auto': resolve the config first" for key in _autos(params)]
    if errors:
        raise ValueError("Invalid optimizer block (type Muon):\n- " + "\n- ".join(errors))
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if takes_muon(n, p)]
    rest = [p for n, p in named if not takes_muon(n, p)]
    wide = [f"{n} {tuple(p.shape)}" for n, p in named if takes_muon(n, p) and p.ndim > 2]
    if wide:
        raise ValueError(
            f"DeepSpeed's Muon block gives these parameters of 3+ dimensions to Muon, which torch.optim.Muon cannot "
            f"step (it takes matrices): {', '.join(wide[:5])}; build OptimizerChain(torch.optim.Muon(...), "
            "torch.optim.AdamW(...)) yourself with those in AdamW"
        )
    muon = {**_DEFAULTS, **{k: params[k] for k in ("lr", "momentum", "weight_decay") if k in params}}
    muon["lr"] = params.get("muon_lr", muon["lr"])
    adam = {**_ADAM_DEFAULTS, **{k: params[k] for k in ("lr", "betas", "eps", "weight_decay") if k in params}}
    adam["lr"] = params.get("adam_lr", adam["lr"])
    adam["betas"] = tuple(adam["betas"])
    optimizers: list[torch.optim.Optimizer] = []
    if hidden:
        optimizers.append(torch.optim.Muon(hidden, nesterov=True, adjust_lr_fn="original", **muon))
    if rest:
        adam_class = torch.optim.AdamW if params.get("adam_w_mode", True) else torch.optim.Adam
        optimizers.append(adam_class(rest, **adam))
    if not optimizers:
        raise ValueError("no trainable parameters for the Muon block: set requires_grad on the ones to train")
    return chain_or_single(optimizers)
