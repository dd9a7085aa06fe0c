"""Per-token values of a causal LM's next-token distribution (TRL's fused-head fields: log-probability of the label,
entropy, ...) from the LM head in tiles: the logits of more than one tile of positions never exist.

[Note: tiled per-token values]
GRPO and DPO losses read per-token log-probabilities (and GRPO's entropy bonus the entropies) rather than one summed
loss, so the head's backward needs each position's upstream gradient. A linear head without bias is called once for
all tiles, as the SFT loss's is ([Note: one head call for every tile] in sequence/tiling.py): one autograd function
computes each tile's logits, keeps only the values, and in backward recomputes each tile's logits, forms
d(value)/d(logits) (log-probability: one-hot minus softmax; entropy: -p (log p + H)), writes its rows of the hidden
states' gradient and adds its part of the weight's gradient into one float32 buffer handed to autograd once: under
ZeRO-3 one gather of the head per pass and one gradient per micro-step. Any other head runs per tile under activation
checkpointing. `log_sum_sq_probs`, `mean_logits` and `is_top1` carry no gradient (TRL reads them as metrics).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from accelerate_zero.sequence.loader import IGNORE_INDEX
from accelerate_zero.sequence.tiling import _fuse_head, _tiles


TOKEN_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
"""What `tiled_token_values` gives per position (the per-token fields of TRL's fused LM head)."""


def _tile_values(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # in place where autograd allows it (inside the fused function's forward, no graph is recorded): a tile's
    # vocabulary-wide temporaries are what a tiled step's peak is made of
    valid = labels != IGNORE_INDEX
    mean, top1 = logits.mean(-1), logits.argmax(-1) == labels
    logps = torch.log_softmax(logits, dim=-1)
    chosen = logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    if torch.is_grad_enabled():
        entropy = -(logps.exp() * logps).sum(-1)
        squares = torch.logsumexp(2 * logps, dim=-1)
    else:
        entropy = -(logps.exp().mul_(logps)).sum(-1)
        squares = torch.logsumexp(logps.mul_(2), dim=-1)
    fields = (chosen, entropy, squares, mean, top1)
    return tuple(field.masked_fill(~valid, 0) for field in fields)


def _head_tile(head: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, temperature: float) -> tuple:
    return _tile_values(head(hidden).float() / temperature, labels)


class _ValuesRequest:
    """What the fused head computes instead of logits ([Note: tiled per-token values])."""

    def __init__(self, labels: torch.Tensor, tile_tokens: int, temperature: float) -> None:
        self.labels, self.tile_tokens, self.temperature = labels, tile_tokens, temperature

    def apply(self, hidden: torch.Tensor, weight: torch.Tensor, head: torch.nn.Module) -> Any:
        return _FusedTokenValues.apply(hidden, weight, head, self)


class _FusedTokenValues(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, head: torch.nn.Module, request: _ValuesRequest
    ) -> tuple[torch.Tensor, ...]:
        ctx.head, ctx.tile_tokens, ctx.temperature = head, request.tile_tokens, request.temperature
        ctx.save_for_backward(hidden, request.labels)
        parts = []
        for piece in _tiles(hidden.shape[1], request.tile_tokens):
            logits = torch.nn.functional.linear(hidden[:, piece], weight).float().div_(request.temperature)
            parts.append(_tile_values(logits, request.labels[:, piece]))
            del logits
        out = tuple(torch.cat([part[i] for part in parts], dim=1) for i in range(len(TOKEN_FIELDS)))
        ctx.mark_non_differentiable(*out[2:])
        return out

    @staticmethod
    def backward(ctx: Any, grad_logps: torch.Tensor, grad_entropy: torch.Tensor, *_: Any) -> tuple:
        hidden, labels = ctx.saved_tensors
        weight = ctx.head.weight  # gathered again by the engine's pre-backward hook
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for piece in _tiles(hidden.shape[1], ctx.tile_tokens):
            h = hidden[:, piece].reshape(-1, hidden.shape[-1])
            target = labels[:, piece].reshape(-1)
            valid = (target != IGNORE_INDEX).unsqueeze(1).float()
            logps = torch.log_softmax(torch.nn.functional.linear(h, weight).float().div_(ctx.temperature), dim=-1)
            probs = logps.exp()
            g_logp = grad_logps[:, piece].reshape(-1, 1).float() * valid
            g_ent = grad_entropy[:, piece].reshape(-1, 1).float() * valid
            # d logp_label / d z = onehot - p;  d H / d z = -p (log p + H); in place: three vocabulary-wide tensors
            entropy = -torch.einsum("tv,tv->t", probs, logps).unsqueeze(1)
            dlogits = logps.add_(entropy).mul_(probs).mul_(-g_ent)
            dlogits.sub_(probs.mul_(g_logp))
            del probs
            dlogits.scatter_add_(1, target.clamp(min=0).unsqueeze(1), g_logp)
            dlogits.div_(ctx.temperature)
            grad_hidden[:, piece] = (dlogits.to(weight.dtype) @ weight).reshape(grad_hidden[:, piece].shape)
            grad_weight.addmm_(dlogits.t(), h.float())
        return grad_hidden, grad_weight.to(weight.dtype), None, None


def tiled_token_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    shift_labels: torch.Tensor,
    tile_tokens: int,
    temperature: float = 1.0,
    **model_kwargs: Any,
) -> dict[str, torch.Tensor]:
    """Per position, the values of its `shift_labels` token under `model` (a transformers causal LM, its logits
    divided by `temperature`): `TOKEN_FIELDS` by name, 0 where the label is -100, never holding the logits of more than
    `tile_tokens` positions ([Note: tiled per-token values]).

    Raises:
        ValueError: the model's config scales or soft-caps its logits (not applied here).
    """
    config = getattr(model, "config", None)
    scaled = {
        key: getattr(config, key, None)
        for key in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier")
        if getattr(config, key, None) not in (None, 1, 1.0)
    }
    if scaled:
        raise ValueError(f"tiled token values apply no logit scaling or soft-capping; the model's config has {scaled}")
    hidden = model.get_decoder()(input_ids=input_ids, **model_kwargs).last_hidden_state
    head = model.get_output_embeddings()
    if _fuse_head(head):
        values = head(hidden, tiled_loss=_ValuesRequest(shift_labels, tile_tokens, temperature))
        return dict(zip(TOKEN_FIELDS, values, strict=True))
    parts = [
        checkpoint(_head_tile, head, hidden[:, piece], shift_labels[:, piece], temperature, use_reentrant=False)
        for piece in _tiles(hidden.shape[1], tile_tokens)
    ]
    return {name: torch.cat([part[i] for part in parts], dim=1) for i, name in enumerate(TOKEN_FIELDS)}
