"""A batch cut along the sequence for Ulysses ([Note: Ulysses attention] in sequence/ulysses.py), and the loss of
the whole sequence from every rank's slice.

[Note: the loss over a sequence-parallel group]
Labels are shifted on the whole sequence before it is cut (`shift_labels`: the token each position predicts, so
the last token of a slice predicts the first of the next), padded with -100 to a multiple of the group size. Each rank computes the sum of its tokens' losses divided by the group's count of
valid tokens (`num_items_in_batch`, the Trainer's own argument), and the group adds the parts with an all-reduce
whose backward is an all-reduce too: every rank holds the whole sequence's loss, and each rank's backward reaches
every rank's part, so the group's gradient is p times the sequence's. The engine averages gradients over all of
its ranks, the p of each group included, which divides that back: the result is the data-parallel mean of the
sequences' losses, as DeepSpeed's ALST and transformers' `deepspeed_sp_compute_loss` give.
"""

from __future__ import annotations

from typing import Any

import torch

from accelerate_zero.engine import collectives
from accelerate_zero.engine.collectives import CommStats
from accelerate_zero.engine.groups import DataParallelGroup
from accelerate_zero.sequence.loader import IGNORE_INDEX, whole_rows
from accelerate_zero.sequence.tiling import tiled_causal_lm_loss


def shard_sequence(
    input_ids: torch.Tensor, labels: torch.Tensor, group: DataParallelGroup, pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """This rank's slice of `[batch, sequence]` tokens: `input_ids`, `position_ids` (the whole sequence's) and
    `shift_labels`, the sequence padded at its end to a multiple of the group size (the loader's rule,
    `whole_rows`)."""
    rows = whole_rows({"input_ids": input_ids, "labels": labels}, group.world_size, pad_token_id)
    width = rows["input_ids"].shape[1] // group.world_size
    return {key: value[:, group.rank * width : (group.rank + 1) * width] for key, value in rows.items()}


def valid_tokens(shift_labels: torch.Tensor, group: DataParallelGroup, stats: CommStats) -> torch.Tensor:
    """The group's count of tokens with a label (a tensor, for `num_items_in_batch`)."""
    count = (shift_labels != IGNORE_INDEX).sum().reshape(1).to(torch.float64)
    collectives.all_reduce(count, group, stats, kind="all_reduce_sequence")
    return count[0].clamp(min=1)  # a batch with no label at all: a loss of 0, not 0 / 0


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, part: torch.Tensor, group: DataParallelGroup, stats: CommStats) -> torch.Tensor:
        ctx.group, ctx.stats = group, stats
        total = part.detach().clone()
        collectives.all_reduce(total, group, stats, kind="all_reduce_sequence")
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        collectives.all_reduce(grad, ctx.group, ctx.stats, kind="all_reduce_sequence")
        return grad, None, None


def sequence_parallel_loss(
    model: torch.nn.Module,
    shard: dict[str, torch.Tensor],
    group: DataParallelGroup,
    stats: CommStats | None = None,
    tile_tokens: int | None = None,
    activations_on_host: bool = False,
    return_outputs: bool = False,
) -> Any:
    """The whole sequence's mean token loss, on every rank of `group`, from this rank's slice (`shard_sequence`, or
    a batch of `SequenceShardedLoader`: `shift_labels` and the model's inputs) ([Note: the loss over a
    sequence-parallel group]). `tile_tokens`: the LM head and the loss run in tiles of this many positions ([Note:
    tiling along the sequence] in sequence/tiling.py); None: the model's own loss. `activations_on_host`: what
    autograd keeps for backward (with gradient checkpointing, each layer's input) waits in host memory (torch's
    `save_on_cpu`, page-locked beside a GPU) and comes back for backward. `return_outputs`: (loss, the model's
    outputs); the outputs are None when tiled."""
    if activations_on_host:
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return sequence_parallel_loss(model, shard, group, stats, tile_tokens, return_outputs=return_outputs)
    if not model.training:
        raise RuntimeError(
            "sequence_parallel_loss on a model that is not training: its Ulysses attention is off (whole sequences "
            "per rank while evaluating); call model.train() first"
        )
    if "attention_mask" in shard:
        raise ValueError(
            "sequence_parallel_loss takes no attention_mask: each row is one causal sequence, padded at its end with "
            "labels -100 (SequenceShardedLoader checks a mask and drops it)"
        )
    stats = stats if stats is not None else CommStats()
    labels = shard["shift_labels"]
    inputs = {key: value for key, value in shard.items() if key not in ("shift_labels", "labels")}
    count = valid_tokens(labels, group, stats)
    outputs = None
    if tile_tokens is not None:
        input_ids = inputs.pop("input_ids")
        part = tiled_causal_lm_loss(model, input_ids, labels, count, tile_tokens, **inputs)
    else:
        outputs = model(**inputs, labels=labels, shift_labels=labels, num_items_in_batch=count)
        part = outputs.loss
    loss = _SumOverGroup.apply(part, group, stats)
    return (loss, outputs) if return_outputs else loss
