"""peft adapters merged into their base weights on the fly, for the weight stream (engine/full_weights.py).

[Note: merging every adapter kind peft has]
A generator built from the base checkpoint expects the base model's names and the merged weights: what peft's
`merge_and_unload()` would give, without merging into the training weights (that would change them by rounding)
and without gathering the whole model. Each peft tuner layer wrapping a base parameter is read here, by kind:
- LoRA on a linear, an embedding (its factors live in `lora_embedding_A/B`, not `lora_A/B`), a convolution, or on a
  parameter targeted directly (`target_parameters`, e.g. fused MoE experts: a `ParamWrapper`): the base weight plus
  each active adapter's `get_delta_weight`, summed in fp32.
- Trainable tokens (`trainable_token_indices`): the base embedding with the trained rows copied over.
- Anything else (DoRA, IA3, LoHa, LoKr, VeRA, OFT, ...: a different merge rule) is refused by name when the stream
  starts, never passed through unmerged: pass `merge_lora=False` and merge on the receiving side.
The adapters' own tensors are not streamed; the base model's names drop peft's prefixes (`base_model.model.`,
`.base_layer`, `.token_adapter`, `modules_to_save.<adapter>.`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn


Merge = Callable[[torch.Tensor], torch.Tensor]
"""The full base weight in, a new tensor holding the merged weight out (the input is never written)."""

_ADAPTER_COPY = re.compile(r"modules_to_save\.[^.]+\.")
_ADAPTER_TENSORS = (".lora_", "original_module", "trainable_tokens_delta")


def stream_name(name: str) -> str | None:
    """The base model's name of a peft model's parameter; None for an adapter's own tensor (merged, not streamed)."""
    if any(part in name for part in _ADAPTER_TENSORS):
        return None
    name = name.removeprefix("base_model.model.").replace(".base_layer", "").replace(".token_adapter", "")
    return _ADAPTER_COPY.sub("", name)


def adapter_merges(module: nn.Module) -> dict[int, Merge]:
    """id(base parameter) -> how its merged weight is made, for every peft tuner layer of `module` with an active
    adapter ([Note: merging every adapter kind peft has]). Empty without peft.

    Raises:
        NotImplementedError: a tuner layer whose merge is not a sum of deltas or a row copy (named).
    """
    try:
        from peft.tuners.lora import LoraLayer, ParamWrapper
        from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return {}
    found: dict[int, Merge] = {}
    for name, layer in module.named_modules():
        if not isinstance(layer, BaseTunerLayer) or getattr(layer, "merged", False) or layer.disable_adapters:
            continue
        if isinstance(layer, TrainableTokensLayer):
            found.setdefault(id(layer.get_base_layer().weight), _token_rows(layer))
        elif isinstance(layer, LoraLayer) and not _uses_variant(layer) and not _is_attention(layer):
            base = layer.get_param() if isinstance(layer, ParamWrapper) else layer.get_base_layer().weight
            found.setdefault(id(base), _lora_delta(layer))
        else:
            kind = f"{type(layer).__module__.removeprefix('peft.tuners.').split('.')[0]}.{type(layer).__name__}"
            raise NotImplementedError(
                f"named_full_parameters(merge_lora=True): {name} is a peft {kind} layer, whose merge "
                "is not computed on the fly here (LoRA and trainable tokens are); pass merge_lora=False and merge on "
                "the receiving side"
            )
    return found


def _uses_variant(layer: nn.Module) -> bool:
    """DoRA (and peft's other LoRA variants) rescale the merged weight: not a plain delta."""
    variants = getattr(layer, "lora_variant", {}) or {}
    dora = getattr(layer, "use_dora", {}) or {}
    return any(adapter in variants or dora.get(adapter, False) for adapter in layer.active_adapters)


def _is_attention(layer: nn.Module) -> bool:
    """peft's LoRA on nn.MultiheadAttention merges into two weights (in- and out-projection): not one delta."""
    return isinstance(layer.get_base_layer(), nn.MultiheadAttention)


def _lora_delta(layer: nn.Module) -> Merge:
    # A split layer's experts are merged whole ([Note: LoRA on split experts] in engine/experts/adapters.py).
    delta_of = getattr(layer, "whole_delta_weight", layer.get_delta_weight)

    def merge(base: torch.Tensor) -> torch.Tensor:
        merged = base.to(torch.float32, copy=True)  # never an alias of the gathered weight (fp32 training)
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A or adapter in layer.lora_embedding_A:
                merged += delta_of(adapter).float().to(merged.device)
        return merged.to(base.dtype)

    return merge


def _token_rows(layer: nn.Module) -> Merge:
    def merge(base: torch.Tensor) -> torch.Tensor:
        merged = base.clone()
        for adapter in layer.active_adapters:
            if adapter in layer.trainable_tokens_delta:
                rows = torch.tensor(layer.token_indices[adapter], device=merged.device)
                merged.index_copy_(0, rows, layer.trainable_tokens_delta[adapter].to(merged))
        return merged

    return merge
