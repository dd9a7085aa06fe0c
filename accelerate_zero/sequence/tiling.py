"""Tiled MLP and tiled logits + loss: the sequence x intermediate and sequence x vocabulary tensors are never whole.

[Note: tiling along the sequence]
A decoder's MLP and its LM head are position-wise: token t's output depends on token t's input alone. So they can
run on tiles of `tile_tokens` positions, each tile under activation checkpointing: forward keeps only each tile's
input (already held by the layer anyway) and backward recomputes one tile at a time. The live intermediate then
is tile x intermediate instead of sequence x intermediate (3.5x the hidden size in Llama), and the logits tile x
vocabulary instead of sequence x vocabulary, plus their fp32 copy and softmax for the loss, which at 32K tokens
and a 128K vocabulary is 16 GB per copy in fp32. The loss is summed tile by tile and divided by the count of valid
tokens (`num_items`): the same value as the whole sequence's mean.

`tile_mlp(model, tile_tokens)` gives each decoder layer's MLP a tiled forward of its own instance (the module, its
parameters and their names are unchanged; nothing of transformers is patched); `tiled_causal_lm_loss` runs the
base model, then the head and the loss in tiles. Under ZeRO-3 the recomputation in backward runs inside the layer's
backward, where its unit is gathered; the LM head is a sub-module call, gathered by its entry hook
([Note: sub-module calls] in engine/stage3/schedule.py), once for all tiles ([Note: one head call for every tile]).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from accelerate_zero.sequence.loader import IGNORE_INDEX


def _tiles(length: int, tile_tokens: int) -> list[slice]:
    return [slice(start, min(start + tile_tokens, length)) for start in range(0, length, tile_tokens)]


def tile_mlp(model: torch.nn.Module, tile_tokens: int) -> int:
    """Makes every decoder layer's `mlp` run in tiles of `tile_tokens` positions ([Note: tiling along the
    sequence]); returns how many MLPs were tiled.

    Raises:
        ValueError: `tile_tokens` < 1, or the model has no decoder layers with an `mlp`.
    """
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens}: must be at least 1")
    mlps = [layer.mlp for layer in _decoder_layers(model) if isinstance(getattr(layer, "mlp", None), torch.nn.Module)]
    if not mlps:
        raise ValueError(f"{type(model).__name__} has no decoder layers with an `mlp` to tile")
    for mlp in mlps:
        whole = type(mlp).forward.__get__(mlp)  # the class's forward, bound: a second call does not nest

        def tiled_forward(
            self: torch.nn.Module, hidden: torch.Tensor, *args: Any, _whole: Any = whole
        ) -> torch.Tensor:
            if hidden.dim() < 3 or hidden.shape[1] <= tile_tokens or not torch.is_grad_enabled():
                return _whole(hidden, *args)
            parts = [
                checkpoint(_whole, hidden[:, piece], *args, use_reentrant=False)
                for piece in _tiles(hidden.shape[1], tile_tokens)
            ]
            return torch.cat(parts, dim=1)

        mlp.forward = types.MethodType(tiled_forward, mlp)
    return len(mlps)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    return list(layers) if layers is not None else []


def _tile_loss(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )


# [Note: one head call for every tile]
# Called once per tile, the LM head is a new sub-module call each time: under ZeRO-3 its unit is gathered per tile
# in forward and again per tile in backward's recomputation, and each tile's backward hands the engine another
# full-size gradient of the head. Tiled runs started about 300 MB higher than untiled ones at vocabulary 32K and
# hidden 256 (bench/README.md, "long_context.py"). A linear head without bias is instead called once, with a
# forward of its own instance (as `tile_mlp` gives the MLPs; nothing of transformers is patched) that runs the
# tiles inside one autograd function: forward sums the tiles' losses without keeping their logits; backward,
# where the engine's hook on the loss has gathered the head again, recomputes each tile's logits, writes its rows
# of the hidden states' gradient, and adds its part of the weight's gradient into one float32 buffer, handed to
# autograd once: one gather per pass and one gradient per micro-step, as DeepSpeed's ALST defers the head's
# reduction to the last tile. The tiled longest sequences doubled (bench/README.md).
class _TiledLossRequest:
    """What the fused head computes instead of logits (a plain object: the engine's input cast leaves it as is)."""

    def __init__(self, labels: torch.Tensor, num_items: torch.Tensor | int, tile_tokens: int) -> None:
        self.labels, self.num_items, self.tile_tokens = labels, num_items, tile_tokens

    def apply(self, hidden: torch.Tensor, weight: torch.Tensor, head: torch.nn.Module) -> Any:
        return _FusedTiledLoss.apply(hidden, weight, head, self)


class _FusedTiledLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, head: torch.nn.Module, request: _TiledLossRequest
    ) -> torch.Tensor:
        ctx.head, ctx.tile_tokens = head, request.tile_tokens
        num_items = torch.as_tensor(request.num_items, dtype=torch.float32, device=hidden.device)
        ctx.save_for_backward(hidden, request.labels, num_items)
        total = hidden.new_zeros((), dtype=torch.float32)
        for piece in _tiles(hidden.shape[1], request.tile_tokens):
            logits = torch.nn.functional.linear(hidden[:, piece], weight).float()
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                request.labels[:, piece].reshape(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
        return total / num_items

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, labels, num_items = ctx.saved_tensors
        weight = ctx.head.weight  # gathered again by the engine's pre-backward hook on the loss
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        scale = grad.float() / num_items
        for piece in _tiles(hidden.shape[1], ctx.tile_tokens):
            h = hidden[:, piece].reshape(-1, hidden.shape[-1])
            target = labels[:, piece].reshape(-1)
            # d(sum of cross entropies)/d(logits) = softmax - one-hot, on the labelled positions
            dlogits = torch.softmax(torch.nn.functional.linear(h, weight).float(), dim=-1)
            valid = (target != IGNORE_INDEX).unsqueeze(1)
            # a scatter, not a boolean index: no device-to-host sync per tile on a GPU
            dlogits.scatter_add_(1, target.clamp(min=0).unsqueeze(1), -valid.to(dlogits.dtype))
            dlogits *= valid * scale
            grad_hidden[:, piece] = (dlogits.to(weight.dtype) @ weight).reshape(grad_hidden[:, piece].shape)
            grad_weight.addmm_(dlogits.t(), h.float())
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def _fuse_head(head: torch.nn.Module) -> bool:
    """Gives a linear head without bias a forward that also computes the tiled loss ([Note: one head call for every
    tile]); False for any other head (it then runs per tile)."""
    if getattr(head, "_accelerate_zero_fused", False):
        return True
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return False
    whole = type(head).forward.__get__(head)

    def forward(self: torch.nn.Module, hidden: torch.Tensor, tiled_loss: Any = None) -> torch.Tensor:
        if tiled_loss is None:
            return whole(hidden)
        return tiled_loss.apply(hidden, self.weight, self)  # a `_TiledLossRequest`, or sequence/tiled_values.py's

    head.forward = types.MethodType(forward, head)
    head._accelerate_zero_fused = True
    return True


def tiled_causal_lm_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    shift_labels: torch.Tensor,
    num_items: torch.Tensor | int,
    tile_tokens: int,
    **model_kwargs: Any,
) -> torch.Tensor:
    """Sum over tiles of the token losses of `model` (a transformers causal LM) on `input_ids`, divided by
    `num_items`, never holding the logits of more than `tile_tokens` positions ([Note: tiling along the sequence]).
    `shift_labels`: the token each position predicts (-100: none), as `shard_sequence` gives. A linear head runs
    once for all tiles ([Note: one head call for every tile]), any other once per tile."""
    hidden = model.get_decoder()(input_ids=input_ids, **model_kwargs).last_hidden_state
    head = model.get_output_embeddings()
    if _fuse_head(head):
        return head(hidden, tiled_loss=_TiledLossRequest(shift_labels, num_items, tile_tokens))
    total = hidden.new_zeros((), dtype=torch.float32)
    for piece in _tiles(hidden.shape[1], tile_tokens):
        # Every tile, labelled or not: under ZeRO-3 each call of the head is a collective, so every rank must make
        # as many (the same local length on every rank, as the sequence-parallel slices have).
        total = total + checkpoint(_tile_loss, head, hidden[:, piece], shift_labels[:, piece], use_reentrant=False)
    return total / num_items
